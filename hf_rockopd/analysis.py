"""The rock-token lab: collect token tables, score and select rock tokens, and test them the way the paper does.

Each step reads and writes plain files, so steps can be rerun and compared (arXiv 2605.09253, §3-§4):

- `collect_token_table`: roll out prompts with the student, score every generated token against the teacher with the
  training divergence, and write a *token table* (one row per generated token) as Parquet parts in a directory.
- `score_token_table`: the Rock Score `R(v) = Freq(v) · mean divergence` per type and the paper's selection.
- `stability_sweep`: Jaccard overlap of the top-K of random sub-corpora with the full corpus's, to pick K.
- `compare_token_tables`: per-type mean divergence of two tables (early and late checkpoints) for rocks, rare
  high-divergence types and a frequency-matched random control, with Wilcoxon signed-rank tests.
- `gradient_cosines`: each token's cosine with G_balanced (the sum over types of each type's mean logit gradient).
- `gradient_geometry`: per-occurrence logit-gradient norms and cosines of rocks, rare types and controls, with
  Mann-Whitney tests.
- `matched_controls`: a random id set truly matched to the rock set's frequency distribution.
- `knockout`: ban one token at inference and test the accuracy change on GSM8K-style problems, with
  `paired_bootstrap` p-values and `benjamini_hochberg` q-values.

Example:
```python
from hf_rockopd.analysis import collect_token_table, load_token_table, score_token_table

collect_token_table(student, teacher, tokenizer, prompts, "tables/early", max_new_tokens=256)
result = score_token_table(load_token_table("tables/early"), top_k=100)
print(result.rock_token_share, result.divergence_coverage)
result.save("rock_set.json")  # loadable by the `rock_freeze` policy as is
```
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from scipy import stats
from transformers.utils import logging

from .gsm8k import extract_numeric_answer, load_gsm8k_problems  # one parser for the knockout and `hf-rockopd eval`
from .modeling import check_same_vocabulary, vocab_size
from .losses import logit_grad_norm, per_token_divergence, per_token_entropy
from .rock_set import frequency_matched_ids, save_rock_set, select_rock_tokens


logger = logging.get_logger(__name__)

__all__ = [
    "GRAD_COSINE_FILE",
    "TOKEN_TABLE_COLUMNS",
    "ScoreResult",
    "TokenTable",
    "benjamini_hochberg",
    "check_same_tokenizer",
    "extract_numeric_answer",
    "knockout",
    "load_problems",
    "collect_token_table",
    "compare_token_tables",
    "gradient_cosines",
    "gradient_geometry",
    "load_prompts",
    "load_token_table",
    "matched_controls",
    "paired_bootstrap",
    "rare_high_divergence_ids",
    "score_token_table",
    "stability_sweep",
]

TOKEN_TABLE_COLUMNS = (
    "prompt_index",
    "position",
    "token_id",
    "token",
    "divergence",
    "student_entropy",
    "teacher_entropy",
    "logit_grad_norm",
)
# Parquet schema metadata keys: a table knows the tokenizer and settings that made it, so two tables from different
# tokenizers are never compared by token id.
_META_KEY = b"hf_rockopd"


# ---------------------------------------------------------------------------------------------------------------------
# Prompts and token tables
# ---------------------------------------------------------------------------------------------------------------------


def _read_jsonl(path: str | os.PathLike, limit: int | None) -> Iterable[tuple[int, Any]]:
    """`(line number, parsed row)` of the non-blank lines of a JSON-lines file, at most `limit` of them."""
    taken = 0
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if limit is not None and taken >= limit:
                return
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {line_no}: not valid JSON ({err.msg}).") from err
            taken += 1
            yield line_no, row


def load_prompts(path: str | os.PathLike, limit: int | None = None, field_name: str | None = None) -> list[Any]:
    """Read prompts from a JSON-lines file: each line has `messages` (a chat), `prompt` or `question` (GSM8K).

    Returns chat message lists (`[{"role": "user", "content": ...}]`), the form `collect_token_table` takes.

    Example:
    ```python
    >>> import tempfile, os, json
    >>> from hf_rockopd.analysis import load_prompts
    >>> path = os.path.join(tempfile.mkdtemp(), "p.jsonl")
    >>> _ = open(path, "w").write(json.dumps({"question": "1 + 1?", "answer": "2"}) + "\\n")
    >>> load_prompts(path)
    [[{'role': 'user', 'content': '1 + 1?'}]]
    ```
    """
    fields = [field_name] if field_name else ["messages", "prompt", "question"]
    prompts: list[Any] = []
    for line_no, row in _read_jsonl(path, limit):
        found = next((name for name in fields if isinstance(row, dict) and row.get(name)), None)
        if found is None:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(
                f"{path}, line {line_no}: no prompt field; expected one of {fields}, got {keys}. Pass "
                "`field_name=` (`--prompt-field`) to name the column that holds the prompt."
            )
        value = row[found]
        if found == "messages":
            # Drop a trailing assistant answer: the student must generate it.
            value = [m for m in value if m.get("role") != "assistant"] or value
            prompts.append(value)
        else:
            prompts.append([{"role": "user", "content": str(value)}])
    if not prompts:
        raise ValueError(f"{path} holds no prompt. Give a JSON-lines file with one prompt per line.")
    return prompts


def _as_chat(prompt: Any) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _encode_chats(tokenizer: Any, chats: Sequence[list[dict[str, str]]]) -> Any:
    """Chat prompts with the generation prompt, left-padded (so every completion starts at the same column)."""
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in chats]
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = padding_side


def _generate(
    model: torch.nn.Module,
    tokenizer: Any,
    chats: Sequence[list[dict[str, str]]],
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    suppress_tokens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Generate from chat prompts, left-padded: `(sequences, prompt attention mask, prompt length)`."""
    enc = _encode_chats(tokenizer, chats).to(next(model.parameters()).device)
    sequences = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=temperature if do_sample else None,
        top_p=None,
        top_k=None,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # A ban: the token's logit is -inf at every step (transformers' SuppressTokensLogitsProcessor).
        suppress_tokens=list(suppress_tokens) if suppress_tokens else None,
    )
    return sequences, enc["attention_mask"], enc["input_ids"].shape[1]


