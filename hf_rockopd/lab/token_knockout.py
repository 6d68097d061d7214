"""Causal knockout (the paper's §5): ban one token at inference and test the accuracy change on GSM8K-style problems.

Decoding is `rollout.generate_completions` (greedy, the ban through `suppress_tokens`) and grading is
`answers.grade_completion` (math-verify), the ones `evaluate_gsm8k` uses, so the knockout's baseline accuracy is the
evaluation's.

Example:
```python
frame = knockout(student, tokenizer, load_problems("gsm8k.jsonl", limit=200), rock_ids[:20])
print(frame.attrs["baseline_accuracy"], frame["verdict"].value_counts())
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..evaluation.answers import check_verifier, grade_completion
from ..data.chat import Problem
from ..models.introspection import vocab_size
from ..evaluation.rollout import generate_completions
from .stats import benjamini_hochberg, paired_bootstrap


__all__ = ["knockout"]


def _solve(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    max_new_tokens: int,
    batch_size: int,
    banned: Sequence[int],
    verifier: str = "math",
) -> np.ndarray:
    """Per-problem correctness (1.0 or 0.0) of the model's greedy answers with the `banned` ids suppressed."""
    _, completions = generate_completions(
        model, tokenizer, [messages for messages, _ in problems], max_new_tokens=max_new_tokens,
        batch_size=batch_size, suppress_tokens=banned or None, show_progress=False,
    )
    correct = [
        bool(grade_completion(tokenizer.decode(ids, skip_special_tokens=True), reference, verifier)[1])
        for (_, reference), ids in zip(problems, completions)
    ]
    return np.asarray(correct, dtype=np.float64)


def knockout(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    token_ids: Sequence[int],
    max_new_tokens: int = 256,
    batch_size: int = 8,
    n_resamples: int = 10_000,
    alpha: float = 0.05,
    min_effect: float = 0.01,
    seed: int = 0,
    show_progress: bool = False,
    verifier: str = "math",
) -> pd.DataFrame:
    """Ban each token in turn at inference (greedy decoding) and test the accuracy change (the paper's §5).

    For each id, the per-problem correctness with the ban is compared with the unbanned baseline by `paired_bootstrap`;
    q-values are Benjamini-Hochberg over all ids. A token is a *Pillar* if the accuracy drops by at least `min_effect`
    and `q < alpha`, a *Stumbling* block if it rises by at least `min_effect` and `q < alpha`, else *Neutral*.

    `verifier` checks the answers (`hf_rockopd.evaluation.verify_answer`: `"math"` or `"gsm8k"`).
    `show_progress` shows a bar over the decodings (the baseline, then one per id) with its ETA.

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
    check_verifier(verifier)
    if verifier == "none":
        raise ValueError("knockout measures accuracy: give verifier='math' or 'gsm8k', not 'none'.")
    vocab = vocab_size(model)
    bad = [i for i in token_ids if not 0 <= int(i) < vocab]
    if bad:
        raise ValueError(f"Token ids {bad[:5]} are outside the model's vocabulary of {vocab} ids.")
    from tqdm.auto import tqdm

    # One decoding of every problem per step: the baseline, then one per banned id (minutes each on a CPU).
    bar = tqdm(total=len(token_ids) + 1, desc="knockout", unit="decoding", disable=not show_progress)
    baseline = _solve(model, tokenizer, problems, max_new_tokens, batch_size, banned=(), verifier=verifier)
    bar.update()
    rows = []
    for token_id in token_ids:
        bar.set_postfix(token_id=int(token_id))
        banned = _solve(
            model, tokenizer, problems, max_new_tokens, batch_size, banned=[int(token_id)], verifier=verifier
        )
        bar.update()
        result = paired_bootstrap(baseline, banned, n_resamples=n_resamples, seed=seed, alpha=alpha)
        rows.append({"token_id": int(token_id), "token": tokenizer.decode([int(token_id)]),
                     "accuracy": float(banned.mean()), **result})
    bar.close()
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
