"""The ablation's summary: per policy mean ± interval over seeds, paired differences against uniform, a plot.

Reads every finished run (`runs/<policy>/seed_<seed>/result.json`) of an ablation directory and writes
`summary.json`, `summary.md` and `summary.png` (quality against compute). The statistics are
`hf_rockopd.ablate.stats`': per-problem metrics (correct, divergences, loop, finished, repeated n-grams) are paired
with the baseline's run of the same seed problem by problem and tested over seeds and problems; run-level metrics
(distinct-2 and the compute) enter as one value per run, so they are tested over seeds. All p-values of a summary
are adjusted together (Benjamini-Hochberg).
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .stats import (
    AblationStats,
    PolicySummary,
    RunOutcomes,
    ablation_stats,
    ablation_table,
    seed_interval,
)

__all__ = ["METRICS", "AblationSummary", "Metric", "load_runs", "run_outcomes", "summarize", "write_summary"]

RESULT_FORMAT = "hf_rockopd.ablate.run"


@dataclass(frozen=True)
class Metric:
    """One metric of the summary: its key in a run's `metrics`, and in its `problems` when measured per problem."""

    key: str
    label: str
    higher_is_better: bool | None  # None: a cost or a count, neither good nor bad in itself
    problem_key: str | None = None


METRICS = (
    Metric("accuracy", "accuracy", True, "correct"),
    Metric("teacher_forced_divergence", "teacher-forced divergence", False, "teacher_forced_divergence"),
    Metric("on_policy_divergence", "on-policy divergence (student's own text)", False, "on_policy_divergence"),
    Metric("loop_rate", "share of completions with a loop", False, "looped"),
    Metric("finished_rate", "share ended by a stop token", True, "finished"),
    Metric("repeated_ngram_fraction", "repeated 4-gram share", False, "repeated_ngram_fraction"),
    Metric("distinct_2", "distinct-2 over completions", True),
    Metric("projected_fraction", "share of completion rows projected through the heads", None),
    Metric("projected_rows", "rows projected through the heads", None),
    Metric("loss_seconds", "seconds in the loss forward", None),
    Metric("step_seconds", "seconds per optimizer step", None),
    Metric("total_seconds", "seconds per run (training and evaluation)", None),
)


