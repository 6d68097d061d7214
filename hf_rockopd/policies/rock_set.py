"""Rock sets: the Rock Score, the paper's selection rule, frequency-matched controls, and the JSON file format.

The Rock Score of a token type `v` is `R(v) = Freq(v) · mean divergence of v`, the divergence mass the type carries
(arXiv 2605.09253, §3). Selection drops types seen fewer than `min_count` times and the `exclude_top_frequent` most
frequent types (spaces and common punctuation), then keeps the `top_k` highest scores.

One file format serves the trainer's `rock_tokens.json`, the lab's `rock_set.json` and the `rock_freeze` policy, so a
set found in one place can be loaded in another as is.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


__all__ = [
    "ROCK_SET_FORMAT",
    "NotEnoughControlIdsError",
    "frequency_matched_ids",
    "load_rock_set",
    "rock_scores",
    "save_rock_set",
    "select_rock_tokens",
]

ROCK_SET_FORMAT = "hf_rockopd.rock_set"


class NotEnoughControlIdsError(ValueError):
    """Raised by `frequency_matched_ids` when too few non-rock ids are available to match every rock."""


def rock_scores(count: torch.Tensor, mean_divergence: torch.Tensor) -> torch.Tensor:
    """`R(v) = count(v) · mean_divergence(v)`, the divergence mass of each type; NaN means (never measured) give 0.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.policies.rock_set import rock_scores
    >>> rock_scores(torch.tensor([2.0, 10.0]), torch.tensor([1.0, 0.5])).tolist()
    [2.0, 5.0]
    ```
    """
    scores = count.double() * mean_divergence.double()
    return torch.nan_to_num(scores, nan=0.0)


def select_rock_tokens(
    count: torch.Tensor,
    mean_divergence: torch.Tensor,
    top_k: int = 100,
    min_count: int = 2,
    exclude_top_frequent: int = 5,
    exclude_ids: Sequence[int] = (),
) -> tuple[list[int], torch.Tensor]:
    """The paper's selection: drop rare and the most frequent types, keep the `top_k` highest Rock Scores.

    Args:
        count (`torch.Tensor`): `(V,)` occurrences of each token id.
        mean_divergence (`torch.Tensor`): `(V,)` mean divergence of each id (NaN where never measured).
        top_k (`int`): size of the selection.
        min_count (`int`): ids seen fewer times are ineligible.
        exclude_top_frequent (`int`): the this-many most frequent ids are ineligible.
        exclude_ids (`Sequence[int]`): ids that are never selected, whatever their score: the policies pass the
            tokenizer's stop and control tokens (`modeling.special_token_ids`), since freezing the stop token removes
            the signal that teaches the student when to stop. They still count among the most frequent.

    Returns:
        `(ids, scores)`: the selected ids, best first, and the `(V,)` Rock Scores of all ids.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.policies.rock_set import select_rock_tokens
    >>> count = torch.tensor([100.0, 50.0, 10.0, 1.0]); div = torch.tensor([1.0, 0.1, 2.0, 9.0])
    >>> select_rock_tokens(count, div, top_k=2, min_count=2, exclude_top_frequent=1)[0]
    [2, 1]
    >>> select_rock_tokens(count, div, top_k=2, min_count=2, exclude_top_frequent=0, exclude_ids=[0])[0]
    [2, 1]
    ```
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}.")
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}.")
    if exclude_top_frequent < 0:
        raise ValueError(f"exclude_top_frequent must be >= 0, got {exclude_top_frequent}.")
    count = count.double()
    scores = rock_scores(count, mean_divergence)
    eligible = (count >= min_count) & torch.isfinite(mean_divergence.double()) & (scores > 0)
    observed = int((count > 0).sum())
    n_exclude = min(exclude_top_frequent, observed)
    if n_exclude > 0:
        # Ties are broken by id (stable sort) so every process picks the same ids from the same counts.
        order = torch.sort(-count, stable=True).indices
        eligible[order[:n_exclude]] = False
    excluded = [int(i) for i in exclude_ids if 0 <= int(i) < len(eligible)]
    if excluded:
        eligible[excluded] = False
    masked = torch.where(eligible, scores, torch.full_like(scores, -math.inf))
    k = min(top_k, int(eligible.sum()))
    if k == 0:
        return [], scores
    order = torch.sort(-masked, stable=True).indices[:k]
    return order.tolist(), scores