@torch.no_grad()
def collect_token_table(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Any],
    output_dir: str | os.PathLike,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    do_sample: bool = False,
    seed: int = 42,
    beta: float = 1.0,
    temperature: float = 1.0,
    show_progress: bool = True,
    gradient_cosine: bool = True,
) -> str:
    """Roll out `prompts` with the student and write one row per generated token, scored against the teacher.

    Every generated token gets the full-vocabulary divergence of the distribution that produced it (the training
    divergence, TRL's `beta` convention; the paper uses the reverse KL, `beta=1`, at temperature 1), both entropies,
    and the closed-form logit-gradient norm. The table is written as one Parquet part per batch under `output_dir`;
    a rerun skips the parts already written, so an interrupted collection resumes where it stopped. Sampling
    (`do_sample=True`) is seeded per batch, so a resumed run draws what an uninterrupted one would.

    With `gradient_cosine` (default), `gradient_cosines` then adds each token's cosine with the balanced gradient
    (two more forward passes of both models per batch, no generation).

    Args:
        prompts: chat message lists (see `load_prompts`) or plain strings (sent as one user message).
        output_dir: directory of the table; `load_token_table` reads it.

    Returns:
        `str`: `output_dir`.

    Example:
    ```python
    collect_token_table(student, teacher, tokenizer, load_prompts("gsm8k.jsonl", limit=500), "tables/early")
    ```
    """
    from tqdm.auto import tqdm

    if len(prompts) == 0:
        raise ValueError("collect_token_table got no prompt. Give at least one prompt.")
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}.")
    student_vocab = check_same_vocabulary(student, teacher)
    os.makedirs(output_dir, exist_ok=True)
    meta = {
        "tokenizer": getattr(tokenizer, "name_or_path", None) or None,
        "vocab_size": student_vocab,
        "beta": beta,
        "temperature": temperature,
        "do_sample": do_sample,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(prompts),
    }
    _check_meta_matches(output_dir, meta)
    with open(os.path.join(output_dir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)

    eos_id = tokenizer.eos_token_id
    was_training = (student.training, teacher.training)
    student.eval()
    teacher.eval()
    starts = list(range(0, len(prompts), batch_size))
    cosine_path = os.path.join(output_dir, GRAD_COSINE_FILE)
    try:
        for part, start in enumerate(tqdm(starts, desc="collect", disable=not show_progress)):
            path = os.path.join(output_dir, f"part-{part:05d}.parquet")
            if os.path.exists(path):
                continue
            if os.path.exists(cosine_path):
                os.remove(cosine_path)  # G_balanced is a corpus-wide sum: a new part makes every cosine stale
            chunk = prompts[start : start + batch_size]
            batch = [_as_chat(p) for p in chunk]
            torch.manual_seed(seed + part)
            generated, prompt_mask, prompt_len = _generate(
                student, tokenizer, batch, max_new_tokens, do_sample=do_sample, temperature=temperature
            )
            completion = generated[:, prompt_len:]
            # Valid completion tokens: everything up to and including the first eos.
            is_eos = completion == eos_id
            after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
            valid = ~after_eos
            attention = torch.cat([prompt_mask, valid.long()], dim=1)
            s_logits = _completion_logits(student, generated, attention, prompt_len)
            t_logits = _completion_logits(teacher, generated, attention, prompt_len)
            rows, cols = valid.nonzero(as_tuple=True)
            s, t = s_logits[rows, cols].float(), t_logits[rows, cols].float()
            ids = completion[rows, cols]
            table = pa.table(
                {
                    "prompt_index": pa.array((rows + start).cpu().numpy(), pa.int64()),
                    "position": pa.array(cols.cpu().numpy(), pa.int64()),
                    "token_id": pa.array(ids.cpu().numpy(), pa.int64()),
                    "token": pa.array([tokenizer.decode([i]) for i in ids.tolist()], pa.string()),
                    "divergence": pa.array(per_token_divergence(s, t, beta, temperature).cpu().numpy(), pa.float32()),
                    "student_entropy": pa.array(per_token_entropy(s, temperature).cpu().numpy(), pa.float32()),
                    "teacher_entropy": pa.array(per_token_entropy(t, temperature).cpu().numpy(), pa.float32()),
                    "logit_grad_norm": pa.array(logit_grad_norm(s, t, beta, temperature).cpu().numpy(), pa.float32()),
                }
            )
            table = table.replace_schema_metadata({_META_KEY: json.dumps(meta).encode()})
            tmp = f"{path}.tmp"
            pq.write_table(table, tmp)
            os.replace(tmp, path)  # a killed run never leaves a half-written part behind
    finally:
        student.train(was_training[0])
        teacher.train(was_training[1])
    if gradient_cosine and not os.path.exists(cosine_path):
        gradient_cosines(student, teacher, tokenizer, prompts, output_dir, show_progress=show_progress)
    return os.fspath(output_dir)


def _check_meta_matches(output_dir: str | os.PathLike, meta: Mapping[str, Any]) -> None:
    path = os.path.join(output_dir, "meta.json")
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    changed = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
    if changed:
        raise ValueError(
            f"{output_dir} holds a token table collected with other settings {changed} (old, new). Resuming would mix "
            "them; use a new output directory or delete this one."
        )


GRAD_COSINE_FILE = "grad_cosine.parquet"


def _logit_gradients(s: torch.Tensor, t: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """`(N, V)` gradients of each row's divergence with respect to that row's student logits (rows are independent)."""
    with torch.enable_grad():
        s = s.detach().float().requires_grad_(True)
        per_token_divergence(s, t.detach().float(), beta, temperature).sum().backward()
    return s.grad


def _completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """`(B, end - prompt_len, V)` logits of the positions that produced the completion (`prompt_len - 1 ... end - 2`).

    `logits_to_keep` projects only those positions, never the prompt's: the head is the largest matrix product of a
    small model (SmolLM2: 49,152 × 576). No position ids are passed, as in the trainer's forward, so a collected
    divergence is the one training sees.
    """
    keep = input_ids.shape[1] - prompt_len + 1
    return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits[:, -keep:-1]


def _part_logits(student, teacher, tokenizer, prompts, part: pd.DataFrame, pad_id: int):
    """Rebuild one collected batch from its rows and re-run both models: `(student, teacher)` logits per row."""
    indices = sorted(int(i) for i in part["prompt_index"].unique())
    enc = _encode_chats(tokenizer, [_as_chat(prompts[i]) for i in indices])
    row_of = {p: r for r, p in enumerate(indices)}
    rows = torch.tensor([row_of[int(p)] for p in part["prompt_index"]])
    cols = torch.tensor(part["position"].to_numpy(np.int64))
    width = int(cols.max()) + 1
    completion = torch.full((len(indices), width), pad_id, dtype=torch.long)
    completion[rows, cols] = torch.tensor(part["token_id"].to_numpy(np.int64))
    valid = torch.zeros_like(completion)
    valid[rows, cols] = 1
    prompt_len = enc["input_ids"].shape[1]
    device = next(student.parameters()).device
    ids = torch.cat([enc["input_ids"], completion], dim=1).to(device)
    attention = torch.cat([enc["attention_mask"], valid], dim=1).to(device)
    s = _completion_logits(student, ids, attention, prompt_len)[rows, cols].float()
    t = _completion_logits(teacher, ids, attention, prompt_len)[rows, cols].float()
    return s, t


@torch.no_grad()
def gradient_cosines(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Any],
    table_dir: str | os.PathLike,
    row_chunk: int = 256,
    show_progress: bool = True,
) -> str:
    """Add each token's cosine with the balanced gradient G_balanced to a collected table (`grad_cosine.parquet`).

    `G_balanced = Σ_v mean_{i: type(i) = v} g_i` is the sum over token types of each type's mean logit gradient `g_i`
    (the gradient of the training divergence with respect to the student's logits at that position), so every type
    counts once however often it occurs. It is a corpus-wide sum, so it takes two passes, each rebuilding every
    collected batch from the table and re-running both models (no generation): the first sums `g_i / count(type_i)`,
    the second writes `cos(g_i, G_balanced)`. The cosines are exact, not a random projection; their cost is two
    forward passes of both models per batch and one `(rows, V)` gradient block at a time. Each rebuilt row's
    divergence must equal the stored one, so a table collected with other models or prompts is refused.

    Args:
        prompts: the prompts the table was collected from, in the same order.
        table_dir: a directory written by `collect_token_table`.

    Returns:
        `str`: the path of `grad_cosine.parquet` (columns `prompt_index`, `position`, `grad_cosine`; its schema
        metadata holds `g_balanced_norm` and `types`). `load_token_table` merges it as the `grad_cosine` column.

    Example:
    ```python
    gradient_cosines(student, teacher, tokenizer, load_prompts("gsm8k.jsonl", limit=500), "tables/early")
    ```
    """
    from tqdm.auto import tqdm

    table = load_token_table(table_dir)
    beta, temperature = float(table.meta.get("beta", 1.0)), float(table.meta.get("temperature", 1.0))
    if len(prompts) < table.frame["prompt_index"].max() + 1:
        raise ValueError(
            f"{table_dir} was collected from {int(table.frame['prompt_index'].max()) + 1} prompts, got {len(prompts)}. "
            "Pass the same prompts, in the same order."
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    parts = sorted(p for p in os.listdir(table_dir) if p.startswith("part-") and p.endswith(".parquet"))
    frames = [pq.read_table(os.path.join(table_dir, p)).to_pandas() for p in parts]
    counts = table.counts()
    was_training = (student.training, teacher.training)
    student.eval()
    teacher.eval()
    g_balanced = None
    cosines: list[np.ndarray] = []
    try:
        for sweep in ("sum", "cosine"):
            for part in tqdm(frames, desc=f"G_balanced ({sweep})", disable=not show_progress):
                s, t = _part_logits(student, teacher, tokenizer, prompts, part, pad_id)
                stored = torch.tensor(part["divergence"].to_numpy(np.float32), device=s.device)
                recomputed = per_token_divergence(s, t, beta, temperature)
                gap = (recomputed - stored).abs()
                worst = float(gap.max())
                if bool((gap > 1e-5 + 1e-3 * stored.abs()).any()):
                    raise ValueError(
                        f"Rebuilding {table_dir} gives divergences up to {worst:.3g} away from the stored ones: the "
                        "table was collected with other models or prompts. Pass the ones it was collected with."
                    )
                ids = torch.tensor(part["token_id"].to_numpy(np.int64), device=s.device)
                out = []
                for lo in range(0, len(part), row_chunk):
                    g = _logit_gradients(s[lo : lo + row_chunk], t[lo : lo + row_chunk], beta, temperature).double()
                    if sweep == "sum":
                        weights = 1.0 / torch.from_numpy(counts).to(s.device)[ids[lo : lo + row_chunk]]
                        contribution = (weights[:, None] * g).sum(dim=0)
                        g_balanced = contribution if g_balanced is None else g_balanced + contribution
                    else:
                        norms = g.norm(dim=1) * g_balanced.norm()
                        cos = (g @ g_balanced) / norms
                        out.append(torch.where(norms > 0, cos, torch.nan).cpu().numpy())
                if sweep == "cosine":
                    cosines.append(np.concatenate(out))
    finally:
        student.train(was_training[0])
        teacher.train(was_training[1])
    result = pa.table(
        {
            "prompt_index": pa.array(np.concatenate([f["prompt_index"].to_numpy() for f in frames]), pa.int64()),
            "position": pa.array(np.concatenate([f["position"].to_numpy() for f in frames]), pa.int64()),
            "grad_cosine": pa.array(np.concatenate(cosines), pa.float64()),
        }
    )
    info = {"g_balanced_norm": float(g_balanced.norm()), "types": int((counts > 0).sum()), "parts": parts}
    result = result.replace_schema_metadata({_META_KEY: json.dumps(info).encode()})
    path = os.path.join(table_dir, GRAD_COSINE_FILE)
    pq.write_table(result, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)
    logger.info("G_balanced over %d types, norm %.4g; wrote %s", info["types"], info["g_balanced_norm"], path)
    return path


@dataclass
class TokenTable:
    """A token table (`frame`, one row per generated token) and the metadata of its collection."""

    frame: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    @property
    def vocab_size(self) -> int:
        if self.meta.get("vocab_size") is not None:
            return int(self.meta["vocab_size"])
        return int(self.frame["token_id"].max()) + 1 if len(self.frame) else 0

    def counts(self) -> np.ndarray:
        """`(V,)` occurrences of each token id."""
        return np.bincount(self.frame["token_id"].to_numpy(), minlength=self.vocab_size).astype(np.float64)

    def divergence_sums(self) -> np.ndarray:
        """`(V,)` total divergence of each token id."""
        ids, divergence = self.frame["token_id"].to_numpy(), self.frame["divergence"].to_numpy(np.float64)
        return np.bincount(ids, weights=divergence, minlength=self.vocab_size)

    def mean_divergence(self) -> np.ndarray:
        """`(V,)` mean divergence of each token id, NaN where never seen."""
        count = self.counts()
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, self.divergence_sums() / np.maximum(count, 1), np.nan)

    def decode(self) -> dict[int, str]:
        """`{token_id: decoded string}` for the ids in the table."""
        first = self.frame.drop_duplicates("token_id")
        return dict(zip(first["token_id"].astype(int), first["token"].astype(str)))


def load_token_table(path: str | os.PathLike | pd.DataFrame, vocab_size: int | None = None) -> TokenTable:
    """Read a token table: a directory written by `collect_token_table`, one Parquet file, or a DataFrame.

    Raises `ValueError` for a missing column, an empty table, non-finite divergences, or ids outside `vocab_size`.

    Example:
    ```python
    >>> import pandas as pd
    >>> from hf_rockopd.analysis import load_token_table
    >>> frame = pd.DataFrame({"prompt_index": [0, 0], "position": [0, 1], "token_id": [5, 7], "token": ["a", "b"],
    ...                       "divergence": [0.1, 0.9]})
    >>> load_token_table(frame, vocab_size=10).counts()[[5, 7]].tolist()
    [1.0, 1.0]
    ```
    """
    meta: dict[str, Any] = {}
    if isinstance(path, pd.DataFrame):
        frame, source = path.copy(), "<DataFrame>"
    else:
        source = os.fspath(path)
        if os.path.isdir(source):
            parts = sorted(p for p in os.listdir(source) if p.startswith("part-") and p.endswith(".parquet"))
            if not parts:
                raise ValueError(f"Token table {source} is empty: no Parquet part. Run `collect` first.")
            tables = [pq.read_table(os.path.join(source, p)) for p in parts]
            meta_path = os.path.join(source, "meta.json")
            if os.path.exists(meta_path):
                with open(meta_path, encoding="utf-8") as f:
                    meta = json.load(f)
            frame = pa.concat_tables(tables).to_pandas()
            cosine_path = os.path.join(source, GRAD_COSINE_FILE)
            if os.path.exists(cosine_path):
                cosine = pq.read_table(cosine_path)
                info = json.loads((cosine.schema.metadata or {}).get(_META_KEY, b"{}"))
                if info.get("parts") == parts and cosine.num_rows == len(frame):
                    # Written part by part in the same order as the parts, so rows align one to one.
                    cosine = cosine.to_pandas()
                    if (cosine["prompt_index"].to_numpy() == frame["prompt_index"].to_numpy()).all() and (
                        cosine["position"].to_numpy() == frame["position"].to_numpy()
                    ).all():
                        frame["grad_cosine"] = cosine["grad_cosine"].to_numpy()
                        meta["g_balanced_norm"] = info.get("g_balanced_norm")
                else:
                    logger.warning(
                        "%s does not match the parts of %s (stale); ignoring it. Rerun `gradient_cosines`.",
                        cosine_path, source,
                    )
        elif os.path.isfile(source):
            table = pq.read_table(source)
            raw = (table.schema.metadata or {}).get(_META_KEY)
            meta = json.loads(raw) if raw else {}
            frame = table.to_pandas()
        else:
            raise FileNotFoundError(f"Token table {source} does not exist. Give a directory written by `collect`.")
    required = ("prompt_index", "token_id", "token", "divergence")
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise ValueError(f"Token table {source} lacks columns {missing}; it has {list(frame.columns)}.")
    if len(frame) == 0:
        raise ValueError(f"Token table {source} is empty (no generated token). Collect on more prompts.")
    if not np.isfinite(frame["divergence"].to_numpy(np.float64)).all():
        raise ValueError(f"Token table {source} has non-finite divergences; it cannot be scored.")
    if vocab_size is not None:
        if meta.get("vocab_size") not in (None, vocab_size):
            raise ValueError(
                f"Token table {source} was collected with a vocabulary of {meta['vocab_size']} ids, not {vocab_size}. "
                "It comes from another tokenizer."
            )
        meta.setdefault("vocab_size", vocab_size)
    ids = frame["token_id"].to_numpy()
    if ids.min() < 0 or (meta.get("vocab_size") is not None and ids.max() >= int(meta["vocab_size"])):
        raise ValueError(
            f"Token table {source} has token ids in [{ids.min()}, {ids.max()}], outside the vocabulary of "
            f"{meta.get('vocab_size')} ids. It comes from another tokenizer."
        )
    return TokenTable(frame=frame.reset_index(drop=True), meta=meta, source=source)


def check_same_tokenizer(a: TokenTable, b: TokenTable) -> None:
    """Raise `ValueError` unless two tables share vocabulary size and decode every common id to the same string."""
    if a.vocab_size != b.vocab_size:
        raise ValueError(
            f"Token tables {a.source} ({a.vocab_size} ids) and {b.source} ({b.vocab_size} ids) come from different "
            "tokenizers; their token ids cannot be compared."
        )
    da, db = a.decode(), b.decode()
    differ = [i for i in set(da) & set(db) if da[i] != db[i]]
    if differ:
        i = sorted(differ)[0]
        raise ValueError(
            f"Token tables {a.source} and {b.source} decode {len(differ)} common ids differently (id {i}: {da[i]!r} "
            f"vs {db[i]!r}); they come from different tokenizers."
        )


# ---------------------------------------------------------------------------------------------------------------------
# Rock Score and selection
# ---------------------------------------------------------------------------------------------------------------------


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
            source="hf_rockopd.analysis.score_token_table",
            selection=self.settings,
            rock_token_share=self.rock_token_share,
            divergence_coverage=self.divergence_coverage,
        )


