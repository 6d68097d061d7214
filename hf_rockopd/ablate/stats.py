"""Paired statistics of the ablation: each token policy against the baseline over problems AND seeds.

An ablation is a grid of runs, one per (policy, seed); every run is evaluated on the same problems in the same order
and gives per-problem outcomes (correct 0/1, teacher-forced divergence, loop flag, finished flag, …). From them:

- `PolicySummary`: per policy and metric, the mean over seeds of each run's mean over problems, with the t-interval
  over those seed means (`seed_interval`; undefined, NaN, with one seed: one run says nothing about run-to-run noise).
- `PairedDifference`: per policy and metric, the difference to the baseline run of the same seed (same data order),
  with a 95 % interval and a two-sided p-value from `paired_difference` (a bootstrap over seeds and problems, guarded
  by a t-test over seeds), and its Benjamini-Hochberg q-value over all policies × metrics.
- `ablation_stats` computes both into an `AblationStats`; `ablation_table` writes it as Markdown.

Example:
```python
>>> from hf_rockopd.ablate.stats import RunOutcomes, ablation_stats
>>> runs = [RunOutcomes("uniform", s, {"correct": [1, 0, 1, 0]}) for s in (0, 1)]
>>> runs += [RunOutcomes("rock_freeze", s, {"correct": [1, 0, 1, 0]}) for s in (0, 1)]
>>> d = ablation_stats(runs, n_resamples=200).difference("rock_freeze", "correct")
>>> d.delta, d.p_value
(0.0, 1.0)
```
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy import stats

__all__ = [
    "BASELINE_POLICY",
    "AblationStats",
    "PairedDifference",
    "PolicySummary",
    "RunOutcomes",
    "ablation_stats",
    "ablation_table",
    "crossed_bootstrap",
    "paired_difference",
    "seed_interval",
]

BASELINE_POLICY = "uniform"  # plain OPD: the paper's baseline, every other policy is compared with it

# Why a crossed bootstrap over seeds and problems (Owen 2007, "the pigeonhole bootstrap"), guarded by a t-test over
# seeds. The same problems are scored in every run, so problems and seeds are crossed factors, and a claim that a
# policy is better should hold for other problems AND other training runs. The paired difference of one seed varies
# with the problem (some problems flip) and moves as a whole with the seed (training noise changes the run).
# Resampling seeds and problems independently, and re-weighting the seeds x problems matrix of differences, gives a
# spread with both variance components in it. The alternatives fail here: a sign flip per (seed, problem) difference
# treats them as independent and ignores that one seed's noise moves all its problems together (too small p-values
# when runs differ); a sign flip of whole seeds is exact but has 2^S arrangements, so with 3 seeds no two-sided p
# falls below 0.25. The bootstrap's weak side is few seeds: 3 seeds give only 10 distinct seed resamples, so when
# run-to-run noise dominates its p-values are too small. So `paired_difference` also runs the one-sample t-test over
# the S per-seed mean differences, which is exact about S (normal seed noise), and keeps the larger p-value and the
# hull of the two intervals: a difference is called only if it holds over new problems and new seeds.
# Measured under no true difference (3 seeds x 100 problems of 0/1 outcomes, alpha 0.05, per-seed accuracy noise of
# sd 0 / 0.05 / 0.15 / 0.3): the bootstrap alone rejects 0.7 / 2 / 10 / 21 %, the guarded test 0.7 / 1 / 4 / 6 %
# (2 seeds, sd 0.15: 15 % and 4 %). It is conservative when run-to-run noise is small (the pigeonhole bootstrap counts
# the cell noise twice), and that is its price: a true +0.10 accuracy on 3 seeds x 200 problems is found 41 % of the
# time (the bootstrap alone: 67 %). A two-way ANOVA t-test with Satterthwaite degrees of freedom was tried too: 7 %
# false positives and 37 % power in the same settings. More seeds are the only way to more power that is honest.


def _json(value: Any) -> Any:
    """NaN (undefined) as None, tuples as lists: JSON has neither NaN nor tuples."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, (tuple, list)):
        return [_json(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _json(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, eq=False)
class RunOutcomes:
    """One run of the ablation: its policy, its seed and per-problem outcomes, metric name -> one value per problem.

    Every run must list the same problems in the same order, so that runs pair up problem by problem. The values are
    kept as float arrays (so runs compare by identity: `==` on arrays has no single truth value).

    Example:
    ```python
    >>> from hf_rockopd.ablate.stats import RunOutcomes
    >>> RunOutcomes("uniform", 0, {"correct": [1, 0], "loop": [0, 0]}).to_dict()
    {'policy': 'uniform', 'seed': 0, 'metrics': {'correct': [1.0, 0.0], 'loop': [0.0, 0.0]}}
    ```
    """

    policy: str
    seed: int
    metrics: Mapping[str, Sequence[float]]

    def __post_init__(self) -> None:
        # Store float arrays once, checked: a NaN would silently turn every mean and difference into NaN.
        arrays = {}
        for name, values in self.metrics.items():
            array = np.asarray(values, dtype=np.float64)
            if array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array)):
                raise ValueError(
                    f"Run ({self.policy!r}, seed {self.seed}): metric {name!r} needs a non-empty list of finite "
                    f"per-problem values, got shape {array.shape} with {int(np.sum(~np.isfinite(array)))} non-finite."
                )
            arrays[name] = array
        object.__setattr__(self, "metrics", arrays)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict."""
        return {"policy": self.policy, "seed": self.seed, "metrics": {k: v.tolist() for k, v in self.metrics.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunOutcomes:
        """Read back a `to_dict()`."""
        return cls(policy=data["policy"], seed=int(data["seed"]), metrics=dict(data["metrics"]))


@dataclass(frozen=True)
class PolicySummary:
    """One policy's metric over seeds: the mean of the runs' means with its t-interval (NaN bounds for one seed).

    Example:
    ```python
    >>> from hf_rockopd.ablate.stats import PolicySummary
    >>> PolicySummary("uniform", "correct", (0,), 0.5, float("nan"), float("nan"), (0.5,)).to_dict()["ci_low"] is None
    True
    ```
    """

    policy: str
    metric: str
    seeds: tuple[int, ...]
    mean: float
    ci_low: float
    ci_high: float
    seed_means: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict (NaN is None)."""
        return _json(asdict(self))