def frequency_matched_ids(
    rock_ids: Sequence[int],
    counts: torch.Tensor,
    num_bins: int = 10,
    seed: int = 0,
    exclude_ids: Sequence[int] = (),
) -> list[int]:
    """A random id set whose frequency distribution matches that of `rock_ids`, bin by bin.

    Observed ids are split into `num_bins` quantile bins of log-frequency; each rock id is replaced by an id drawn
    without replacement from the non-rock ids of its own bin (the nearest bin with candidates left when its own is
    exhausted). Ids never observed (count 0) are matched among never-observed ids. The paper's "frequency-matched"
    control drew uniformly from the vocabulary instead, which over-samples rare ids.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.policies.rock_set import frequency_matched_ids
    >>> counts = torch.tensor([1000.0, 900.0, 5.0, 4.0, 3.0, 800.0])
    >>> sorted(frequency_matched_ids([0], counts, num_bins=2, seed=0)) in ([1], [5])
    True
    ```
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}.")
    counts = counts.double().cpu().numpy()
    vocab = counts.shape[0]
    rock = np.zeros(vocab, dtype=bool)
    rock[list(rock_ids)] = True
    blocked = rock.copy()
    if len(exclude_ids):
        blocked[list(exclude_ids)] = True

    observed = counts > 0
    bins = np.full(vocab, -1, dtype=np.int64)  # -1: never observed
    if observed.any():
        log_c = np.log(counts[observed])
        edges = np.quantile(log_c, np.linspace(0, 1, num_bins + 1)[1:-1]) if num_bins > 1 else np.array([])
        bins[observed] = np.searchsorted(edges, log_c, side="right")
    rng = np.random.default_rng(seed)
    pools = {b: list(rng.permutation(np.flatnonzero((bins == b) & ~blocked))) for b in range(-1, num_bins)}
    chosen: list[int] = []
    for rid in rock_ids:
        b = int(bins[rid])
        order = [b] if b == -1 else sorted(range(num_bins), key=lambda x: (abs(x - b), x))
        for candidate_bin in order:
            if pools[candidate_bin]:
                chosen.append(int(pools[candidate_bin].pop()))
                break
        else:
            raise NotEnoughControlIdsError(
                f"Cannot draw a frequency-matched control for {len(rock_ids)} rock ids: only {len(chosen)} non-rock "
                "ids are available. Use a smaller rock set or a larger reference corpus."
            )
    return chosen


def load_rock_set(path: str | os.PathLike, vocab_size: int | None = None) -> dict[str, Any]:
    """Read and validate a rock-set JSON file (`token_ids` required; `vocab_size`, `tokens`, ... optional).

    Raises `ValueError` naming the file for malformed JSON, a missing or empty `token_ids`, non-integer or
    out-of-range ids, and a file written for another vocabulary size.

    Example:
    ```python
    >>> import json, tempfile
    >>> from hf_rockopd.policies.rock_set import load_rock_set
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False); json.dump({"token_ids": [3, 5]}, f); f.close()
    >>> load_rock_set(f.name, vocab_size=10)["token_ids"]
    [3, 5]
    ```
    """
    path = os.fspath(path)
    data = _read_json(path, f"Rock-set file {path!r}", "Regenerate it or fix it by hand.")
    if isinstance(data, list):
        data = {"token_ids": data}
    if not isinstance(data, dict) or "token_ids" not in data:
        raise ValueError(
            f"Rock-set file {path!r} has no 'token_ids' list. Expected a JSON object like "
            '{"token_ids": [13, 198, ...], "vocab_size": 49152}.'
        )
    file_vocab = data.get("vocab_size")
    if vocab_size is not None and file_vocab is not None and int(file_vocab) != int(vocab_size):
        raise ValueError(
            f"Rock-set file {path!r} was made for a vocabulary of {file_vocab} tokens "
            f"(tokenizer {data.get('tokenizer', 'unknown')!r}), but the model's vocabulary has {vocab_size}. "
            "Token ids do not carry over between vocabularies; rebuild the rock set with this tokenizer."
        )
    data["token_ids"] = validate_token_ids(data["token_ids"], vocab_size, source=f"rock-set file {path!r}")
    return data


def check_rock_set_tokenizer(path: str | os.PathLike, decode: Callable[[list[int]], str]) -> None:
    """Raise `ValueError` naming the file if its decoded tokens are not what `decode` gives for the same ids.

    Catches a rock set made with another tokenizer of the same vocabulary size, which the size check cannot. Files
    without decoded `tokens` rows (a bare id list) cannot be checked and pass.

    Example:
    ```python
    >>> import os, tempfile
    >>> from hf_rockopd.policies.rock_set import check_rock_set_tokenizer, save_rock_set
    >>> path = os.path.join(tempfile.mkdtemp(), "rock_set.json")
    >>> save_rock_set(path, [{"token_id": 1, "token": "b"}], vocab_size=3)
    >>> check_rock_set_tokenizer(path, lambda ids: "abc"[ids[0]])  # same tokenizer: no error
    ```
    """
    data = load_rock_set(path)
    rows = [r for r in data.get("tokens") or [] if isinstance(r, dict) and isinstance(r.get("token"), str)]
    mismatched = [(int(r["token_id"]), r["token"], decode([int(r["token_id"])])) for r in rows]
    mismatched = [m for m in mismatched if m[1] != m[2]]
    if mismatched:
        shown = ", ".join(f"id {i}: file {a!r} vs tokenizer {b!r}" for i, a, b in mismatched[:5])
        raise ValueError(
            f"Rock-set file {os.fspath(path)!r} was made with another tokenizer "
            f"({data.get('tokenizer', 'unknown')!r}): {len(mismatched)} of {len(rows)} tokens decode differently "
            f"({shown}). Rebuild the rock set with this run's tokenizer."
        )


def validate_token_ids(token_ids: Any, vocab_size: int | None, source: str) -> list[int]:
    """Check that `token_ids` is a non-empty list of distinct in-range integers; return it as a list of ints."""
    if not isinstance(token_ids, (list, tuple)) or isinstance(token_ids, str):
        raise ValueError(f"token_ids of {source} must be a list of integers, got {type(token_ids).__name__}.")
    if len(token_ids) == 0:
        raise ValueError(
            f"{source} has an empty token_ids list: nothing would be frozen. Give at least one id, or use the "
            "'uniform' policy for plain on-policy distillation."
        )
    bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
    if bad:
        raise ValueError(f"token_ids of {source} must be integers; found {bad[:5]!r}.")
    ids = [int(t) for t in token_ids]
    if vocab_size is not None:
        out_of_range = [t for t in ids if t < 0 or t >= vocab_size]
        if out_of_range:
            raise ValueError(
                f"token_ids of {source} contain ids outside the vocabulary [0, {vocab_size}): {out_of_range[:10]}."
            )
    if len(set(ids)) != len(ids):
        raise ValueError(f"token_ids of {source} contain duplicates.")
    return ids


def save_rock_set(
    path: str | os.PathLike,
    tokens: Sequence[dict[str, Any]],
    vocab_size: int,
    tokenizer_name: str | None = None,
    **metadata: Any,
) -> None:
    """Write a rock set in the shared format. `tokens` are dicts with at least `token_id`, best first.

    Example:
    ```python
    >>> import tempfile, os
    >>> from hf_rockopd.policies.rock_set import load_rock_set, save_rock_set
    >>> path = os.path.join(tempfile.mkdtemp(), "rock_set.json")
    >>> save_rock_set(path, [{"token_id": 7, "token": "So", "count": 12}], vocab_size=100, policy="rock_online")
    >>> load_rock_set(path, vocab_size=100)["token_ids"]
    [7]
    ```
    """
    payload = {
        "format": ROCK_SET_FORMAT,
        "version": 1,
        "token_ids": [int(t["token_id"]) for t in tokens],
        "vocab_size": int(vocab_size),
        "tokenizer": tokenizer_name,
        **metadata,
        "tokens": [dict(t) for t in tokens],
    }
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, ensure_ascii=False, allow_nan=False, default=_json_default)
    os.replace(tmp, path)


def _read_json(path: str, what: str, hint: str) -> Any:
    """The JSON in `path`; a missing file or invalid JSON is an error naming `what` and ending with `hint`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} does not exist. {hint}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} is not valid JSON ({err}). {hint}") from err


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if torch.is_tensor(obj):
        return obj.tolist()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