def _eligible_ranking(
    counts: np.ndarray, mean_div: np.ndarray, min_count: int, exclude_top_frequent: int
) -> tuple[list[int], np.ndarray]:
    vocab = counts.shape[0]
    ranked, scores = select_rock_tokens(
        torch.from_numpy(counts),
        torch.from_numpy(mean_div),
        top_k=max(vocab, 1),
        min_count=min_count,
        exclude_top_frequent=exclude_top_frequent,
    )
    return ranked, scores.numpy()


def score_token_table(
    table: TokenTable,
    top_k: int | None = 100,
    min_count: int = 2,
    exclude_top_frequent: int = 5,
    coverage: float | None = None,
) -> ScoreResult:
    """Rock Score every type and select rocks with the paper's rule (§3.2), or by divergence coverage.

    Types seen fewer than `min_count` times and the `exclude_top_frequent` most frequent types are ineligible; the
    `top_k` eligible types with the highest `R(v)` are rocks. With `coverage` instead, K is the smallest number of top
    types whose divergence mass reaches that share of the corpus's total.

    Raises `ValueError` when `top_k` exceeds the number of eligible types (name both and how to relax the rule).

    Example:
    ```python
    >>> import pandas as pd
    >>> from hf_rockopd.analysis import load_token_table, score_token_table
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
    ranked, scores = _eligible_ranking(counts, mean_div, min_count, exclude_top_frequent)
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
    prompts = np.unique(table.frame["prompt_index"].to_numpy())
    if subcorpus_sizes is None:
        subcorpus_sizes = sorted({max(1, int(len(prompts) * f)) for f in (0.125, 0.25, 0.5, 0.8)})
    bad = [n for n in subcorpus_sizes if not 1 <= n <= len(prompts)]
    if bad:
        raise ValueError(f"subcorpus_sizes {bad} are outside [1, {len(prompts)}] (the corpus's number of prompts).")
    vocab = table.vocab_size

    def ranking(frame: pd.DataFrame) -> list[int]:
        sub = TokenTable(frame=frame, meta={"vocab_size": vocab})
        return _eligible_ranking(sub.counts(), sub.mean_divergence(), min_count, exclude_top_frequent)[0]

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
# Controls, stagnation and gradient geometry
# ---------------------------------------------------------------------------------------------------------------------


def matched_controls(table: TokenTable, rock_ids: Sequence[int], num_bins: int = 10, seed: int = 0) -> list[int]:
    """Random non-rock ids matched bin by bin to the rock set's log-frequency distribution in `table`.

    Unlike the paper's control (uniform over the vocabulary), every control id comes from the same frequency bin as
    the rock it replaces; see `hf_rockopd.rock_set.frequency_matched_ids`.

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