@dataclass(frozen=True)
class PairedDifference:
    """`policy − baseline` of one metric, paired by seed and problem, with its interval, p-value and BH q-value.

    Example:
    ```python
    >>> from hf_rockopd.ablate.stats import PairedDifference
    >>> PairedDifference("rock_freeze", "uniform", "correct", (0, 1), 4, 0.0, 0.0, 0.0, 1.0, 1.0).to_dict()["seeds"]
    [0, 1]
    ```
    """

    policy: str
    baseline: str
    metric: str
    seeds: tuple[int, ...]
    num_problems: int
    delta: float
    ci_low: float
    ci_high: float
    p_value: float
    q_value: float = float("nan")

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict (NaN is None)."""
        return _json(asdict(self))


@dataclass(frozen=True)
class AblationStats:
    """Every summary and paired difference of one ablation, and how they were computed.

    Example:
    ```python
    >>> import json
    >>> from hf_rockopd.ablate.stats import RunOutcomes, ablation_stats
    >>> runs = [RunOutcomes(p, 0, {"correct": [1, 0, 1]}) for p in ("uniform", "rock_online")]
    >>> result = ablation_stats(runs, n_resamples=100)
    >>> result.summary("rock_online", "correct").ci_low  # one seed: the interval over seeds is undefined
    nan
    >>> sorted(json.loads(json.dumps(result.to_dict(), allow_nan=False)))
    ['baseline', 'confidence', 'differences', 'method', 'metrics', 'n_resamples', 'policies', 'seed', 'summaries']
    ```
    """

    baseline: str
    policies: tuple[str, ...]
    metrics: tuple[str, ...]
    summaries: tuple[PolicySummary, ...]
    differences: tuple[PairedDifference, ...]
    confidence: float
    n_resamples: int
    seed: int
    method: str = field(
        default="difference: crossed bootstrap over seeds and problems (percentile interval, two-sided p), guarded by "
        "a t-test over per-seed mean differences (larger p, hull of the intervals); q: Benjamini-Hochberg over "
        "policies x metrics; mean: t-interval over seed means"
    )

    def summary(self, policy: str, metric: str) -> PolicySummary:
        """The summary of one policy and metric (`KeyError` if absent)."""
        for item in self.summaries:
            if (item.policy, item.metric) == (policy, metric):
                return item
        raise KeyError(f"No summary for policy {policy!r} and metric {metric!r}.")

    def difference(self, policy: str, metric: str) -> PairedDifference:
        """The paired difference of one policy and metric against the baseline (`KeyError` if absent)."""
        for item in self.differences:
            if (item.policy, item.metric) == (policy, metric):
                return item
        raise KeyError(f"No paired difference for policy {policy!r} and metric {metric!r}.")

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict (NaN is None)."""
        data = {k: _json(v) for k, v in asdict(self).items() if k not in ("summaries", "differences")}
        data["summaries"] = [s.to_dict() for s in self.summaries]
        data["differences"] = [d.to_dict() for d in self.differences]
        return data


