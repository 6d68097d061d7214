"""The one place where the ablation meets the quality measures (`hf_rockopd.quality`) and its paired statistics.

Per problem, a completion is judged by `hf_rockopd.quality` (loop, finished, repeated n-grams); per run, by its
`text_quality`. The statistics across runs (mean ± interval over seeds, the paired test against uniform,
Benjamini-Hochberg, the Markdown table) belong to `hf_rockopd.ablate.stats`, written beside this module by another
helper; until it lands the four functions below marked STATS-ADAPTER hold a minimal stand-in with the same role,
so that wiring `stats.py` in is a change of this file only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

from ..quality import (
    find_loop,
    is_finished,
    repeated_ngram_fraction,
    strip_stop,
    text_quality,
)


# ------------------------------------------------------------------------------------------- text quality ----
def problem_quality(ids: Sequence[int], stop_ids: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
    """The quality flags of one completion (generated ids): `looped`, `finished`, `repeated_ngram_fraction`.

    Example:
    ```python
    >>> from hf_rockopd.ablate.measures import problem_quality
    >>> problem_quality([4, 5, 6] * 6, stop_ids=[2], max_new_tokens=18)["looped"]
    True
    ```
    """
    text = strip_stop(ids, stop_ids)
    repeated = repeated_ngram_fraction(text)
    return {
        "looped": find_loop(text) is not None,
        "finished": bool(is_finished(ids, stop_ids, max_new_tokens)),
        "repeated_ngram_fraction": None if math.isnan(repeated) else float(repeated),
    }


def run_quality(
    completions: Sequence[Sequence[int]], stop_ids: Sequence[int], max_new_tokens: int, correct: Sequence[bool]
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
    quality = text_quality(completions, stop_ids, max_new_tokens, correct=list(correct)).to_dict()
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


# ------------------------------------------------------------------------------------ paired statistics ----
def _finite(values: Sequence[float | None]) -> np.ndarray:
    array = np.asarray([np.nan if v is None else float(v) for v in values], dtype=np.float64)
    return array[np.isfinite(array)]


def mean_interval(values: Sequence[float | None], confidence: float = 0.95) -> dict[str, Any]:
    """STATS-ADAPTER. Mean over seeds with its Student-t interval (None bounds for fewer than 2 values).

    Example:
    ```python
    >>> from hf_rockopd.ablate.measures import mean_interval
    >>> r = mean_interval([1.0, 2.0, 3.0]); r["mean"], round(r["low"], 3), r["n"]
    (2.0, -0.484, 3)
    ```
    """
    x = _finite(values)
    if x.size == 0:
        return {"mean": None, "low": None, "high": None, "n": 0}
    mean = float(x.mean())
    if x.size < 2:
        return {"mean": mean, "low": None, "high": None, "n": 1}
    half = float(scipy_stats.t.ppf(0.5 + confidence / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": int(x.size)}


def paired_difference(
    baseline: Sequence[float],
    treated: Sequence[float],
    clusters: Sequence[Any] | None = None,
    confidence: float = 0.95,
    n_resamples: int = 5000,
    seed: int = 0,
) -> dict[str, Any]:
    """STATS-ADAPTER. Mean of `treated - baseline` over pairs, its interval and two-sided p-value.

    With `clusters` (the problem of each (problem, seed) pair) a bootstrap that resamples whole problems, since one
    problem's outcomes over seeds are not independent; without, pairs are seeds: a paired t-test and t-interval.
    Pairs with a missing value are dropped.

    Example:
    ```python
    >>> from hf_rockopd.ablate.measures import paired_difference
    >>> r = paired_difference([0, 0, 1, 1], [1, 1, 1, 1], clusters=[0, 1, 2, 3]); r["delta"], r["n"]
    (0.5, 4)
    ```
    """
    a = np.asarray([np.nan if v is None else float(v) for v in baseline], dtype=np.float64)
    b = np.asarray([np.nan if v is None else float(v) for v in treated], dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"baseline and treated must pair up, got {a.size} and {b.size} values.")
    keep = np.isfinite(a) & np.isfinite(b)
    diff = (b - a)[keep]
    if diff.size == 0:
        return {"delta": None, "low": None, "high": None, "p_value": None, "n": 0}
    if clusters is None:
        # Few independent pairs (seeds): a paired t-test; a bootstrap of 2 or 3 values would claim p = 0.
        if diff.size < 2:
            return {"delta": float(diff.mean()), "low": None, "high": None, "p_value": None, "n": int(diff.size)}
        interval = mean_interval(diff, confidence)
        if np.ptp(diff) <= 1e-12 * max(1.0, abs(float(diff.mean()))):
            # No spread: the t statistic is undefined; every seed agrees on the sign (or on no difference).
            p = 1.0 if abs(float(diff.mean())) <= 1e-12 else 0.0
        else:
            p = float(scipy_stats.ttest_1samp(diff, 0.0).pvalue)
        return {"delta": interval["mean"], "low": interval["low"], "high": interval["high"], "p_value": p,
                "n": int(diff.size)}
    groups = np.asarray(list(clusters), dtype=object)[keep]
    labels, index = np.unique(groups.astype(str), return_inverse=True)
    sums, counts = np.bincount(index, weights=diff), np.bincount(index).astype(np.float64)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, labels.size, size=(n_resamples, labels.size))
    means = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    low, high = np.quantile(means, [0.5 - confidence / 2, 0.5 + confidence / 2])
    if np.all(diff == 0):
        p = 1.0
    else:
        p = min(1.0, 2.0 * min(float(np.mean(means <= 0)), float(np.mean(means >= 0))))
    return {"delta": float(diff.mean()), "low": float(low), "high": float(high), "p_value": p, "n": int(diff.size)}


def benjamini_hochberg(p_values: Sequence[float | None]) -> list[float | None]:
    """STATS-ADAPTER. Benjamini-Hochberg q-values in input order (None stays None).

    Example:
    ```python
    >>> from hf_rockopd.ablate.measures import benjamini_hochberg
    >>> [round(q, 3) for q in benjamini_hochberg([0.01, 0.04, 0.03])]
    [0.03, 0.04, 0.04]
    ```
    """
    present = [i for i, p in enumerate(p_values) if p is not None]
    out: list[float | None] = [None] * len(p_values)
    if present:
        q = scipy_stats.false_discovery_control(np.asarray([p_values[i] for i in present], dtype=np.float64))
        for i, value in zip(present, q):
            out[i] = float(value)
    return out


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """STATS-ADAPTER. A GitHub Markdown table (cells as given, None as `-`).

    Example:
    ```python
    >>> from hf_rockopd.ablate.measures import markdown_table
    >>> print(markdown_table(["policy", "accuracy"], [["uniform", "0.5"]]))
    | policy | accuracy |
    | --- | --- |
    | uniform | 0.5 |
    ```
    """
    def cell(value: Any) -> str:
        return "-" if value is None else str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(map(cell, header)) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def format_interval(summary: Mapping[str, Any], digits: int = 3) -> str:
    """`mean ± half-width` of a `mean_interval` result (`mean` alone for one seed, `-` for none)."""
    if summary.get("mean") is None:
        return "-"
    if summary.get("low") is None:
        return f"{summary['mean']:.{digits}f}"
    return f"{summary['mean']:.{digits}f} ± {(summary['high'] - summary['low']) / 2:.{digits}f}"
