"""Training curves for the model card: what the optimizer did and what the rock set did to it, on one figure.

Panels are themes, not one per logged key: loss (with the divergence on non-rock tokens), learning rate, gradient
norm, the token shares (frozen, down-weighted, trained), the rock set's size, the completions' length and clipped
share, then any other `rock/` metric. A series that carries no information (never finite, or zero at every step, like
`rock/grad_norm_share` while nothing is measured) is left out, and a series equal to another at every step is drawn
once and named after both. A dashed line marks the first step where rock tokens were frozen or down-weighted. A
long run's per-step values are noisy (each step is a few sampled completions), so past `SMOOTH_FROM` steps each series
is drawn faint, with its trailing mean over `smoothing_window` steps on top.

Example:
```python
>>> import tempfile
>>> from hf_rockopd.publishing.plots import first_freeze_step, plot_training_curves
>>> history = [{"step": 1, "loss": 2.0, "rock/frozen_fraction": 0.0},
...            {"step": 2, "loss": 1.5, "rock/frozen_fraction": 0.2}]
>>> first_freeze_step(history)
2
>>> plot_training_curves(history, tempfile.mkdtemp() + "/curves.png", title="demo").endswith("curves.png")
True
>>> plot_training_curves([{"step": 1, "train_runtime": 3.0}], "unused.png") is None  # nothing to plot
True
```
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from transformers.utils import logging


logger = logging.get_logger(__name__)

__all__ = ["PANELS", "SMOOTH_FROM", "first_freeze_step", "plot_checkpoint_curves", "plot_training_curves",
           "smoothing_window", "trailing_mean"]

# (panel title, [(logged key, legend label)], y-axis label). Keys not listed here get a panel of their own when they are
# `rock/` or `completions/` metrics; `train_*` summaries and `epoch` are never drawn.
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("loss", (("loss", "loss"), ("rock/mean_divergence_other", "divergence, non-rock tokens"),
              ("rock/mean_divergence_rock", "divergence, rock tokens")), "per token"),
    ("learning rate", (("learning_rate", "learning rate"),), ""),
    ("gradient norm", (("grad_norm", "grad norm (before clipping)"),), ""),
    ("completion tokens", (("rock/frozen_fraction", "frozen"), ("rock/down_weighted_fraction", "down-weighted"),
                           ("rock/projected_fraction", "trained")), "share"),
    ("rock set", (("rock/set_size", "rock tokens"), ("rock/candidates", "candidates")), "token types"),
    ("rock set stability", (("rock/jaccard_prev", "Jaccard with the previous set"),), "Jaccard vs. previous set"),
    ("rock share of the signal", (("rock/divergence_mass_share", "divergence mass"),
                                  ("rock/grad_norm_share", "gradient norm")), "share"),
    ("completion length", (("completions/mean_length", "mean length"),), "tokens"),
    ("completions cut at the limit", (("completions/clipped_ratio", "clipped"),), "share"),
)
_FREEZE_KEYS = ("rock/frozen_fraction", "rock/down_weighted_fraction")
# From this many points a series gets a trailing mean: the real-budget run's 200 steps of 2 rollouts each drew loss
# and clipped-share lines that jump over their whole range from one step to the next.
SMOOTH_FROM = 50
# Panels of states, not per-step samples: the rock set's size changes in steps at each refresh, and a mean would draw
# that step as a ramp.
_NOT_SMOOTHED = frozenset({"learning rate", "rock set", "rock set stability"})


def smoothing_window(num_points: int) -> int:
    """The trailing mean's width for a series of `num_points`: none (1) below `SMOOTH_FROM`, else about a twentieth
    of the run, at least 5 steps.

    Example:
    ```python
    >>> from hf_rockopd.publishing.plots import smoothing_window
    >>> smoothing_window(6), smoothing_window(200), smoothing_window(2000)
    (1, 10, 100)
    ```
    """
    return 1 if num_points < SMOOTH_FROM else max(5, round(num_points / 20))


def trailing_mean(points: Sequence[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """The mean of each `window` consecutive points, placed at the last one's step (the first `window - 1` steps
    have none).

    Example:
    ```python
    >>> from hf_rockopd.publishing.plots import trailing_mean
    >>> trailing_mean([(1, 1.0), (2, 3.0), (3, 5.0), (4, 0.0)], 2)
    [(2, 2.0), (3, 4.0), (4, 2.5)]
    ```
    """
    values = [v for _, v in points]
    return [(points[i][0], sum(values[i + 1 - window:i + 1]) / window) for i in range(window - 1, len(points))]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _series(log_history: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(e["step"], float(e[key])) for e in log_history if "step" in e and _is_number(e.get(key))]


def first_freeze_step(log_history: Sequence[Mapping[str, Any]]) -> int | None:
    """The first logged step at which some completion tokens were frozen or down-weighted (None if never).

    Example:
    ```python
    >>> from hf_rockopd.publishing.plots import first_freeze_step
    >>> first_freeze_step([{"step": 3, "rock/down_weighted_fraction": 0.0}, {"step": 4, "rock/frozen_fraction": 0.1}])
    4
    ```
    """
    steps = [s for key in _FREEZE_KEYS for s, v in _series(log_history, key) if v > 0]
    return min(steps) if steps else None


def _informative(points: list[tuple[int, float]]) -> bool:
    # Zero at every step is what a share logs while nothing is down-weighted yet: a flat line says nothing.
    return any(v != 0 for _, v in points)


def _panels(log_history: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[tuple[str, list]], str]]:
    """The panels to draw: (title, [(label, points)], y label); duplicate series merged, empty ones dropped."""
    listed = {key for _, series, _ in PANELS for key, _ in series}
    extra = sorted({
        key
        for entry in log_history
        if "step" in entry
        for key in entry
        if key.startswith(("rock/", "completions/")) and key not in listed
    })
    layout = [*PANELS, *((key.split("/", 1)[1].replace("_", " "), ((key, key),), "") for key in extra)]
    panels = []
    for title, series, ylabel in layout:
        drawn: list[tuple[str, list]] = []
        for key, label in series:
            points = _series(log_history, key)
            if not points or (key.startswith("rock/") and not _informative(points)):
                continue
            same = next((i for i, (_, other) in enumerate(drawn) if other == points), None)
            if same is not None:  # e.g. frozen == down-weighted when the policy's weight is 0
                drawn[same] = (f"{drawn[same][0]} = {label}", points)
            else:
                drawn.append((label, points))
        if drawn:
            panels.append((title, drawn, ylabel))
    return panels


def _window(panel: str, points: list[tuple[int, float]]) -> int:
    # A state (`_NOT_SMOOTHED`) or a constant series has nothing to smooth.
    return 1 if panel in _NOT_SMOOTHED or len({v for _, v in points}) == 1 else smoothing_window(len(points))


def plot_training_curves(
    log_history: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str | None = None
) -> str | None:
    """Draw the training curves of `log_history` (`trainer.state.log_history`) to the PNG `path` and return it.

    Returns `None` (and writes nothing) when no loss, optimizer, `rock/` or `completions/` metric was logged. `title`
    goes above the panels.

    Example:
    ```python
    from hf_rockopd.publishing.plots import plot_training_curves
    plot_training_curves(trainer.state.log_history, "training_curves.png", title="SmolLM2-24L, rock_online")
    ```
    """
    panels = _panels(log_history)
    if not panels:
        return None
    # The object-oriented API leaves pyplot's global state (and the user's backend) alone.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    figure = Figure(figsize=(4.4 * ncols, 2.9 * nrows + (0.5 if title else 0)), layout="constrained")
    if title:
        figure.suptitle(title, fontsize=11)
    axes = figure.subplots(nrows, ncols, squeeze=False).ravel()
    # One step range for every panel, so a metric logged only late in training is placed where it happened.
    all_steps = [e["step"] for e in log_history if "step" in e]
    pad = max(0.5, 0.03 * (max(all_steps) - min(all_steps)))
    frozen_at = first_freeze_step(log_history)
    for ax, (name, drawn, ylabel) in zip(axes, panels):
        for label, points in drawn:
            steps, values = zip(*points)
            window = _window(name, points)
            if window == 1:
                ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=label)
                continue
            (raw,) = ax.plot(steps, values, linewidth=0.8, alpha=0.3)
            mean_steps, means = zip(*trailing_mean(points, window))
            ax.plot(mean_steps, means, color=raw.get_color(), linewidth=1.6, label=f"{label}, mean of {window} steps")
        if frozen_at is not None:
            ax.axvline(frozen_at, color="tab:red", linestyle="--", linewidth=1,
                       label=f"rocks first frozen (step {frozen_at})" if name == "loss" else None)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if ylabel:
            ax.set_ylabel(ylabel, fontsize=8)
        if ylabel == "share" or name in ("learning rate", "rock set stability"):
            # Shares on their whole range: a zoomed 0.75-1.0 axis makes a small change look like a collapse.
            ax.set_ylim(0, 1.05 if ylabel == "share" or name == "rock set stability" else None)
        ax.set_xlim(min(all_steps) - pad, max(all_steps) + pad)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(drawn) > 1 or (name == "loss" and frozen_at is not None) or _window(name, drawn[0][1]) > 1:
            ax.legend(fontsize=7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def plot_checkpoint_curves(
    curves: Mapping[str, Sequence[Mapping[str, Any]]], path: str | os.PathLike, title: str | None = None,
    teacher_accuracy: float | None = None,
) -> str:
    """Held-out accuracy (with its Wilson interval) and teacher-forced divergence against the optimizer step, one line
    per run (`curves` maps a run's name to its `checkpoint_evals.jsonl` rows), to the PNG `path`. `teacher_accuracy`,
    a dashed line, is the teacher's on the same problems as the curves.

    Example:
    ```python
    from hf_rockopd.distill.checkpoints import read_checkpoint_evals
    from hf_rockopd.publishing.plots import plot_checkpoint_curves
    plot_checkpoint_curves({p: read_checkpoint_evals(f"runs/{p}/checkpoint_evals.jsonl") for p in ("uniform", "rock")},
                           "curves.png")
    ```
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(9.6, 3.4), layout="constrained")
    if title:
        figure.suptitle(title, fontsize=10)
    accuracy_axis, divergence_axis = figure.subplots(1, 2)
    for name, rows in curves.items():
        rows = [r for r in rows if r.get("accuracy") is not None]
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        line = accuracy_axis.plot(steps, [r["accuracy"] for r in rows], marker="o", markersize=3, label=name)[0]
        accuracy_axis.fill_between(steps, [r["accuracy_low"] for r in rows], [r["accuracy_high"] for r in rows],
                                   color=line.get_color(), alpha=0.12)
        divergence = [(r["step"], r["teacher_forced_divergence"]) for r in rows
                      if r.get("teacher_forced_divergence") is not None]
        if divergence:
            divergence_axis.plot(*zip(*divergence), marker="o", markersize=3, label=name, color=line.get_color())
    if teacher_accuracy is not None:
        accuracy_axis.axhline(teacher_accuracy, color="gray", linestyle="--", linewidth=1,
                              label=f"teacher, {teacher_accuracy:.3f}")
    size = next((r.get("num_problems") for rows in curves.values() for r in rows), None)
    accuracy_axis.set_title(f"accuracy on {size} held-out problems (95 % Wilson band)" if size else "accuracy",
                            fontsize=9)
    accuracy_axis.set_ylim(0, 1)
    divergence_axis.set_title("teacher-forced divergence (student on the teacher's answers)", fontsize=9)
    for ax in (accuracy_axis, divergence_axis):
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
