"""The ablation's summary: per policy mean ± interval over seeds, paired differences against uniform, a plot.

Reads every finished run (`runs/<policy>/seed_<seed>/result.json`) of an ablation directory and writes
`summary.json`, `summary.md` and `summary.png` (quality against compute). Per-problem metrics (correct, divergences,
loop, finished) are paired over (problem, seed) with the baseline's run of the same seed, and the test resamples whole
problems; run-level metrics (distinct-2, compute) are paired over seeds. All p-values of a summary are adjusted
together (Benjamini-Hochberg).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .measures import (
    benjamini_hochberg,
    format_interval,
    markdown_table,
    mean_interval,
    paired_difference,
)

__all__ = ["METRICS", "Metric", "load_runs", "summarize", "write_summary"]

RESULT_FORMAT = "hf_rockopd.ablate.run"


@dataclass(frozen=True)
class Metric:
    """One column of the summary: its key in a run's `metrics`, and in its `problems` when measured per problem."""

    key: str
    label: str
    higher_is_better: bool | None  # None: a cost or a count, neither good nor bad in itself
    problem_key: str | None = None
    kind: str = "quality"  # or "compute"


METRICS = (
    Metric("accuracy", "accuracy", True, "correct"),
    Metric("teacher_forced_divergence", "teacher-forced divergence", False, "teacher_forced_divergence"),
    Metric("on_policy_divergence", "on-policy divergence", False, "on_policy_divergence"),
    Metric("loop_rate", "loop rate", False, "looped"),
    Metric("finished_rate", "finished rate", True, "finished"),
    Metric("repeated_ngram_fraction", "repeated 4-grams", False, "repeated_ngram_fraction"),
    Metric("distinct_2", "distinct-2", True),
    Metric("projected_fraction", "projected rows (share)", None, kind="compute"),
    Metric("projected_rows", "projected rows", None, kind="compute"),
    Metric("loss_seconds", "loss time (s)", None, kind="compute"),
    Metric("step_seconds", "step time (s)", None, kind="compute"),
    Metric("total_seconds", "total time (s)", None, kind="compute"),
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


def _policy_order(runs: Sequence[dict[str, Any]], baseline: str, order: Sequence[str] | None) -> list[str]:
    names = list(dict.fromkeys(r["policy"] for r in runs))
    ranked = [p for p in (order or []) if p in names] + sorted(p for p in names if p not in (order or []))
    return sorted(ranked, key=lambda p: p != baseline)  # stable: the baseline first, the given order after it


def _problem_values(run: dict[str, Any], key: str) -> dict[int, float | None]:
    out = {}
    for problem in run.get("problems", []):
        value = problem.get(key)
        out[int(problem["index"])] = None if value is None else float(value)
    return out


def summarize(
    runs: Sequence[dict[str, Any]], baseline: str = "uniform", order: Sequence[str] | None = None,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Per policy and metric the mean ± interval over seeds; per policy the paired differences against `baseline`.

    Example:
    ```python
    >>> from hf_rockopd.ablate.summary import summarize
    >>> runs = [{"policy": p, "seed": s, "metrics": {"accuracy": a},
    ...          "problems": [{"index": 0, "correct": a > 0.5}, {"index": 1, "correct": True}]}
    ...         for p, s, a in [("uniform", 0, 1.0), ("uniform", 1, 1.0), ("soft", 0, 0.5), ("soft", 1, 0.5)]]
    >>> s = summarize(runs)
    >>> s["policies"]["soft"]["metrics"]["accuracy"]["mean"], s["paired"]["soft"]["accuracy"]["delta"]
    (0.5, -0.5)
    ```
    """
    policies = _policy_order(runs, baseline, order)
    by_policy = {p: {r["seed"]: r for r in runs if r["policy"] == p} for p in policies}
    summary: dict[str, Any] = {"baseline": baseline, "confidence": confidence, "policies": {}, "paired": {}}
    for policy, seeded in by_policy.items():
        summary["policies"][policy] = {
            "seeds": sorted(seeded),
            "metrics": {
                m.key: mean_interval([r["metrics"].get(m.key) for r in seeded.values()], confidence) for m in METRICS
            },
        }
    tests = []
    base = by_policy.get(baseline, {})
    for policy, seeded in by_policy.items():
        if policy == baseline or not base:
            continue
        seeds = sorted(set(seeded) & set(base))
        summary["paired"][policy] = {}
        for metric in METRICS:
            a, b, clusters = [], [], []
            if metric.problem_key is not None:
                for seed in seeds:
                    left = _problem_values(base[seed], metric.problem_key)
                    right = _problem_values(seeded[seed], metric.problem_key)
                    for index in sorted(set(left) & set(right)):
                        a.append(left[index])
                        b.append(right[index])
                        clusters.append(index)
                unit = "problem x seed"
            else:
                a = [base[s]["metrics"].get(metric.key) for s in seeds]
                b = [seeded[s]["metrics"].get(metric.key) for s in seeds]
                clusters, unit = None, "seed"
            test = paired_difference(a, b, clusters=clusters, confidence=confidence)
            test["unit"] = unit
            test["seeds"] = seeds
            summary["paired"][policy][metric.key] = test
            tests.append(test)
    for test, q in zip(tests, benjamini_hochberg([t["p_value"] for t in tests])):
        test["q_value"] = q
    return summary


def _number(value: float | None, digits: int = 3) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def _p(value: float | None) -> str | None:
    # A bootstrap p-value of 0 means "below the resolution of the resamples", not 0.
    return None if value is None else "<0.001" if value < 0.001 else f"{value:.3f}"


def markdown(summary: dict[str, Any], start: dict[str, Any] | None = None) -> str:
    """The two Markdown tables of a `summarize` result (and the start weights' row, when given)."""
    shown = [m for m in METRICS if m.key != "projected_rows"]
    header = ["policy", "seeds", *(m.label + (" ↑" if m.higher_is_better else " ↓" if m.higher_is_better is False
                                              else "") for m in shown)]
    rows = []
    if start is not None:
        rows.append(["(start weights)", "-", *(_number(start["metrics"].get(m.key)) for m in shown)])
    for policy, data in summary["policies"].items():
        rows.append([policy, len(data["seeds"]), *(format_interval(data["metrics"][m.key]) for m in shown)])
    level = round(summary["confidence"] * 100)
    parts = [f"Mean ± half-width of the {level}% interval over seeds.\n", markdown_table(header, rows)]
    paired_rows = []
    for policy, tests in summary["paired"].items():
        for m in shown:
            t = tests[m.key]
            if t["delta"] is None:
                continue
            interval = f"{t['delta']:+.3f}" + ("" if t["low"] is None else f" [{t['low']:+.3f}, {t['high']:+.3f}]")
            paired_rows.append([policy, m.label, interval, t["n"], t["unit"], _p(t["p_value"]), _p(t["q_value"])])
    if paired_rows:
        parts += [
            (
                f"\nPaired differences against {summary['baseline']} (policy − {summary['baseline']}; per problem x "
                f"seed: {level}% bootstrap over problems; per seed: paired t; q: Benjamini-Hochberg over every test of "
                "this table).\n"
            ),
            markdown_table(["policy", "metric", "difference", "pairs", "paired over", "p", "q"], paired_rows),
        ]
    return "\n".join(parts) + "\n"


def _error(summary: dict[str, Any], bounds: tuple[float | None, float | None]) -> list[list[float]] | None:
    """Matplotlib's asymmetric error bar for a `mean_interval`, clipped to the measure's range."""
    if summary["low"] is None:
        return None
    low, high = summary["low"], summary["high"]
    if bounds[0] is not None:
        low = max(low, bounds[0])
    if bounds[1] is not None:
        high = min(high, bounds[1])
    return [[max(0.0, summary["mean"] - low)], [max(0.0, high - summary["mean"])]]


def _plot(summary: dict[str, Any], path: str) -> str:
    """Quality against compute: accuracy, loop rate and a divergence against the mean step time, one point a policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = summary["policies"]
    has_tf = any(p["metrics"]["teacher_forced_divergence"]["mean"] is not None for p in policies.values())
    divergence = "teacher_forced_divergence" if has_tf else "on_policy_divergence"
    panels = [("accuracy", "accuracy ↑"), ("loop_rate", "loop rate ↓"),
              (divergence, ("teacher-forced" if has_tf else "on-policy") + " divergence ↓")]
    # Intervals are clipped to each measure's range (times >= 0, rates in [0, 1]): with 2 or 3 seeds a t-interval
    # easily crosses them.
    bounds = {"accuracy": (0.0, 1.0), "loop_rate": (0.0, 1.0), divergence: (0.0, None), "step_seconds": (0.0, None)}
    markers = "osD^vP*Xh<>p"
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    for ax, (key, label) in zip(axes, panels):
        for i, (policy, data) in enumerate(policies.items()):
            x, y = data["metrics"]["step_seconds"], data["metrics"][key]
            if x["mean"] is None or y["mean"] is None:
                continue
            ax.errorbar(x["mean"], y["mean"], xerr=_error(x, bounds["step_seconds"]), yerr=_error(y, bounds[key]),
                        fmt=markers[i % len(markers)], markersize=7, capsize=3, color=f"C{i}", label=policy, alpha=0.85)
        ax.set_xlabel("step time (s, mean over seeds)")
        ax.set_ylabel(label)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    level = round(summary["confidence"] * 100)
    fig.suptitle(f"Quality against compute per policy (mean, {level}% interval over seeds clipped to the range)")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_summary(output_dir: str | os.PathLike, baseline: str = "uniform") -> dict[str, Any]:
    """Summarize every finished run of `output_dir` into `summary.json`, `summary.md` and `summary.png`.

    Returns `{"summary": ..., "markdown": ..., "files": {"json": ..., "table": ..., "plot": ...}}`.

    Example:
    ```python
    from hf_rockopd.ablate.summary import write_summary
    print(write_summary("runs/ablate")["markdown"])
    ```
    """
    root = os.fspath(output_dir)
    settings_path, start_path = os.path.join(root, "ablation.json"), os.path.join(root, "start_eval.json")
    settings = _load(settings_path) or {}
    start = _load(start_path)
    runs = load_runs(root)
    summary = summarize(runs, baseline=baseline, order=settings.get("policies"))
    summary["command"] = settings.get("command")
    summary["start"] = start and start.get("metrics")
    text = markdown(summary, start)
    files = {"json": os.path.join(root, "summary.json"), "table": os.path.join(root, "summary.md")}
    for path, content in ((files["json"], json.dumps(summary, indent=2)), (files["table"], text)):
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            f.write(content)
        os.replace(f"{path}.tmp", path)
    if runs:
        files["plot"] = _plot(summary, os.path.join(root, "summary.png"))
    return {"summary": summary, "markdown": text, "files": files}


def _load(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
