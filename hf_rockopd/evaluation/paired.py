"""Paired comparisons of evaluations on the same problems: the exact McNemar test, and the verdict of a distillation
(each policy's student after training against the base student and against each other) in `result.json`'s shape.

Two evaluations of one problem set are paired: a problem solved by both, or by neither, says nothing about which model
is better. The exact McNemar test looks only at the discordant problems (solved by one model alone) and asks whether
their split is far from even, a two-sided binomial test at p = 1/2 (`scipy.stats.binomtest`). With few discordant
problems it is the right test where the chi-squared approximation is not (Fagerland et al., BMC Med Res Methodol
2013, "The McNemar test for binary matched-pairs data").

Example:
```python
>>> from hf_rockopd.evaluation.paired import mcnemar_exact
>>> test = mcnemar_exact([True, True, False, False, True], [False, False, False, False, True])
>>> test.only_first, test.only_second, round(test.p_value, 3)
(2, 0, 0.5)
```
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from scipy import stats

from .quality import accuracy_interval

__all__ = ["PairedTest", "correct_flags", "distillation_verdict", "mcnemar_exact"]


@dataclass(frozen=True)
class PairedTest:
    """The exact McNemar test of two models' per-problem correctness.

    Parameters:
        num_problems: problems compared (the same in both, in the same order).
        accuracy_first, accuracy_second: each model's accuracy.
        only_first, only_second: problems solved by that model alone (the discordant pairs).
        p_value: two-sided exact p-value (1.0 with no discordant problem).
    """

    num_problems: int
    accuracy_first: float
    accuracy_second: float
    only_first: int
    only_second: int
    p_value: float

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict."""
        return asdict(self)


def mcnemar_exact(first: Sequence[bool], second: Sequence[bool]) -> PairedTest:
    """The exact (binomial) McNemar test of two paired lists of per-problem correctness flags.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.paired import mcnemar_exact
    >>> mcnemar_exact([True] * 10 + [False] * 10, [False] * 10 + [False] * 10).p_value < 0.01
    True
    ```
    """
    if len(first) != len(second):
        raise ValueError(
            f"A paired test needs the same problems in both evaluations, got {len(first)} and {len(second)} results."
        )
    if not first:
        raise ValueError("A paired test needs at least one problem, got none.")
    a, b = [bool(x) for x in first], [bool(x) for x in second]
    only_first = sum(x and not y for x, y in zip(a, b))
    only_second = sum(y and not x for x, y in zip(a, b))
    discordant = only_first + only_second
    p_value = 1.0 if discordant == 0 else float(stats.binomtest(only_first, discordant, 0.5).pvalue)
    return PairedTest(len(a), sum(a) / len(a), sum(b) / len(b), only_first, only_second, min(1.0, p_value))


def correct_flags(evaluation: Mapping[str, Any], where: str = "the evaluation") -> list[bool]:
    """The per-problem correctness of a saved evaluation (`EvalResult.to_dict(include_records=True)`).

    Example:
    ```python
    >>> from hf_rockopd.evaluation.paired import correct_flags
    >>> correct_flags({"records": [{"correct": True}, {"correct": False}]})
    [True, False]
    ```
    """
    records = evaluation.get("records")
    if not records:
        raise ValueError(
            f"{where} has no per-problem records: save it with include_records=True (`hf-rockopd eval --records`, "
            "or the eval_before.json / eval_after.json of `hf-rockopd distill`)."
        )
    flags = [record.get("correct") for record in records]
    if any(flag is None for flag in flags):
        raise ValueError(f"{where} has problems without a correctness flag (was it evaluated with --verifier none?).")
    return [bool(flag) for flag in flags]


def _problems_key(evaluation: Mapping[str, Any]) -> list[Any]:
    return [record.get("gold") for record in evaluation.get("records") or []]


def distillation_verdict(
    before: Mapping[str, Any],
    runs: Mapping[str, Mapping[str, Any]],
    *,
    teacher: str,
    student: str,
    steps: int,
    rock_policy: str | None = None,
    baseline_policy: str = "uniform",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(result, details)`: the verdict of distilling `student` from `teacher` with each policy of `runs`.

    `before` is the base student's evaluation, shared by every run; `runs` maps a policy name to its student's
    evaluation after training (all saved with records, on the same problems in the same order). `result` has exactly
    the shape of `result.json`; `details` adds the intervals, the discordant counts and the teacher's interval.

    Example:
    ```python
    result, details = distillation_verdict(before, {"uniform": after_uniform, "rock_online": after_rocks},
                                           teacher="Qwen/Qwen2.5-Coder-1.5B-Instruct",
                                           student="Qwen/Qwen2.5-Coder-0.5B-Instruct", steps=200)
    ```
    """
    if not runs:
        raise ValueError("A verdict needs at least one run after training, got none.")
    base = correct_flags(before, "The evaluation before training")
    gold = _problems_key(before)
    result_runs: dict[str, Any] = {}
    detail_runs: dict[str, Any] = {}
    flags: dict[str, list[bool]] = {}
    for policy, after in runs.items():
        if _problems_key(after) != gold:
            raise ValueError(
                f"The evaluation of {policy!r} after training is on other problems than the one before training "
                f"({len(after.get('records') or [])} vs {len(gold)} problems, or another order)."
            )
        flags[policy] = correct_flags(after, f"The evaluation of {policy!r} after training")
        test = mcnemar_exact(flags[policy], base)
        result_runs[policy] = {
            "accuracy_before": before["accuracy"],
            "accuracy_after": after["accuracy"],
            "p_value_vs_before": test.p_value,
            "cut_after": after.get("cut_ratio"),
            "loops_after": after.get("loop_rate"),
            "tf_divergence_before": before.get("teacher_forced_divergence"),
            "tf_divergence_after": after.get("teacher_forced_divergence"),
        }
        detail_runs[policy] = {
            "before": accuracy_interval(base).to_dict(),
            "after": accuracy_interval(flags[policy]).to_dict(),
            "vs_before": test.to_dict(),
            "cut_before": before.get("cut_ratio"),
            "loops_before": before.get("loop_rate"),
        }
    teacher_accuracy = before.get("teacher_accuracy")
    result: dict[str, Any] = {
        "pair": {"teacher": teacher, "student": student},
        "steps": int(steps),
        "num_eval_problems": len(base),
        "teacher_accuracy": teacher_accuracy,
        "runs": result_runs,
        "p_value_rocks_vs_uniform": None,
    }
    details: dict[str, Any] = {
        "teacher": {"accuracy": teacher_accuracy, "low": before.get("teacher_accuracy_low"),
                    "high": before.get("teacher_accuracy_high")},
        "runs": detail_runs,
    }
    rock = rock_policy or next((p for p in runs if p != baseline_policy), None)
    if rock is not None and baseline_policy in runs and rock in runs:
        test = mcnemar_exact(flags[rock], flags[baseline_policy])
        result["p_value_rocks_vs_uniform"] = test.p_value
        details["rocks_vs_uniform"] = {"rock_policy": rock, **test.to_dict()}
    if teacher_accuracy is not None:
        # The share of the teacher-student gap that distillation closed: (after - before) / (teacher - before).
        gap = teacher_accuracy - before["accuracy"]
        for policy, row in result_runs.items():
            detail_runs[policy]["gap_closed"] = (row["accuracy_after"] - row["accuracy_before"]) / gap if gap else None
    return result, details
