"""Rock selection on a token table: the Rock Score and the paper's rule, the stability sweep, matched controls, and
the early-vs-late comparison of the paper's groups.

Example:
```python
result = score_token_table(load_token_table("tables/early"), top_k=100)
result.save("rock_set.json")  # loadable by the `rock_freeze` policy as is
frame, k = stability_sweep(load_token_table("tables/early"))
```
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from scipy import stats

from ..policies.rock_set import frequency_matched_ids, save_rock_set, select_rock_tokens
from .table import TokenTable, check_same_tokenizer


__all__ = [
    "ScoreResult",
    "compare_token_tables",
    "comparison_groups",
    "matched_controls",
    "rare_high_divergence_ids",
    "score_token_table",
    "stability_sweep",
]


@dataclass
class ScoreResult:
    """The outcome of `score_token_table`.

    Attributes:
        rock_ids: selected ids, best first.
        scores: one row per observed type: `token_id`, `token`, `count`, `mean_divergence`, `rock_score`, `eligible`,
            `rank` (1-based among eligible types, by Rock Score), `is_rock`.
        rock_token_share: share of generated tokens whose type is a rock (the paper's headline measure).
        divergence_coverage: share of the corpus's divergence mass that rock tokens carry.
        settings: the selection settings.
    """

    rock_ids: list[int]
    scores: pd.DataFrame
    rock_token_share: float
    divergence_coverage: float
    vocab_size: int
    tokenizer: str | None
    settings: dict[str, Any]

    def tokens(self) -> list[dict[str, Any]]:
        """The rock set in the shared rock-set format's `tokens` entries, best first."""
        rocks = self.scores.set_index("token_id").loc[self.rock_ids]
        return [
            {
                "token_id": int(i),
                "token": str(r["token"]),
                "count": int(r["count"]),
                "mean_divergence": float(r["mean_divergence"]),
                "rock_score": float(r["rock_score"]),
            }
            for i, r in rocks.iterrows()
        ]

    def save(self, path: str | os.PathLike) -> None:
        """Write `rock_set.json`, which the `rock_freeze` policy loads as is."""
        save_rock_set(
            path,
            self.tokens(),
            vocab_size=self.vocab_size,
            tokenizer_name=self.tokenizer,
            source="hf_rockopd.lab.score_token_table",
            selection=self.settings,
            rock_token_share=self.rock_token_share,
            divergence_coverage=self.divergence_coverage,
        )


# A control token of a chat template (`<|im_end|>`, `<|eot_id|>`, `<|endoftext|>`): how a table collected before
# `special_ids` were recorded in its metadata still knows its stop and control tokens.
_CONTROL_TOKEN = re.compile(r"<\|[^|\s]+\|>")


def special_ids_of_table(table: TokenTable) -> list[int]:
    """The stop and control ids of the tokenizer that made `table`, never rocks by default: its metadata's
    `special_ids` (`modeling.special_token_ids`, recorded by `collect_token_table`), else the ids whose text has a
    control token's form (`<|...|>`).

    Example:
    ```python
    >>> import pandas as pd
    >>> from hf_rockopd.lab import load_token_table
    >>> from hf_rockopd.lab.selection import special_ids_of_table
    >>> frame = pd.DataFrame({"prompt_index": [0, 0], "token_id": [5, 9], "token": ["a", "<|im_end|>"],
    ...                       "divergence": [1.0, 2.0]})
    >>> special_ids_of_table(load_token_table(frame))
    [9]
    ```
    """
    if table.meta.get("special_ids") is not None:
        return [int(i) for i in table.meta["special_ids"]]
    return sorted(i for i, text in table.decode().items() if _CONTROL_TOKEN.fullmatch(text.strip()))


def _eligible_ranking(
    counts: np.ndarray, mean_div: np.ndarray, min_count: int, exclude_top_frequent: int,
    exclude_ids: Sequence[int] = (),
) -> tuple[list[int], np.ndarray]:
    vocab = counts.shape[0]
    ranked, scores = select_rock_tokens(
        torch.from_numpy(counts),
        torch.from_numpy(mean_div),
        top_k=max(vocab, 1),
        min_count=min_count,
        exclude_top_frequent=exclude_top_frequent,
        exclude_ids=exclude_ids,
    )
    return ranked, scores.numpy()


def score_token_table(
    table: TokenTable,
    top_k: int | None = 100,
    min_count: int = 2,
    exclude_top_frequent: int = 5,
    coverage: float | None = None,
    exclude_ids: Sequence[int] | None = None,
    allow_special_tokens: bool = False,
) -> ScoreResult:
    """Rock Score every type and select rocks with the paper's rule (§3.2), or by divergence coverage.

    Types seen fewer than `min_count` times and the `exclude_top_frequent` most frequent types are ineligible; the
    `top_k` eligible types with the highest `R(v)` are rocks. With `coverage` instead, K is the smallest number of top
    types whose divergence mass reaches that share of the corpus's total. Stop and control tokens are never rocks
    (`exclude_ids`, default: `special_ids_of_table(table)`; freezing the stop token unteaches stopping) unless
    `allow_special_tokens`.

    Raises `ValueError` when `top_k` exceeds the number of eligible types (name both and how to relax the rule).

    Example:
    ```python
    >>> import pandas as pd
    >>> from hf_rockopd.lab import load_token_table, score_token_table
    >>> frame = pd.DataFrame({"prompt_index": [0] * 6, "token_id": [1, 1, 2, 2, 2, 3], "token": list("aabbbc"),
    ...                       "divergence": [2.0, 2.0, 0.1, 0.1, 0.1, 5.0]})
    >>> score_token_table(load_token_table(frame), top_k=1, exclude_top_frequent=0).rock_ids
    [1]
    ```
    """
    if (top_k is None) == (coverage is None):
        raise ValueError(f"Give exactly one of top_k and coverage, got top_k={top_k} and coverage={coverage}.")
    if coverage is not None and not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}.")
    counts, mean_div = table.counts(), table.mean_divergence()
    if exclude_ids is None:
        exclude_ids = [] if allow_special_tokens else special_ids_of_table(table)
    ranked, scores = _eligible_ranking(counts, mean_div, min_count, exclude_top_frequent, exclude_ids)
    total_mass = float(table.divergence_sums().sum())
    if coverage is not None:
        if total_mass <= 0:
            raise ValueError(f"Token table {table.source} has zero total divergence; coverage selection is undefined.")
        cum = np.cumsum(scores[ranked]) / total_mass
        reach = np.flatnonzero(cum >= coverage - 1e-12)
        if len(reach) == 0:
            raise ValueError(
                f"The {len(ranked)} eligible types of {table.source} carry only {cum[-1] if len(cum) else 0:.3f} of the "
                f"divergence, below coverage={coverage}. Lower coverage, min_count or exclude_top_frequent."
            )
        k = int(reach[0]) + 1
    else:
        if top_k > len(ranked):
            raise ValueError(
                f"top_k={top_k} exceeds the {len(ranked)} eligible types of {table.source} (seen >= min_count="
                f"{min_count} times, not among the {exclude_top_frequent} most frequent). Lower top_k, min_count or "
                "exclude_top_frequent, or collect on more prompts."
            )
        k = top_k
    rock_ids = ranked[:k]
    observed = np.flatnonzero(counts > 0)
    rank = np.zeros(counts.shape[0], dtype=np.int64)
    rank[ranked] = np.arange(1, len(ranked) + 1)
    decoded = table.decode()
    is_rock = np.zeros(counts.shape[0], dtype=bool)
    is_rock[rock_ids] = True
    frame = pd.DataFrame(
        {
            "token_id": observed,
            "token": [decoded.get(int(i), "") for i in observed],
            "count": counts[observed].astype(np.int64),
            "mean_divergence": mean_div[observed],
            "rock_score": scores[observed],
            "eligible": rank[observed] > 0,
            "rank": rank[observed],
            "is_rock": is_rock[observed],
        }
    ).sort_values(["rock_score", "token_id"], ascending=[False, True], ignore_index=True)
    return ScoreResult(
        rock_ids=[int(i) for i in rock_ids],
        scores=frame,
        rock_token_share=float(counts[rock_ids].sum() / counts.sum()),
        divergence_coverage=float(scores[rock_ids].sum() / total_mass) if total_mass > 0 else 0.0,
        vocab_size=table.vocab_size,
        tokenizer=table.meta.get("tokenizer"),
        settings={
            "top_k": k,
            "min_count": min_count,
            "exclude_top_frequent": exclude_top_frequent,
            "coverage": coverage,
            "excluded_ids": [int(i) for i in exclude_ids],
            "eligible_types": len(ranked),
            "observed_types": int(len(observed)),
        },
    )