def _comparison_groups(table: TokenTable, rock_ids: Sequence[int], n_rare: int | None, seed: int) -> dict:
    """The paper's three groups, defined on `table`: rocks, rare high-divergence types, a matched random control."""
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
    groups = _comparison_groups(early, rock_ids, n_rare, seed)
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


def gradient_geometry(
    table: TokenTable, rock_ids: Sequence[int], n_rare: int | None = None, seed: int = 0
) -> pd.DataFrame:
    """Per-occurrence logit-gradient geometry of rocks vs rare high-divergence types and a matched random control.

    Rocks pull weakly per occurrence (the paper: median norm ≈ 0.016 vs ≈ 0.54 for rare types) and matter by
    frequency. When the table has the `grad_cosine` column (`gradient_cosines`, run by `collect` by default), the
    cosine of each occurrence's gradient with G_balanced is summarised too (the paper: median ≈ 0.040 rocks, 0.025
    rare, 0.006 random). Each other group is tested against the rocks with the two-sided Mann-Whitney U test
    (`scipy.stats.mannwhitneyu`).

    Returns:
        one row per group: `group`, `occurrences`, `median_grad_norm`, `p_value_vs_rock`, and with cosines
        `median_cosine`, `p_value_cosine_vs_rock`.

    Example:
    ```python
    frame = gradient_geometry(load_token_table("tables/early"), result.rock_ids)
    ```
    """
    if "logit_grad_norm" not in table.frame.columns:
        raise ValueError(f"Token table {table.source} has no logit_grad_norm column; collect it with `collect`.")
    groups = _comparison_groups(table, rock_ids, n_rare, seed)
    ids = table.frame["token_id"].to_numpy()
    measures = {"grad_norm": ("logit_grad_norm", "p_value_vs_rock")}
    if "grad_cosine" in table.frame.columns:
        measures["cosine"] = ("grad_cosine", "p_value_cosine_vs_rock")
    rows = [{"group": name, "occurrences": int(np.isin(ids, group).sum())} for name, group in groups.items()]
    for measure, (column, p_name) in measures.items():
        values_all = table.frame[column].to_numpy(np.float64)
        in_rock = np.isin(ids, groups["rock"])
        rock_values = values_all[in_rock & np.isfinite(values_all)]
        for row, (name, group) in zip(rows, groups.items()):
            mask = np.isin(ids, group)
            values = values_all[mask & np.isfinite(values_all)]
            p = float("nan")
            if name != "rock" and len(values) and len(rock_values):
                p = float(stats.mannwhitneyu(values, rock_values, alternative="two-sided").pvalue)
            row[f"median_{measure}"] = float(np.median(values)) if len(values) else float("nan")
            row[p_name] = p
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------------------
# Statistics of the knockout experiment
# ---------------------------------------------------------------------------------------------------------------------