# ------------------------------------------------------------------------------------------- rock_tokens.json ----
# A trainer's final rock set, decoded, in the format above: written to its output directory and to every checkpoint,
# read back by the model card. This block is the one owner of that file's name and of the decoding of its rows.
ROCK_TOKENS_NAME = "rock_tokens.json"
__all__ += ["ROCK_TOKENS_NAME", "decode_rock_rows", "load_rock_tokens", "write_rock_tokens"]
_ROCK_TOKENS_HINT = "RockOPDTrainer writes it to its output directory at the end of train() (write_rock_tokens)."


def decode_rock_rows(rows: Sequence[dict[str, Any]], tokenizer: Any | None) -> list[dict[str, Any]]:
    """Copies of a policy's `rock_table()` rows with a `token` field: the id decoded (`None` without a tokenizer).

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_tokenizer
    >>> from hf_rockopd.policies.rock_set import decode_rock_rows
    >>> decode_rock_rows([{"token_id": 32, "count": 3}], build_tiny_tokenizer())
    [{'token_id': 32, 'count': 3, 'token': 'A'}]
    ```
    """
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
    return [{**row, "token": tokenizer.decode([row["token_id"]]) if tokenizer is not None else None} for row in rows]


def write_rock_tokens(
    directory: str | os.PathLike,
    rows: Sequence[dict[str, Any]],
    vocab_size: int,
    tokenizer: Any | None = None,
    **metadata: Any,
) -> str:
    """Write `rows` (a policy's `rock_table()`), decoded with `tokenizer`, to `directory/rock_tokens.json`.

    `metadata` (the policy's name and options, the step) is stored beside the rows. Returns the file's path.

    Example:
    ```python
    >>> import tempfile
    >>> from hf_rockopd.models import build_tiny_tokenizer
    >>> from hf_rockopd.policies.rock_set import load_rock_tokens, write_rock_tokens
    >>> run = tempfile.mkdtemp()
    >>> path = write_rock_tokens(run, [{"token_id": 32}], vocab_size=259, tokenizer=build_tiny_tokenizer(), step=3)
    >>> load_rock_tokens(run)["tokens"]
    [{'token_id': 32, 'token': 'A'}]
    ```
    """
    os.makedirs(directory, exist_ok=True)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    path = os.path.join(os.fspath(directory), ROCK_TOKENS_NAME)
    save_rock_set(
        path,
        decode_rock_rows(rows, tokenizer),
        vocab_size=vocab_size,
        tokenizer_name=getattr(tokenizer, "name_or_path", None),
        **metadata,
    )
    return path