def _jaccard(a: Iterable[int], b: Iterable[int]) -> float:
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def stability_sweep(
    table: TokenTable,
    ks: Sequence[int] = (25, 50, 100, 150, 200),
    subcorpus_sizes: Sequence[int] | None = None,
    repeats: int = 5,
    min_count: int = 2,
    exclude_top_frequent: int = 5,
    threshold: float = 0.7,
    seed: int = 42,
    allow_special_tokens: bool = False,
) -> tuple[pd.DataFrame, int | None]:
    """Jaccard overlap between the top-K of random sub-corpora (of whole prompts) and the full corpus's top-K.

    For each sub-corpus size `n` (number of prompts, default 1/8, 1/4, 1/2 and 4/5 of the corpus) and each K, `repeats`
    sub-corpora are drawn without replacement. The recommended K is the largest K whose mean Jaccard is at least
    `threshold` at every sub-corpus size (the paper kept K = 100, where it stayed above 0.70), or `None` if none is.

    Returns:
        `(frame, recommended_k)`: one row per `(subcorpus_size, k)` with `jaccard_mean`, `jaccard_min`, `jaccard_max`.

    Example:
    ```python
    frame, k = stability_sweep(load_token_table("tables/early"), ks=(50, 100, 150))
    ```
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    if any(k < 1 for k in ks) or not ks:
        raise ValueError(f"ks must be a non-empty list of integers >= 1, got {list(ks)}.")
    special = [] if allow_special_tokens else special_ids_of_table(table)  # as score_token_table selects
    prompts = np.unique(table.frame["prompt_index"].to_numpy())
    if subcorpus_sizes is None:
        subcorpus_sizes = sorted({max(1, int(len(prompts) * f)) for f in (0.125, 0.25, 0.5, 0.8)})
    bad = [n for n in subcorpus_sizes if not 1 <= n <= len(prompts)]
    if bad:
        raise ValueError(f"subcorpus_sizes {bad} are outside [1, {len(prompts)}] (the corpus's number of prompts).")
    vocab = table.vocab_size

    def ranking(frame: pd.DataFrame) -> list[int]:
        sub = TokenTable(frame=frame, meta={"vocab_size": vocab})
        return _eligible_ranking(sub.counts(), sub.mean_divergence(), min_count, exclude_top_frequent, special)[0]

    full = ranking(table.frame)
    rng = np.random.default_rng(seed)
    by_prompt = table.frame["prompt_index"].to_numpy()
    rows = []
    for n in subcorpus_sizes:
        subsets = [rng.choice(prompts, n, replace=False) for _ in range(repeats)]
        draws = [ranking(table.frame[np.isin(by_prompt, subset)]) for subset in subsets]
        for k in ks:
            values = [_jaccard(d[:k], full[:k]) for d in draws]
            rows.append(
                {
                    "subcorpus_size": int(n),
                    "k": int(k),
                    "jaccard_mean": float(np.mean(values)),
                    "jaccard_min": float(np.min(values)),
                    "jaccard_max": float(np.max(values)),
                }
            )
    frame = pd.DataFrame(rows)
    worst = frame.groupby("k")["jaccard_mean"].min()
    passing = [int(k) for k, v in worst.items() if v >= threshold]
    return frame, (max(passing) if passing else None)


# ---------------------------------------------------------------------------------------------------------------------
# Controls and the early-vs-late comparison
# ---------------------------------------------------------------------------------------------------------------------


def matched_controls(table: TokenTable, rock_ids: Sequence[int], num_bins: int = 10, seed: int = 0) -> list[int]:
    """Random non-rock ids matched bin by bin to the rock set's log-frequency distribution in `table`.

    Unlike the paper's control (uniform over the vocabulary), every control id comes from the same frequency bin as
    the rock it replaces; see `hf_rockopd.policies.rock_set.frequency_matched_ids`.

    Example:
    ```python
    controls = matched_controls(load_token_table("tables/early"), result.rock_ids, seed=0)
    ```
    """
    if not rock_ids:
        raise ValueError("matched_controls got an empty rock set; score the table first.")
    return frequency_matched_ids(list(rock_ids), torch.from_numpy(table.counts()), num_bins=num_bins, seed=seed)


def rare_high_divergence_ids(
    table: TokenTable, n: int, exclude_ids: Sequence[int] = (), min_count: int = 2
) -> list[int]:
    """The `n` types with the highest mean divergence among those seen `min_count` times up to the median count.

    The paper's contrast group: types rare enough not to matter by mass, but badly matched each time they occur.
    """
    counts, mean = table.counts(), table.mean_divergence()
    seen = np.flatnonzero(counts >= min_count)
    seen = np.setdiff1d(seen, np.asarray(list(exclude_ids), dtype=np.int64))
    if len(seen) == 0:
        return []
    rare = seen[counts[seen] <= np.median(counts[seen])]
    order = rare[np.lexsort((rare, -mean[rare]))]
    return [int(i) for i in order[:n]]


def comparison_groups(
    table: TokenTable, rock_ids: Sequence[int], n_rare: int | None = None, seed: int = 0
) -> dict[str, list[int]]:
    """The paper's three groups, defined on `table`: rocks, rare high-divergence types, a matched random control.

    `compare_token_tables`, `gradient_geometry` and the report's figures all compare these groups.

    Example:
    ```python
    groups = comparison_groups(load_token_table("tables/early"), result.rock_ids)
    sorted(groups)  # ['random_matched', 'rare_high_divergence', 'rock']
    ```
    """
    n_rare = len(rock_ids) if n_rare is None else n_rare
    return {
        "rock": list(rock_ids),
        "rare_high_divergence": rare_high_divergence_ids(table, n_rare, exclude_ids=rock_ids),
        "random_matched": matched_controls(table, rock_ids, seed=seed),
    }


def compare_token_tables(
    early: TokenTable,
    late: TokenTable,
    rock_ids: Sequence[int],
    n_rare: int | None = None,
    seed: int = 0,
) -> pd.DataFrame:
    """Per-type mean divergence in two tables (e.g. early and late checkpoints) for rocks, rare types and controls.

    The groups are defined on `early`: the rocks, the rare high-divergence types, and a frequency-matched random
    control. For each group the per-type mean divergences of the types seen in both tables are paired and tested with
    the Wilcoxon signed-rank test (`scipy.stats.wilcoxon`, two-sided). The paper found rocks flat (0.21 → 0.19) while
    rare types fell (2.02 → 0.85).

    Returns:
        one row per group: `group`, `types` (paired), `median_early`, `median_late`, `median_shift`, `statistic`,
        `p_value` (NaN with fewer than 2 pairs or no non-zero difference).

    Example:
    ```python
    frame = compare_token_tables(load_token_table("tables/early"), load_token_table("tables/late"), result.rock_ids)
    ```
    """
    check_same_tokenizer(early, late)
    if not rock_ids:
        raise ValueError("compare_token_tables got an empty rock set; score the early table first.")
    groups = comparison_groups(early, rock_ids, n_rare, seed)
    mean_early, mean_late = early.mean_divergence(), late.mean_divergence()
    rows = []
    for name, ids in groups.items():
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[np.isfinite(mean_early[ids]) & np.isfinite(mean_late[ids])] if len(ids) else ids
        a, b = mean_early[ids], mean_late[ids]
        statistic = p_value = float("nan")
        if len(ids) >= 2 and np.any(a != b):
            test = stats.wilcoxon(a, b)
            statistic, p_value = float(test.statistic), float(test.pvalue)
        rows.append(
            {
                "group": name,
                "types": int(len(ids)),
                "median_early": float(np.median(a)) if len(ids) else float("nan"),
                "median_late": float(np.median(b)) if len(ids) else float("nan"),
                "median_shift": float(np.median(b - a)) if len(ids) else float("nan"),
                "statistic": statistic,
                "p_value": p_value,
            }
        )
    return pd.DataFrame(rows)
