"""The evaluation's text table: one column per result (`hf_rockopd.evaluation.EvalResult` or its JSON dict), as
`hf-rockopd eval` and the distill job's before/after print it.

The quality measures a looping student cannot fool come first (accuracy with its interval and the teacher's ceiling,
finished answers, loops, repetition, the teacher-forced divergence); the divergence of the student's own completions
follows, labelled on-policy, because a student that loops lowers it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


__all__ = ["format_results_table"]

# (label, key, format); a key with `_low`/`_high` siblings shows as `0.375 [0.180, 0.610]`. On-policy rows say so:
# they are measured on the student's own text, which a looping student games (see the module docstring).
_TABLE_ROWS = (
    ("accuracy [95% CI]", "accuracy", "{:.3f}"),
    ("teacher accuracy (ceiling)", "teacher_accuracy", "{:.3f}"),
    ("finished rate", "finished_rate", "{:.3f}"),
    ("clipped ratio", "clipped_ratio", "{:.3f}"),
    ("loop share", "loop_rate", "{:.3f}"),
    ("repeated 4-gram fraction", "repeated_ngram_fraction", "{:.3f}"),
    ("distinct-1", "distinct_1", "{:.3f}"),
    ("distinct-2", "distinct_2", "{:.3f}"),
    ("teacher-forced divergence", "teacher_forced_divergence", "{:.4f}"),
    ("teacher-forced top-1 agreement", "teacher_forced_top1_agreement", "{:.3f}"),
    ("on-policy mean divergence", "mean_divergence", "{:.4f}"),
    ("on-policy mean divergence (non-rock)", "mean_divergence_non_rock", "{:.4f}"),
    ("on-policy rock-token share", "rock_token_share", "{:.3f}"),
    ("on-policy top-1 agreement", "top1_agreement", "{:.3f}"),
    ("problems", "num_problems", "{:d}"),
    ("completion tokens", "num_tokens", "{:d}"),
    ("mean completion length", "mean_completion_length", "{:.1f}"),
)


def _cell(column: Mapping[str, Any], key: str, fmt: str) -> str:
    value = column.get(key)
    if value is None:
        return "-"
    text = fmt.format(value)
    low, high = column.get(f"{key}_low"), column.get(f"{key}_high")
    return text if low is None or high is None else f"{text} [{fmt.format(low)}, {fmt.format(high)}]"


def format_results_table(results: Mapping[str, Any]) -> str:
    """A text table with one column per result (e.g. `{"before": r0, "after": r1}`); None shows as `-`.

    A result is an `evaluation.EvalResult` (anything with `to_dict()`) or its dict, as `run_report.json` stores it.

    Accuracies show with their 95 % interval, `0.375 [0.137, 0.694]`; the divergence of the student's own completions
    is labelled on-policy, the one on the teacher's completions teacher-forced. A row nobody measured is left out.

    Example:
    ```python
    >>> from hf_rockopd.evaluation import format_results_table
    >>> print(format_results_table({"before": {"accuracy": 0.375, "accuracy_low": 0.137, "accuracy_high": 0.694,
    ...                                        "loop_rate": 0.5}, "after": {"accuracy": 0.5, "loop_rate": 0.0}}))
    metric                           before  after
    -----------------  --------------------  -----
    accuracy [95% CI]  0.375 [0.137, 0.694]  0.500
    loop share                        0.500  0.000
    ```
    """
    columns = {k: v.to_dict() if hasattr(v, "to_dict") else dict(v) for k, v in results.items()}
    rows = [["metric", *columns]]
    for label, key, fmt in _TABLE_ROWS:
        if all(c.get(key) is None for c in columns.values()):
            continue
        rows.append([label, *(_cell(c, key, fmt) for c in columns.values())])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