def benjamini_hochberg(p_values: Sequence[float]) -> np.ndarray:
    """Benjamini-Hochberg q-values (`scipy.stats.false_discovery_control`), in the input order.

    Example:
    ```python
    >>> from hf_rockopd.analysis import benjamini_hochberg
    >>> benjamini_hochberg([0.01, 0.04, 0.03]).round(3).tolist()
    [0.03, 0.04, 0.04]
    ```
    """
    p = np.asarray(p_values, dtype=np.float64)
    if p.size == 0:
        return p
    if not np.all((p >= 0) & (p <= 1)):
        raise ValueError(f"p-values must be in [0, 1], got {p[(p < 0) | (p > 1) | np.isnan(p)][:5].tolist()}.")
    return stats.false_discovery_control(p, method="bh")


def paired_bootstrap(
    baseline: Sequence[float], treated: Sequence[float], n_resamples: int = 10_000, seed: int = 0, alpha: float = 0.05
) -> dict[str, float]:
    """Paired bootstrap of the mean difference `treated − baseline` (e.g. per-problem correctness with a token banned).

    Problems are resampled with replacement `n_resamples` times. The two-sided p-value is twice the smaller share of
    resampled means on either side of 0 (capped at 1); the interval is the percentile `1 − alpha` interval.

    Example:
    ```python
    >>> from hf_rockopd.analysis import paired_bootstrap
    >>> result = paired_bootstrap([1, 1, 0, 1], [1, 1, 0, 1])
    >>> result["delta"], result["p_value"]
    (0.0, 1.0)
    ```
    """
    a, b = np.asarray(baseline, dtype=np.float64), np.asarray(treated, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"baseline and treated must be equal-length, non-empty 1-D, got {a.shape} and {b.shape}.")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}.")
    diff = b - a
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, diff.size, size=(n_resamples, diff.size))].mean(axis=1)
    p = min(1.0, 2.0 * min(np.mean(means <= 0), np.mean(means >= 0)))
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return {"delta": float(diff.mean()), "ci_low": float(low), "ci_high": float(high), "p_value": float(p)}