def load_rock_tokens(directory: str | os.PathLike) -> dict[str, Any]:
    """Read `directory/rock_tokens.json` as a trainer wrote it (an empty `tokens` list when nothing was frozen).

    Unlike [`load_rock_set`] this accepts an empty set, and a bare `token_ids` file gains `tokens` rows. Raises
    `FileNotFoundError` when the file is missing and `ValueError` when it is not JSON or not a rock-set object.

    Example:
    ```python
    >>> import tempfile
    >>> from hf_rockopd.policies.rock_set import load_rock_tokens, write_rock_tokens
    >>> run = tempfile.mkdtemp()
    >>> _ = write_rock_tokens(run, [], vocab_size=259, policy="uniform")
    >>> load_rock_tokens(run)["tokens"], load_rock_tokens(run)["policy"]
    ([], 'uniform')
    ```
    """
    path = os.path.join(os.fspath(directory), ROCK_TOKENS_NAME)
    data = _read_json(path, path, _ROCK_TOKENS_HINT)
    if not isinstance(data, dict) or not isinstance(data.get("tokens", data.get("token_ids")), list):
        raise ValueError(
            f"{path} is not a rock-set file: expected a JSON object with a 'tokens' list, as written by "
            "RockOPDTrainer.write_rock_tokens."
        )
    if "tokens" not in data:
        data["tokens"] = [{"token_id": int(i)} for i in data["token_ids"]]
    return data