def load_runs(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every finished run of an ablation directory, by policy then seed (a file of another format is an error).

    Example:
    ```python
    >>> from hf_rockopd.ablate.summary import load_runs
    >>> load_runs("no/such/ablation")
    []
    ```
    """
    runs = []
    for path in sorted(glob.glob(os.path.join(os.fspath(output_dir), "runs", "*", "seed_*", "result.json"))):
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
        if not isinstance(run, dict) or run.get("format") != RESULT_FORMAT:
            raise ValueError(f"{path} is not an ablation run result (no format {RESULT_FORMAT!r}).")
        runs.append(run)
    return sorted(runs, key=lambda r: (r["policy"], r["seed"]))


def _finite(value: Any) -> bool:
    return value is not None and not isinstance(value, str) and math.isfinite(float(value))


def run_outcomes(run: dict[str, Any]) -> RunOutcomes:
    """A run result as `stats.RunOutcomes`: per-problem values, or the run's one value for a run-level metric.

    A metric missing for a problem (no completion token to score, not measured yet) is left out of this run.

    Example:
    ```python
    >>> from hf_rockopd.ablate.summary import run_outcomes
    >>> run = {"policy": "uniform", "seed": 0, "metrics": {"step_seconds": 1.5},
    ...        "problems": [{"index": 0, "correct": True}, {"index": 1, "correct": False}]}
    >>> run_outcomes(run).to_dict()["metrics"]
    {'accuracy': [1.0, 0.0], 'step_seconds': [1.5]}
    ```
    """
    metrics = {}
    problems = sorted(run.get("problems", []), key=lambda p: p["index"])
    for metric in METRICS:
        if metric.problem_key is not None:
            values = [p.get(metric.problem_key) for p in problems]
            if values and all(_finite(v) for v in values):
                metrics[metric.key] = [float(v) for v in values]
        elif _finite(run["metrics"].get(metric.key)):
            metrics[metric.key] = [float(run["metrics"][metric.key])]
    return RunOutcomes(run["policy"], int(run["seed"]), metrics)


def start_values(evaluation: dict[str, Any] | None) -> dict[str, Any] | None:
    """The start weights' value of every metric, computed as a run's are (`run_outcomes`): the mean over problems of a
    per-problem metric, the run-level value otherwise.

    The evaluation's own `teacher_forced_divergence` averages over tokens, the runs' table over problems: printed
    side by side, the two would differ by the averaging alone (0.137 against 0.135 on the Qwen ablation's start).

    Example:
    ```python
    >>> from hf_rockopd.ablate.summary import start_values
    >>> start_values({"metrics": {"accuracy": 0.5, "distinct_2": 0.4, "teacher_forced_divergence": 0.3},
    ...               "problems": [{"index": 0, "correct": True, "teacher_forced_divergence": 0.1},
    ...                            {"index": 1, "correct": False, "teacher_forced_divergence": 0.2}]})["teacher_forced_divergence"]
    0.15000000000000002
    ```
    """
    if not evaluation or evaluation.get("metrics") is None:
        return None
    values = dict(evaluation["metrics"])
    if evaluation.get("problems"):
        outcomes = run_outcomes({"policy": "start", "seed": 0, **evaluation})
        values.update({key: float(sum(v) / len(v)) for key, v in outcomes.metrics.items() if len(v)})
    return values


@dataclass(frozen=True)
class AblationSummary:
    """The statistics of an ablation (`stats.AblationStats`) and the run-level metrics left untested.

    A run-level metric (distinct-2, the compute) is one value per run: with fewer than two seeds paired with the
    baseline there is nothing to test it against (a bootstrap of one value would call any difference certain), so it
    is only summarized (`untested`), not compared.
    """

    stats: AblationStats
    untested: tuple[PolicySummary, ...] = ()

    def summary(self, policy: str, metric: str) -> PolicySummary:
        """The summary of one policy and metric, tested or not (`KeyError` if absent)."""
        for item in self.untested:
            if (item.policy, item.metric) == (policy, metric):
                return item
        return self.stats.summary(policy, metric)

    @property
    def metrics(self) -> tuple[str, ...]:
        """Every summarized metric, tested first."""
        return (*self.stats.metrics, *dict.fromkeys(item.metric for item in self.untested))

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict: the stats' and the untested summaries."""
        return {**self.stats.to_dict(), "untested_summaries": [item.to_dict() for item in self.untested]}


def summarize(
    runs: Sequence[dict[str, Any]],
    baseline: str = "uniform",
    order: Sequence[str] | None = None,
    confidence: float = 0.95,
    n_resamples: int = 10_000,
) -> AblationSummary:
    """`stats.ablation_stats` of the runs, on every metric all of them have; policies in `order` after the baseline.

    Without a `baseline` run the first policy (in `order`) is the baseline.

    Example:
    ```python
    >>> from hf_rockopd.ablate.summary import summarize
    >>> runs = [{"policy": p, "seed": s, "metrics": {},
    ...          "problems": [{"index": 0, "correct": a}, {"index": 1, "correct": True}]}
    ...         for p, s, a in [("uniform", 0, 1), ("uniform", 1, 1), ("soft", 0, 0), ("soft", 1, 0)]]
    >>> s = summarize(runs, n_resamples=200)
    >>> s.summary("soft", "accuracy").mean, s.stats.difference("soft", "accuracy").delta
    (0.5, -0.5)
    ```
    """
    if not runs:
        raise ValueError("No finished run to summarize.")
    names = list(dict.fromkeys(r["policy"] for r in runs))
    ranked = [p for p in (order or []) if p in names] + sorted(p for p in names if p not in (order or []))
    if baseline not in ranked:
        baseline = ranked[0]
    ranked = sorted(ranked, key=lambda p: p != baseline)  # stable: the baseline first, the given order after it
    outcomes = [run_outcomes(r) for r in sorted(runs, key=lambda r: (ranked.index(r["policy"]), r["seed"]))]
    available = [m for m in METRICS if all(m.key in o.metrics for o in outcomes)]
    seeds = {p: {o.seed for o in outcomes if o.policy == p} for p in ranked}
    replicated = all(len(seeds[p] & seeds[baseline]) >= 2 for p in ranked if p != baseline)
    tested = [m.key for m in available if m.problem_key is not None or replicated]
    untested = [m.key for m in available if m.key not in tested]
    stats = ablation_stats(outcomes, baseline=baseline, metrics=tested, confidence=confidence,
                           n_resamples=n_resamples)  # fmt: skip
    summaries = []
    for policy in ranked:
        for key in untested:
            values = [(o.seed, float(o.metrics[key][0])) for o in outcomes if o.policy == policy]
            mean, low, high = seed_interval([v for _, v in values], confidence)
            summaries.append(PolicySummary(policy, key, tuple(s for s, _ in values), mean, low, high,
                                           tuple(v for _, v in values)))  # fmt: skip
    return AblationSummary(stats, tuple(summaries))


def _untested_table(result: AblationSummary) -> str:
    keys = list(dict.fromkeys(item.metric for item in result.untested))
    lines = ["| policy | seeds | " + " | ".join(keys) + " |", "| --- " * (2 + len(keys)) + "|"]
    for policy in result.stats.policies:
        cells = [f"{result.summary(policy, k).mean:.3f}" for k in keys]
        lines.append(f"| {policy} | {len(result.summary(policy, keys[0]).seeds)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(result: AblationSummary, start: dict[str, Any] | None = None) -> str:
    """The summary as Markdown: `stats.ablation_table`, the untested run-level metrics, the start weights' row, and
    what each metric is."""
    level = round(result.stats.confidence * 100)
    parts = [
        (
            f"Per policy: mean over seeds [{level} % t-interval]; then each policy − {result.stats.baseline}, paired by "
            "seed and problem (run-level metrics: by seed), with its interval, p and Benjamini-Hochberg q over every "
            "test below.\n"
        ),
        ablation_table(result.stats),
    ]
    if result.untested:
        parts += [
            "\nRun-level metrics with fewer than 2 seeds paired with the baseline: means only, not tested.\n",
            _untested_table(result),
        ]
    if start is not None:
        values = [f"{m.key} {start[m.key]:.3f}" for m in METRICS if _finite(start.get(m.key))]
        parts.append(f"\nStart weights of every run (reference, not compared): {', '.join(values)}.")
    parts.append("\nMetrics (↑ higher is better, ↓ lower):\n")
    for m in METRICS:
        if m.key in result.metrics:
            arrow = {True: " ↑", False: " ↓", None: ""}[m.higher_is_better]
            unit = "per problem" if m.problem_key else "per run"
            parts.append(f"- `{m.key}`{arrow}: {m.label} ({unit})")
    missing = [m.key for m in METRICS if m.key not in result.metrics]
    if missing:
        parts.append(f"\nNot in every run, so not compared: {', '.join(missing)}.")
    return "\n".join(parts) + "\n"


def _plot(result: AblationSummary, path: str) -> str | None:
    """Quality against compute: accuracy, loop rate and a divergence against the mean step time, one point a policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    divergence = next(
        (k for k in ("teacher_forced_divergence", "on_policy_divergence") if k in result.metrics), None
    )
    panels = [("accuracy", "accuracy ↑"), ("loop_rate", "share of completions with a loop ↓")]
    if divergence is not None:
        panels.append((divergence, divergence.replace("_", " ") + " ↓"))
    panels = [(k, label) for k, label in panels if k in result.metrics]
    if "step_seconds" not in result.metrics or not panels:
        return None
    # Intervals are clipped to each measure's range (times >= 0, shares in [0, 1]): with 2 or 3 seeds a t-interval
    # easily crosses them.
    bounds = {"accuracy": (0.0, 1.0), "loop_rate": (0.0, 1.0), "step_seconds": (0.0, None)}
    markers = "osD^vP*Xh<>p"
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 4), constrained_layout=True, squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for i, policy in enumerate(result.stats.policies):
            x, y = result.summary(policy, "step_seconds"), result.summary(policy, key)
            ax.errorbar(x.mean, y.mean, xerr=_error(x, bounds["step_seconds"]), yerr=_error(y, bounds.get(key)),
                        fmt=markers[i % len(markers)], markersize=7, capsize=3, color=f"C{i}", label=policy,
                        alpha=0.85)  # fmt: skip
        ax.set_xlabel("seconds per optimizer step (mean over seeds)")
        ax.set_ylabel(label)
        # Every measure here is >= 0: axes start at 0 (shares a little below, so a 0 shows), with room at the top.
        ax.autoscale_view()
        right = ax.get_xlim()[1]
        ax.set_xlim(0, right * 1.08)
        bottom = -0.02 if key in bounds else 0.0
        top = max(ax.get_ylim()[1], 0.05) if key in bounds else ax.get_ylim()[1]  # a share of 0 gets a visible axis
        ax.set_ylim(bottom, top + 0.08 * (top - bottom))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="best")
    fig.suptitle(
        f"Quality against compute per policy (mean over seeds, {round(result.stats.confidence * 100)} % interval "
        "clipped to the range)"
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _error(summary: Any, bounds: tuple[float | None, float | None] | None) -> list[list[float]] | None:
    """Matplotlib's asymmetric error bar for a `PolicySummary`, clipped to the measure's range (None: one seed)."""
    if math.isnan(summary.ci_low):
        return None
    low, high = summary.ci_low, summary.ci_high
    lower, upper = bounds or (0.0, None)
    low = low if lower is None else max(low, lower)
    high = high if upper is None else min(high, upper)
    return [[max(0.0, summary.mean - low)], [max(0.0, high - summary.mean)]]


def write_summary(output_dir: str | os.PathLike, baseline: str = "uniform") -> dict[str, Any]:
    """Summarize every finished run of `output_dir` into `summary.json`, `summary.md` and `summary.png`.

    Returns `{"summary": AblationSummary, "markdown": str, "files": {"json": ..., "table": ..., "plot": ...}}`.

    Example:
    ```python
    from hf_rockopd.ablate.summary import write_summary
    print(write_summary("runs/ablate")["markdown"])
    ```
    """
    root = os.fspath(output_dir)
    settings = _load(os.path.join(root, "ablation.json")) or {}
    start = start_values(_load(os.path.join(root, "start_eval.json")))
    runs = load_runs(root)
    result = summarize(runs, baseline=baseline, order=settings.get("policies"))
    text = markdown(result, start)
    data = {
        "command": settings.get("command"),
        "runs": [[r["policy"], r["seed"]] for r in runs],
        "metrics": [
            {"key": m.key, "label": m.label, "higher_is_better": m.higher_is_better, "per_problem": bool(m.problem_key)}
            for m in METRICS
        ],
        "start": start,
        "stats": result.to_dict(),
    }
    files = {"json": os.path.join(root, "summary.json"), "table": os.path.join(root, "summary.md")}
    for path, content in ((files["json"], json.dumps(data, indent=2)), (files["table"], text)):
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            f.write(content)
        os.replace(f"{path}.tmp", path)
    plot = _plot(result, os.path.join(root, "summary.png"))
    if plot is not None:
        files["plot"] = plot
    return {"summary": result, "markdown": text, "files": files}


def _load(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
