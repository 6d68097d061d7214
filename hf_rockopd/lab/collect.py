"""Collect a token table: roll out prompts with the student, score every generated token against the teacher.

Generation and scoring are `hf_rockopd.evaluation.rollout`'s (the ones evaluation uses), so a collected completion and its
divergence are what `evaluate_gsm8k` would produce for the same prompt; the file format is `lab.table`'s.

Example:
```python
collect_token_table(student, teacher, tokenizer, load_prompts("gsm8k.jsonl", limit=500), "tables/early")
table = load_token_table("tables/early")
```
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import torch

from ..losses import logit_grad_norm, per_token_divergence, per_token_entropy
from ..models.introspection import check_same_vocabulary, special_token_ids
from ..evaluation.rollout import eval_mode, generate_completions, pad_token_id, scored_chunks
from .gradients import gradient_cosines
from .table import GRAD_COSINE_FILE, part_name, prepare_table_dir, write_part


__all__ = ["collect_token_table"]


def _score_part(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    first_prompt: int,
    beta: float,
    temperature: float,
) -> dict[str, pa.Array]:
    """The table columns of one collected batch: one row per completion token, in prompt then position order."""
    columns: dict[str, list] = {name: [] for name in ("divergence", "student_entropy", "teacher_entropy", "grad")}
    chunks = scored_chunks(
        student, teacher, prompt_ids, completion_ids, pad_token_id=pad_token_id(tokenizer),
        batch_size=len(completion_ids),
    )
    for _, _, s, t in chunks:
        columns["divergence"].append(per_token_divergence(s, t, beta, temperature).cpu())
        columns["student_entropy"].append(per_token_entropy(s, temperature).cpu())
        columns["teacher_entropy"].append(per_token_entropy(t, temperature).cpu())
        columns["grad"].append(logit_grad_norm(s, t, beta, temperature).cpu())
    ids = [int(i) for c in completion_ids for i in c]
    return {
        "prompt_index": pa.array([first_prompt + r for r, c in enumerate(completion_ids) for _ in c], pa.int64()),
        "position": pa.array([p for c in completion_ids for p in range(len(c))], pa.int64()),
        "token_id": pa.array(ids, pa.int64()),
        "token": pa.array([tokenizer.decode([i]) for i in ids], pa.string()),
        "divergence": pa.array(torch.cat(columns["divergence"]).numpy(), pa.float32()),
        "student_entropy": pa.array(torch.cat(columns["student_entropy"]).numpy(), pa.float32()),
        "teacher_entropy": pa.array(torch.cat(columns["teacher_entropy"]).numpy(), pa.float32()),
        "logit_grad_norm": pa.array(torch.cat(columns["grad"]).numpy(), pa.float32()),
    }


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
    meta = {
        "tokenizer": getattr(tokenizer, "name_or_path", None) or None,
        "vocab_size": student_vocab,
        "beta": beta,
        "temperature": temperature,
        "do_sample": do_sample,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(prompts),
        # The stop and control ids, which `score_token_table` never selects as rocks by default.
        "special_ids": special_token_ids(tokenizer, student),
    }
    prepare_table_dir(output_dir, meta)
    starts = list(range(0, len(prompts), batch_size))

    with eval_mode(student, teacher):
        for part, start in enumerate(tqdm(starts, desc="collect", disable=not show_progress)):
            if os.path.exists(os.path.join(output_dir, part_name(part))):
                continue
            chunk = prompts[start : start + batch_size]
            torch.manual_seed(seed + part)
            prompt_ids, completion_ids = generate_completions(
                student, tokenizer, chunk, max_new_tokens=max_new_tokens, batch_size=len(chunk), do_sample=do_sample,
                temperature=temperature, show_progress=False,
            )
            write_part(output_dir, part, _score_part(student, teacher, tokenizer, prompt_ids, completion_ids, start,
                                                     beta, temperature), meta)
    if gradient_cosine and not os.path.exists(os.path.join(output_dir, GRAD_COSINE_FILE)):
        gradient_cosines(student, teacher, tokenizer, prompts, output_dir, show_progress=show_progress)
    return os.fspath(output_dir)

