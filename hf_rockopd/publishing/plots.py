"""Training curves for the model card: loss and the `rock/` and `completions/` metrics of a run, one panel each.

Example:
```python
>>> import tempfile
>>> from hf_rockopd.publishing.plots import plot_training_curves
>>> history = [{"step": 1, "loss": 2.0, "rock/frozen_fraction": 0.1}, {"step": 2, "loss": 1.5}]
>>> plot_training_curves(history, tempfile.mkdtemp() + "/curves.png").endswith("curves.png")
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

__all__ = ["plot_training_curves"]


def _curve_keys(log_history: Sequence[Mapping[str, Any]]) -> list[str]:
    """The logged keys that get a panel: `loss`, `eval_loss` first, then the `rock/` and `completions/` metrics."""
    keys: dict[str, None] = {}
    for entry in log_history:
        if "step" not in entry:
            continue
        for key, value in entry.items():
            plotted = key in ("loss", "eval_loss") or key.startswith(("rock/", "eval_rock/", "completions/"))
            if plotted and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                keys[key] = None
    return sorted(keys, key=lambda k: (k not in ("loss", "eval_loss"), k))


def plot_training_curves(log_history: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> str | None:
    """Plot loss and the `rock/` (and `completions/`) metrics of `log_history` against the step, one panel each.

    Writes a PNG to `path` and returns it, or returns `None` (and writes nothing) when no such metric was logged.

    Example:
    ```python
    from hf_rockopd.publishing.plots import plot_training_curves
    plot_training_curves(trainer.state.log_history, "training_curves.png")
    ```
    """
    keys = _curve_keys(log_history)
    if not keys:
        return None
    # The object-oriented API leaves pyplot's global state (and the user's backend) alone.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    figure = Figure(figsize=(4.2 * ncols, 2.8 * nrows), layout="constrained")
    axes = figure.subplots(nrows, ncols, squeeze=False).ravel()
    # One step range for every panel, so a metric logged only late in training is placed where it happened.
    all_steps = [e["step"] for e in log_history if "step" in e]
    pad = max(0.5, 0.03 * (max(all_steps) - min(all_steps)))
    for ax, key in zip(axes, keys):
        points = [(e["step"], e[key]) for e in log_history if "step" in e and isinstance(e.get(key), (int, float))]
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_xlim(min(all_steps) - pad, max(all_steps) + pad)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