# ---------------------------------------------------------------------------------------------------------------------
# Causal knockout: ban one token at inference and measure accuracy
# ---------------------------------------------------------------------------------------------------------------------

# One GSM8K loader for the knockout and `hf-rockopd eval`: this name is kept for scripts written against it.
load_problems = load_gsm8k_problems


@torch.no_grad()
def _solve(model, tokenizer, problems, max_new_tokens: int, batch_size: int, banned: Sequence[int]) -> np.ndarray:
    correct = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        out, _, prompt_len = _generate(model, tokenizer, [m for m, _ in chunk], max_new_tokens, suppress_tokens=banned)
        for (_, gold), ids in zip(chunk, out[:, prompt_len:]):
            answer = extract_numeric_answer(tokenizer.decode(ids, skip_special_tokens=True))
            correct.append(answer is not None and abs(answer - gold) < 1e-6)
    return np.asarray(correct, dtype=np.float64)


def knockout(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[tuple[list[dict[str, str]], float]],
    token_ids: Sequence[int],
    max_new_tokens: int = 256,
    batch_size: int = 8,
    n_resamples: int = 10_000,
    alpha: float = 0.05,
    min_effect: float = 0.01,
    seed: int = 0,
) -> pd.DataFrame:
    """Ban each token in turn at inference (greedy decoding) and test the accuracy change (the paper's §5).

    For each id, the per-problem correctness with the ban is compared with the unbanned baseline by `paired_bootstrap`;
    q-values are Benjamini-Hochberg over all ids. A token is a *Pillar* if the accuracy drops by at least `min_effect`
    and `q < alpha`, a *Stumbling* block if it rises by at least `min_effect` and `q < alpha`, else *Neutral*.

    Returns:
        one row per id: `token_id`, `token`, `accuracy`, `delta`, `ci_low`, `ci_high`, `p_value`, `q_value`,
        `verdict`; the baseline accuracy is in `frame.attrs["baseline_accuracy"]`.

    Example:
    ```python
    frame = knockout(student, tokenizer, load_problems("gsm8k.jsonl", limit=200), rock_ids[:20])
    ```
    """
    if not token_ids:
        raise ValueError("knockout got no token id to ban.")
    vocab = vocab_size(model)
    bad = [i for i in token_ids if not 0 <= int(i) < vocab]
    if bad:
        raise ValueError(f"Token ids {bad[:5]} are outside the model's vocabulary of {vocab} ids.")
    was_training = model.training
    model.eval()
    try:
        baseline = _solve(model, tokenizer, problems, max_new_tokens, batch_size, banned=())
        rows = []
        for token_id in token_ids:
            banned = _solve(model, tokenizer, problems, max_new_tokens, batch_size, banned=[int(token_id)])
            result = paired_bootstrap(baseline, banned, n_resamples=n_resamples, seed=seed, alpha=alpha)
            rows.append({"token_id": int(token_id), "token": tokenizer.decode([int(token_id)]),
                         "accuracy": float(banned.mean()), **result})
    finally:
        model.train(was_training)
    frame = pd.DataFrame(rows)
    frame["q_value"] = benjamini_hochberg(frame["p_value"].to_numpy())
    significant = frame["q_value"] < alpha
    frame["verdict"] = np.where(
        significant & (frame["delta"] <= -min_effect),
        "Pillar",
        np.where(significant & (frame["delta"] >= min_effect), "Stumbling", "Neutral"),
    )
    frame.attrs["baseline_accuracy"] = float(baseline.mean())
    return frame