def seed_interval(seed_means: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """`(mean, low, high)`: the mean of per-seed values and its Student-t interval (`scipy.stats.t`).

    With one seed the interval is undefined (NaN), not zero: a single run says nothing about run-to-run noise.

    Example:
    ```python
    >>> from hf_rockopd.ablate.stats import seed_interval
    >>> [round(x, 3) for x in seed_interval([0.4, 0.5, 0.6])]
    [0.5, 0.252, 0.748]
    >>> seed_interval([0.5])
    (0.5, nan, nan)
    ```
    """
    values = np.asarray(seed_means, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"seed_interval needs a non-empty 1-D list of per-seed values, got shape {values.shape}.")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}.")
    mean = float(values.mean())
    if values.size == 1:
        return mean, float("nan"), float("nan")
    half = stats.t.ppf(0.5 + confidence / 2, df=values.size - 1) * values.std(ddof=1) / math.sqrt(values.size)
    return mean, mean - float(half), mean + float(half)


def _resample_counts(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """`(size, n)` counts of a bootstrap resample of `n` items (how often each was drawn), one row per resample."""
    draws = rng.integers(0, n, size=(size, n)) + n * np.arange(size)[:, None]
    return np.bincount(draws.ravel(), minlength=size * n).reshape(size, n).astype(np.float64)


def crossed_bootstrap(
    baseline: Any, treated: Any, n_resamples: int = 10_000, seed: int | Sequence[int] = 0, confidence: float = 0.95
) -> dict[str, float]:
    """Paired difference `treated − baseline` of `(seeds, problems)` outcomes, resampling seeds and problems.

    Each resample draws seeds and problems with replacement, independently (the two factors are crossed: the same
    problems are scored under every seed), and takes the mean difference over the drawn cells. The interval is the
    percentile interval; the two-sided p-value is twice the smaller share of resampled means at or beyond 0, counted
    as `(k + 1) / (n_resamples + 1)` so that it is never exactly 0, capped at 1. See the comment above for why this
    test. With one seed only problems are resampled: the interval then ignores run-to-run noise.

    Returns:
        `delta`, `ci_low`, `ci_high`, `p_value`.

    Example:
    ```python
    >>> from hf_rockopd.ablate.stats import crossed_bootstrap
    >>> uniform = [[0, 1, 0, 0, 1, 0], [0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 1]]  # 3 seeds x 6 problems, correct
    >>> policy = [[1, 1, 1, 0, 1, 1], [1, 0, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1]]
    >>> result = crossed_bootstrap(uniform, policy, n_resamples=2000)
    >>> round(result["delta"], 3), result["ci_low"] > 0, result["p_value"] < 0.05
    (0.556, True, True)
    ```
    """
    # One run per side (a 1-D list of problems) is one seed.
    a, b = np.atleast_2d(np.asarray(baseline, np.float64)), np.atleast_2d(np.asarray(treated, np.float64))
    if a.shape != b.shape or a.ndim != 2 or a.size == 0:
        raise ValueError(f"baseline and treated must be equal (seeds, problems) arrays, got {a.shape} and {b.shape}.")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}.")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}.")
    diff = b - a
    num_seeds, num_problems = diff.shape
    rng = np.random.default_rng(seed)
    means = np.empty(n_resamples)
    # A resample's mean is (seed counts) @ diff @ (problem counts) / (S · P); chunks keep the (chunk, P) matrices small.
    chunk = max(1, min(n_resamples, 2_000_000 // max(num_problems, num_seeds)))
    for lo in range(0, n_resamples, chunk):
        size = min(chunk, n_resamples - lo)
        seed_counts = _resample_counts(rng, num_seeds, size)
        problem_counts = _resample_counts(rng, num_problems, size)
        means[lo : lo + size] = ((seed_counts @ diff) * problem_counts).sum(axis=1) / diff.size
    at_or_below, at_or_above = np.sum(means <= 0), np.sum(means >= 0)
    p_value = min(1.0, 2 * (min(at_or_below, at_or_above) + 1) / (n_resamples + 1))
    low, high = np.quantile(means, [0.5 - confidence / 2, 0.5 + confidence / 2])
    return {"delta": float(diff.mean()), "ci_low": float(low), "ci_high": float(high), "p_value": float(p_value)}


def paired_difference(
    baseline: Any, treated: Any, n_resamples: int = 10_000, seed: int | Sequence[int] = 0, confidence: float = 0.95
) -> dict[str, float]:
    """The ablation's test: `crossed_bootstrap`, guarded by a t-test over seeds (see the comment above).

    With two or more seeds, the per-seed mean differences also get a one-sample t-test and t-interval
    (`scipy.stats.t`, S − 1 degrees of freedom); the result keeps the larger p-value and the hull of the two intervals.
    With one seed it is the bootstrap over problems alone.

    Example:
    ```python
    >>> from hf_rockopd.ablate.stats import paired_difference
    >>> flips = paired_difference([[0, 0, 0, 0]] * 3, [[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], n_resamples=2000)
    >>> round(flips["delta"], 3), flips["ci_low"] < 0, flips["p_value"] > 0.1  # seed 2 gains nothing: no finding
    (0.667, True, True)
    ```
    """
    result = crossed_bootstrap(baseline, treated, n_resamples=n_resamples, seed=seed, confidence=confidence)
    diff = np.atleast_2d(np.asarray(treated, np.float64)) - np.atleast_2d(np.asarray(baseline, np.float64))
    seed_diffs = diff.mean(axis=1)
    if seed_diffs.size < 2:
        return result
    mean, low, high = seed_interval(seed_diffs, confidence)
    spread = seed_diffs.std(ddof=1)
    if spread > 0:
        t_stat = mean / (spread / math.sqrt(seed_diffs.size))
        p_seeds = float(2 * stats.t.sf(abs(t_stat), df=seed_diffs.size - 1))
    else:  # every seed gains exactly the same: the seeds add no doubt
        p_seeds = 0.0 if mean != 0 else 1.0
    return {
        "delta": result["delta"],
        "ci_low": min(result["ci_low"], low),
        "ci_high": max(result["ci_high"], high),
        "p_value": max(result["p_value"], p_seeds),
    }


def _stream_seed(seed: int, *names: str) -> list[int]:
    """A random stream per (policy, metric), stable across processes (unlike `hash`), so that one result does not
    change when another policy or metric is added to the ablation."""
    return [seed, *(zlib.crc32(name.encode()) for name in names)]


def ablation_stats(
    runs: Sequence[RunOutcomes],
    baseline: str = BASELINE_POLICY,
    metrics: Sequence[str] | None = None,
    confidence: float = 0.95,
    n_resamples: int = 10_000,
    seed: int = 0,
) -> AblationStats:
    """Per-policy summaries over seeds and paired differences against `baseline`, with BH q-values.

    Args:
        runs: one `RunOutcomes` per (policy, seed), all on the same problems in the same order.
        baseline: the policy every other one is compared with (`"uniform"`: plain OPD).
        metrics: the metrics to analyse; default: those every run has.
        confidence: of every interval.
        n_resamples: bootstrap resamples per paired difference.
        seed: of the bootstrap; each (policy, metric) has its own stream derived from it.

    A policy is paired with the baseline on the seeds both have; with none in common its difference is NaN.

    Example:
    ```python
    >>> from hf_rockopd.ablate.stats import RunOutcomes, ablation_stats
    >>> runs = [RunOutcomes("uniform", s, {"divergence": [0.5, 0.7, 0.6]}) for s in (0, 1, 2)]
    >>> runs += [RunOutcomes("rock_freeze", s, {"divergence": [0.4, 0.6, 0.5]}) for s in (0, 1, 2)]
    >>> d = ablation_stats(runs, n_resamples=1000).difference("rock_freeze", "divergence")
    >>> round(d.delta, 6), round(d.ci_low, 6), round(d.ci_high, 6), d.p_value < 0.01
    (-0.1, -0.1, -0.1, True)
    ```
    """
    if not runs:
        raise ValueError("ablation_stats got no run.")
    grid: dict[str, dict[int, RunOutcomes]] = {}
    for run in runs:
        if run.seed in grid.setdefault(run.policy, {}):
            raise ValueError(f"Two runs of policy {run.policy!r} with seed {run.seed}.")
        grid[run.policy][run.seed] = run
    if baseline not in grid:
        raise ValueError(f"No run of the baseline policy {baseline!r}; policies: {sorted(grid)}.")
    common = set.intersection(*(set(run.metrics) for run in runs))
    names = tuple(metrics) if metrics is not None else tuple(sorted(common))
    if set(names) - common:
        raise ValueError(f"Metrics {sorted(set(names) - common)} are not in every run; all have {sorted(common)}.")
    if not names:
        raise ValueError("ablation_stats has no metric to analyse: the runs share none, or none was asked for.")
    for name in names:
        sizes = {run.metrics[name].size for run in runs}
        if len(sizes) > 1:
            raise ValueError(f"Metric {name!r} has different problem counts across runs: {sorted(sizes)}.")
    # The baseline first, then the others in the order their runs came: tables read in the order the user ran them.
    policies = (baseline, *(p for p in grid if p != baseline))
    summaries, differences = [], []
    for policy in policies:
        seeds = tuple(sorted(grid[policy]))
        for name in names:
            seed_means = tuple(float(grid[policy][s].metrics[name].mean()) for s in seeds)
            mean, low, high = seed_interval(seed_means, confidence)
            summaries.append(PolicySummary(policy, name, seeds, mean, low, high, seed_means))
            if policy == baseline:
                continue
            paired = tuple(sorted(set(grid[policy]) & set(grid[baseline])))
            if paired:
                result = paired_difference(
                    [grid[baseline][s].metrics[name] for s in paired],
                    [grid[policy][s].metrics[name] for s in paired],
                    n_resamples=n_resamples,
                    seed=_stream_seed(seed, policy, name),
                    confidence=confidence,
                )
            else:
                result = dict.fromkeys(("delta", "ci_low", "ci_high", "p_value"), float("nan"))
            num_problems = grid[policy][seeds[0]].metrics[name].size
            differences.append(PairedDifference(policy, baseline, name, paired, num_problems, **result))
    # Benjamini-Hochberg over every test of the ablation (policies x metrics); untestable ones keep a NaN q.
    p_values = np.array([d.p_value for d in differences])
    tested = np.flatnonzero(np.isfinite(p_values))
    q_values = np.full(p_values.shape, np.nan)
    if tested.size:
        q_values[tested] = stats.false_discovery_control(p_values[tested], method="bh")
    differences = [PairedDifference(**{**asdict(d), "q_value": float(q)}) for d, q in zip(differences, q_values)]
    return AblationStats(
        baseline=baseline,
        policies=policies,
        metrics=names,
        summaries=tuple(summaries),
        differences=tuple(differences),
        confidence=confidence,
        n_resamples=n_resamples,
        seed=seed,
    )


def _number(value: float, digits: int) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def _p(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2g}" if value < 0.01 else f"{value:.3f}"


def ablation_table(result: AblationStats, digits: int = 3) -> str:
    """The ablation as Markdown: per-policy means over seeds, then paired differences against the baseline.

    Example:
    ```python
    >>> from hf_rockopd.ablate.stats import RunOutcomes, ablation_stats, ablation_table
    >>> runs = [RunOutcomes(p, s, {"correct": [1, 0, 1, 1]}) for p in ("uniform", "rock_freeze") for s in (0, 1)]
    >>> print(ablation_table(ablation_stats(runs, n_resamples=100)))  # doctest: +NORMALIZE_WHITESPACE
    | policy | seeds | correct |
    | --- | --- | --- |
    | uniform | 2 | 0.750 [0.750, 0.750] |
    | rock_freeze | 2 | 0.750 [0.750, 0.750] |
    <BLANKLINE>
    | policy | metric | Δ vs uniform | 95 % interval | p | q | seeds × problems |
    | --- | --- | --- | --- | --- | --- | --- |
    | rock_freeze | correct | +0.000 | [+0.000, +0.000] | 1.000 | 1.000 | 2 × 4 |
    ```
    """
    level = f"{result.confidence:.0%}".replace("%", " %")
    lines = ["| policy | seeds | " + " | ".join(result.metrics) + " |", "| --- " * (2 + len(result.metrics)) + "|"]
    for policy in result.policies:
        cells = []
        for name in result.metrics:
            s = result.summary(policy, name)
            interval = (
                f" [{_number(s.ci_low, digits)}, {_number(s.ci_high, digits)}]" if len(s.seeds) > 1 else " (1 seed)"
            )
            cells.append(_number(s.mean, digits) + interval)
        lines.append(
            f"| {policy} | {len(result.summary(policy, result.metrics[0]).seeds)} | " + " | ".join(cells) + " |"
        )
    lines += ["", f"| policy | metric | Δ vs {result.baseline} | {level} interval | p | q | seeds × problems |"]
    lines.append("| --- " * 7 + "|")
    for d in result.differences:
        interval = "n/a" if math.isnan(d.delta) else f"[{d.ci_low:+.{digits}f}, {d.ci_high:+.{digits}f}]"
        delta = "n/a" if math.isnan(d.delta) else f"{d.delta:+.{digits}f}"
        lines.append(
            f"| {d.policy} | {d.metric} | {delta} | {interval} | {_p(d.p_value)} | {_p(d.q_value)} | "
            f"{len(d.seeds)} × {d.num_problems} |"
        )
    if any(len(d.seeds) == 1 for d in result.differences):
        lines += ["", "With 1 seed, the interval and p cover the problems only, not the run-to-run noise of training."]
    return "\n".join(lines)
