"""Statistics of the knockout experiment: Benjamini-Hochberg q-values and the paired bootstrap.

Example:
```python
>>> from hf_rockopd.lab import benjamini_hochberg, paired_bootstrap
>>> paired_bootstrap([1, 1, 0, 1], [1, 0, 0, 1], n_resamples=200)["delta"], benjamini_hochberg([0.5]).tolist()
(-0.25, [0.5])
```
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats


__all__ = ["benjamini_hochberg", "paired_bootstrap"]


def benjamini_hochberg(p_values: Sequence[float]) -> np.ndarray:
    """Benjamini-Hochberg q-values (`scipy.stats.false_discovery_control`), in the input order.

    Example:
    ```python
    >>> from hf_rockopd.lab import benjamini_hochberg
    >>> benjamini_hochberg([0.01, 0.04, 0.03]).round(3).tolist()
    [0.03, 0.04, 0.04]
    ```
    """
    p = np.asarray(p_values, dtype=np.float64)
    if p.size == 0:
        return p
    if not np.all((p >= 0) & (p <= 1)):
        raise ValueError(f"p-values must be in [0, 1], got {p[(p < 0) | (p > 1) | np.isnan(p)][:5].tolist()}.")
    return stats.false_discovery_control(p, method="bh")


def paired_bootstrap(
    baseline: Sequence[float], treated: Sequence[float], n_resamples: int = 10_000, seed: int = 0, alpha: float = 0.05
) -> dict[str, float]:
    """Paired bootstrap of the mean difference `treated − baseline` (e.g. per-problem correctness with a token banned).

    Problems are resampled with replacement `n_resamples` times. The two-sided p-value is twice the smaller share of
    resampled means on either side of 0 (capped at 1); the interval is the percentile `1 − alpha` interval.

    Example:
    ```python
    >>> from hf_rockopd.lab import paired_bootstrap
    >>> result = paired_bootstrap([1, 1, 0, 1], [1, 1, 0, 1])
    >>> result["delta"], result["p_value"]
    (0.0, 1.0)
    ```
    """
    a, b = np.asarray(baseline, dtype=np.float64), np.asarray(treated, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"baseline and treated must be equal-length, non-empty 1-D, got {a.shape} and {b.shape}.")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}.")
    diff = b - a
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, diff.size, size=(n_resamples, diff.size))].mean(axis=1)
    p = min(1.0, 2.0 * min(np.mean(means <= 0), np.mean(means >= 0)))
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return {"delta": float(diff.mean()), "ci_low": float(low), "ci_high": float(high), "p_value": float(p)}
