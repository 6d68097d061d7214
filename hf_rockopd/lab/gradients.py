"""Gradient measurements of a token table: each token's cosine with G_balanced, and the per-group gradient geometry.

Example:
```python
gradient_cosines(student, teacher, tokenizer, load_prompts("gsm8k.jsonl", limit=500), "tables/early")
frame = gradient_geometry(load_token_table("tables/early"), rock_ids)
```
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from scipy import stats
from transformers.utils import logging

from ..losses import per_token_divergence
from ..evaluation.rollout import encode_prompts, eval_mode, pad_token_id, scored_chunks
from .selection import comparison_groups
from .table import TokenTable, load_token_table, read_parts, write_grad_cosines


logger = logging.get_logger(__name__)

__all__ = ["gradient_cosines", "gradient_geometry"]


def _logit_gradients(s: torch.Tensor, t: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """`(N, V)` gradients of each row's divergence with respect to that row's student logits (rows are independent)."""
    with torch.enable_grad():
        s = s.detach().float().requires_grad_(True)
        per_token_divergence(s, t.detach().float(), beta, temperature).sum().backward()
    return s.grad


def _part_logits(
    student: torch.nn.Module, teacher: torch.nn.Module, tokenizer: Any, prompts: Sequence[Any], part: pd.DataFrame
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rebuild one collected batch from its rows and re-score it as `collect` did: `(student, teacher)` logits per row.

    The same prompts, completions and scoring batch as the collection (`rollout.scored_chunks`), so each row's
    divergence is reproduced exactly.
    """
    indices = sorted(int(i) for i in part["prompt_index"].unique())
    by_prompt = part.groupby("prompt_index", sort=True)["token_id"]
    completion_ids = [[int(t) for t in by_prompt.get_group(i)] for i in indices]
    prompt_ids = encode_prompts(tokenizer, [prompts[i] for i in indices])
    chunks = scored_chunks(
        student, teacher, prompt_ids, completion_ids, pad_token_id=pad_token_id(tokenizer), batch_size=len(indices)
    )
    pieces = list(chunks)
    return torch.cat([s for _, _, s, _ in pieces]), torch.cat([t for _, _, _, t in pieces])


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
    parts, frames = read_parts(table_dir)
    # Rows in prompt then position order, the order in which a rebuilt batch scores them.
    frames = [f.sort_values(["prompt_index", "position"], kind="stable", ignore_index=True) for f in frames]
    counts = table.counts()
    g_balanced = None
    cosines: list[np.ndarray] = []
    with eval_mode(student, teacher):
        for sweep in ("sum", "cosine"):
            for part in tqdm(frames, desc=f"G_balanced ({sweep})", disable=not show_progress):
                s, t = _part_logits(student, teacher, tokenizer, prompts, part)
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
    info = {"g_balanced_norm": float(g_balanced.norm()), "types": int((counts > 0).sum()), "parts": parts}
    path = write_grad_cosines(table_dir, frames, np.concatenate(cosines), info)
    logger.info("G_balanced over %d types, norm %.4g; wrote %s", info["types"], info["g_balanced_norm"], path)
    return path


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
    groups = comparison_groups(table, rock_ids, n_rare, seed)
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
