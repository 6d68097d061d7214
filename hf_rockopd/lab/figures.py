"""The report's PNG figures, drawn with matplotlib's object API (`matplotlib.figure.Figure`), so drawing never changes
the pyplot backend of the calling program. Each `figure_*` function writes one PNG to `path`.

Example:
```python
figure_frequency(score.scores, "figures/frequency_divergence.png")
```
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from .categories import token_label
from .table import TokenTable


__all__ = [
    "figure_categories",
    "figure_early_late",
    "figure_frequency",
    "figure_gradients",
    "figure_histogram",
    "figure_knockout",
]


def _new_figure(width: float = 5.5, height: float = 3.6):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    return fig, fig.add_subplot(1, 1, 1)


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def figure_frequency(scores: pd.DataFrame, path: str) -> None:
    fig, ax = _new_figure()
    rest, rocks = scores[~scores["is_rock"]], scores[scores["is_rock"]]
    ax.scatter(rest["count"], rest["mean_divergence"], s=8, c="0.6", alpha=0.6, label="other types", linewidths=0)
    ax.scatter(rocks["count"], rocks["mean_divergence"], s=18, c="tab:red", label="rocks", linewidths=0)
    for _, row in rocks.head(8).iterrows():
        ax.annotate(token_label(row["token"]), (row["count"], row["mean_divergence"]), fontsize=7,
                    xytext=(3, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("occurrences in the corpus (log)")
    ax.set_ylabel("mean divergence")
    ax.set_title("Frequency vs mean divergence per token type")
    ax.legend(fontsize=8)
    _save(fig, path)


def figure_histogram(frame: pd.DataFrame, rock_ids: Sequence[int], path: str) -> None:
    fig, ax = _new_figure()
    is_rock = np.isin(frame["token_id"].to_numpy(), list(rock_ids))
    divergence = frame["divergence"].to_numpy(np.float64)
    bins = np.linspace(0.0, max(float(np.quantile(divergence, 0.995)), 1e-6), 40)
    clipped = np.clip(divergence, 0.0, bins[-1])
    ax.hist(clipped[~is_rock], bins=bins, density=True, alpha=0.6, color="0.5", label=f"others ({(~is_rock).sum()})")
    ax.hist(clipped[is_rock], bins=bins, density=True, alpha=0.6, color="tab:red", label=f"rocks ({is_rock.sum()})")
    ax.set_xlabel("per-occurrence divergence (top 0.5 % clipped into the last bin)")
    ax.set_ylabel("density")
    ax.set_title("Divergence of rock occurrences vs the others")
    ax.legend(fontsize=8)
    _save(fig, path)


def figure_categories(categories: pd.DataFrame, path: str) -> None:
    fig, ax = _new_figure()
    x = np.arange(len(categories))
    ax.bar(x - 0.2, categories["rock_share"], width=0.4, color="tab:red", label="rocks")
    ax.bar(x + 0.2, categories["control_share"], width=0.4, color="0.5", label="next-ranked types (controls)")
    ax.set_xticks(x)
    ax.set_xticklabels(categories["category"], fontsize=8)
    ax.set_ylabel("share of types")
    ax.set_title("Rock categories")
    ax.legend(fontsize=8)
    _save(fig, path)


def figure_gradients(table: TokenTable, groups: dict[str, list[int]], path: str) -> None:
    columns = [c for c in ("logit_grad_norm", "grad_cosine") if c in table.frame.columns]
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.2 * len(columns) + 0.5, 3.4), dpi=100)
    ids = table.frame["token_id"].to_numpy()
    for j, column in enumerate(columns):
        ax = fig.add_subplot(1, len(columns), j + 1)
        values = table.frame[column].to_numpy(np.float64)
        data = [values[np.isin(ids, g)] for g in groups.values()]
        keep = [k for k, d in enumerate(data) if len(d)]
        ax.boxplot([data[k] for k in keep], showfliers=False)
        ax.set_xticks(np.arange(1, len(keep) + 1))
        ax.set_xticklabels([list(groups)[k].replace("_", "\n") for k in keep], fontsize=7)
        ax.set_title({"logit_grad_norm": "logit-gradient norm", "grad_cosine": "cosine with G_balanced"}[column],
                     fontsize=9)
        if column == "logit_grad_norm":
            ax.set_yscale("log")
    _save(fig, path)


def figure_early_late(early: TokenTable, late: TokenTable, groups: dict[str, list[int]], path: str) -> None:
    fig, ax = _new_figure(4.6, 4.2)
    a, b = early.mean_divergence(), late.mean_divergence()
    both = np.flatnonzero(np.isfinite(a) & np.isfinite(b))
    ax.scatter(a[both], b[both], s=6, c="0.7", linewidths=0, label="all types")
    for (name, ids), color in zip(groups.items(), ("tab:red", "tab:blue", "tab:green")):
        ids = np.intersect1d(np.asarray(ids, dtype=np.int64), both)
        ax.scatter(a[ids], b[ids], s=14, c=color, linewidths=0, label=name.replace("_", " "))
    top = float(max(np.max(a[both]), np.max(b[both]), 1e-6)) if len(both) else 1.0
    ax.plot([0, top], [0, top], color="k", linewidth=0.8)
    ax.set_xlabel("mean divergence, first table")
    ax.set_ylabel("mean divergence, second table")
    ax.set_title("Early vs late, per token type")
    ax.legend(fontsize=7)
    _save(fig, path)


def figure_knockout(frame: pd.DataFrame, path: str) -> None:
    fig, ax = _new_figure(5.0, max(2.0, 0.9 + 0.28 * len(frame)))
    y = np.arange(len(frame))[::-1]
    colors = frame["verdict"].map({"Pillar": "tab:red", "Stumbling": "tab:blue"}).fillna("0.3")
    ax.errorbar(frame["delta"], y, xerr=[frame["delta"] - frame["ci_low"], frame["ci_high"] - frame["delta"]],
                fmt="none", ecolor="0.5", elinewidth=1)
    ax.scatter(frame["delta"], y, c=list(colors), zorder=3, s=16)
    ax.axvline(0.0, color="k", linewidth=0.8)
    ax.set_yticks(y)
    ax.set_yticklabels([token_label(str(t)) for t in frame["token"]], fontsize=7)
    ax.set_xlabel("accuracy change when banned (95 % bootstrap interval)")
    ax.set_title("Knockout (red: Pillar, blue: Stumbling, grey: Neutral)", fontsize=9)
    _save(fig, path)


# ---------------------------------------------------------------------------------------------------------------------
# The report
