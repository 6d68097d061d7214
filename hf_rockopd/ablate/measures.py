"""The one place where the ablation meets the text-quality measures of `hf_rockopd.evaluation.quality`.

Per problem, a completion is judged by its loop, finished and repeated-n-gram flags; per run, by `text_quality`
(accuracy with its Wilson interval, loop and finished rates, distinct-n). `numeric` is
`hf_rockopd.evaluation.quality.numeric_token_ids(tokenizer)`: a repeating decimal is not a loop. The statistics across runs are
`hf_rockopd.ablate.stats`' (see `summary.py`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from ..evaluation.quality import completion_quality, text_quality


# ------------------------------------------------------------------------------------------- text quality ----
def problem_quality(
    ids: Sequence[int], stop_ids: Sequence[int], max_new_tokens: int, numeric: Collection[int] | None = None
) -> dict[str, Any]:
    """One completion's outcomes (generated ids), JSON-ready: `looped`, `finished`, `clipped`,
    `repeated_ngram_fraction` (None under 4 tokens) and `length` (before the stop id).

    Example:
    ```python
    >>> from hf_rockopd.ablate.measures import problem_quality
    >>> q = problem_quality([4, 5, 6] * 6, stop_ids=[2], max_new_tokens=18)
    >>> q["looped"], q["finished"], q["repeated_ngram_fraction"]
    (True, False, 0.8)
    ```
    """
    q = completion_quality(ids, stop_ids, max_new_tokens, numeric=numeric)
    repeated = q["repeated_ngram_fraction"]
    return {
        "looped": bool(q["loop"]),
        "finished": bool(q["finished"]),
        "clipped": bool(q["clipped"]),
        "repeated_ngram_fraction": None if math.isnan(repeated) else float(repeated),
        "length": int(q["length"]),
    }


def run_quality(
    completions: Sequence[Sequence[int]],
    stop_ids: Sequence[int],
    max_new_tokens: int,
    correct: Sequence[bool],
    numeric: Collection[int] | None = None,
) -> dict[str, Any]:
    """The run-level text quality: accuracy with its Wilson interval, loop and finished rates, distinct-n.

    Example:
    ```python
    >>> from hf_rockopd.ablate.measures import run_quality
    >>> q = run_quality([[5, 6, 2], [4, 5, 6] * 6], stop_ids=[2], max_new_tokens=18, correct=[True, False])
    >>> q["accuracy"], q["loop_rate"], q["finished_rate"]
    (0.5, 0.5, 0.5)
    ```
    """
    quality = text_quality(completions, stop_ids, max_new_tokens, correct=list(correct), numeric=numeric).to_dict()
    accuracy = quality.pop("accuracy")
    return {
        "accuracy": accuracy["estimate"],
        "accuracy_low": accuracy["low"],
        "accuracy_high": accuracy["high"],
        "loop_rate": quality["loop_rate"],
        "finished_rate": quality["finished_rate"],
        "repeated_ngram_fraction": quality["repeated_ngram_fraction"],
        "distinct_1": quality["distinct_1"],
        "distinct_2": quality["distinct_2"],
        "mean_completion_length": quality["mean_length"],
        "loop_settings": quality["loop_settings"],
    }
