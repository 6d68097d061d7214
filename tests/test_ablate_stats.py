"""Paired statistics of the ablation on crafted numbers: no difference, a constant shift, seed noise, one seed."""

import json
import math

import numpy as np
import pytest
from scipy import stats

from hf_rockopd.ablate.stats import (
    AblationStats,
    RunOutcomes,
    ablation_stats,
    ablation_table,
    crossed_bootstrap,
    paired_difference,
    seed_interval,
)


def _runs(policy, per_seed, metric="correct"):
    return [RunOutcomes(policy, seed, {metric: values}) for seed, values in enumerate(per_seed)]


def _noisy(rng, seeds=3, problems=40):
    return [rng.integers(0, 2, problems).astype(float) for _ in range(seeds)]


# ------------------------------------------------------------------------------------------ crossed bootstrap ----
def test_identical_runs_differ_by_nothing():
    rng = np.random.default_rng(0)
    uniform = _noisy(rng)
    result = ablation_stats(_runs("uniform", uniform) + _runs("rock_freeze", uniform), n_resamples=500)
    d = result.difference("rock_freeze", "correct")
    assert (d.delta, d.ci_low, d.ci_high) == (0.0, 0.0, 0.0)
    assert d.p_value == 1.0 and d.q_value == 1.0
    assert d.seeds == (0, 1, 2) and d.num_problems == 40


@pytest.mark.parametrize("shift", [0.25, -0.1])
def test_a_constant_shift_is_found_with_a_small_p(shift):
    rng = np.random.default_rng(1)
    uniform = [rng.normal(0.6, 0.2, 30) for _ in range(3)]
    treated = [u + shift for u in uniform]
    result = ablation_stats(
        _runs("uniform", uniform, "divergence") + _runs("soft", treated, "divergence"), n_resamples=999
    )
    d = result.difference("soft", "divergence")
    assert d.delta == pytest.approx(shift)
    assert d.ci_low - 1e-12 <= shift <= d.ci_high + 1e-12
    assert d.p_value == pytest.approx(2 / 1000)  # no resample on the other side of 0: the smallest p it can give


def test_a_noisy_shift_is_inside_its_interval():
    rng = np.random.default_rng(2)
    uniform = [rng.normal(0.0, 1.0, 200) for _ in range(4)]
    treated = [u + 0.5 + rng.normal(0.0, 0.3, 200) + rng.normal(0.0, 0.05) for u in uniform]
    result = crossed_bootstrap(uniform, treated, n_resamples=2000, seed=3)
    assert result["ci_low"] < 0.5 < result["ci_high"]
    assert result["ci_high"] - result["ci_low"] < 0.3
    assert result["p_value"] < 0.01


def test_seed_noise_widens_the_interval():
    """The reason for resampling seeds: a difference that flips sign from run to run is no finding, however many
    problems agree within each run (a bootstrap over problems alone would call it certain)."""
    uniform = [np.zeros(100)] * 3
    treated = [np.full(100, 0.5), np.full(100, -0.5), np.full(100, 0.5)]
    crossed = crossed_bootstrap(uniform, treated, n_resamples=2000)
    assert crossed["delta"] == pytest.approx(1 / 6)
    assert crossed["ci_low"] < 0 < crossed["ci_high"] and crossed["p_value"] > 0.2
    problems_only = crossed_bootstrap(np.concatenate(uniform), np.concatenate(treated), n_resamples=2000)
    assert problems_only["ci_low"] > 0  # the anticonservative answer the crossed bootstrap avoids


def test_the_seed_guard_stops_what_three_agreeing_seeds_cannot_show():
    """Three seeds that all gain, by very different amounts: every seed resample has a positive mean, so the bootstrap
    alone calls it certain; the t-test over the three seed differences knows how little three runs say."""
    uniform = [np.zeros(50)] * 3
    treated = [np.full(50, 0.4), np.full(50, 0.05), np.full(50, 0.3)]
    alone = crossed_bootstrap(uniform, treated, n_resamples=999)
    guarded = paired_difference(uniform, treated, n_resamples=999)
    assert alone["p_value"] < 0.01 and alone["ci_low"] > 0
    seed_t = stats.ttest_1samp([0.4, 0.05, 0.3], 0.0)
    assert guarded["p_value"] == pytest.approx(seed_t.pvalue) and guarded["p_value"] > 0.1
    assert guarded["ci_low"] < 0 < guarded["ci_high"] and guarded["delta"] == alone["delta"]
    # Agreeing seeds (a constant shift) and one seed leave the bootstrap's answer as it is.
    assert paired_difference(uniform, [np.full(50, 0.2)] * 3, n_resamples=999)["p_value"] == pytest.approx(2 / 1000)
    assert paired_difference(uniform[0], treated[0], n_resamples=99) == crossed_bootstrap(uniform[0], treated[0], 99)


def test_crossed_bootstrap_is_deterministic_and_checks_its_input():
    rng = np.random.default_rng(4)
    a, b = _noisy(rng), _noisy(rng)
    assert crossed_bootstrap(a, b, n_resamples=300, seed=7) == crossed_bootstrap(a, b, n_resamples=300, seed=7)
    assert crossed_bootstrap(a, b, n_resamples=300, seed=7) != crossed_bootstrap(a, b, n_resamples=300, seed=8)
    # One run per side (1-D) is one seed: only the problems are resampled.
    one_seed = crossed_bootstrap(a[0], b[0], n_resamples=300, seed=7)
    assert one_seed["delta"] == pytest.approx(float(np.mean(b[0] - a[0])))
    for bad, message in [(([[1, 2]], [[1, 2, 3]]), "equal"), (([[]], [[]]), "equal")]:
        with pytest.raises(ValueError, match=message):
            crossed_bootstrap(*bad)
    with pytest.raises(ValueError, match="n_resamples"):
        crossed_bootstrap(a, b, n_resamples=0)
    with pytest.raises(ValueError, match="confidence"):
        crossed_bootstrap(a, b, confidence=0)


# ------------------------------------------------------------------------------------------ seed intervals ----
def test_seed_interval_is_student_t():
    values = [0.41, 0.47, 0.52, 0.44]
    mean, low, high = seed_interval(values)
    expected = stats.t.interval(0.95, df=3, loc=np.mean(values), scale=stats.sem(values))
    assert mean == pytest.approx(np.mean(values)) and (low, high) == pytest.approx(expected)
    assert seed_interval([0.5, 0.5]) == (0.5, 0.5, 0.5)
    narrower = seed_interval(values, confidence=0.8)
    assert low < narrower[1] < narrower[2] < high


def test_one_seed_has_no_interval_over_seeds():
    mean, low, high = seed_interval([0.3])
    assert mean == 0.3 and math.isnan(low) and math.isnan(high)
    runs = _runs("uniform", [[1, 0, 1, 1]]) + _runs("rock_online", [[1, 1, 1, 1]])
    result = ablation_stats(runs, n_resamples=200)
    summary = result.summary("rock_online", "correct")
    assert summary.seeds == (0,) and summary.mean == 1.0 and math.isnan(summary.ci_low) and math.isnan(summary.ci_high)
    assert summary.to_dict()["ci_low"] is None  # undefined, not zero, in JSON too
    assert result.difference("rock_online", "correct").delta == 0.25  # still paired over the problems
    table = ablation_table(result)
    assert "1.000 (1 seed)" in table and "cover the problems only" in table
    with pytest.raises(ValueError, match="non-empty"):
        seed_interval([])


# -------------------------------------------------------------------------------------------- the ablation ----
def _ablation(n_resamples=300, seed=0, policies=("rock_freeze", "random_matched")):
    rng = np.random.default_rng(5)
    runs = []
    for policy in ("uniform", *policies):
        for s in range(3):
            metrics = {"correct": rng.integers(0, 2, 50), "loop": rng.integers(0, 2, 50), "tf": rng.normal(0, 1, 50)}
            runs.append(RunOutcomes(policy, s, metrics))
    return ablation_stats(runs, n_resamples=n_resamples, seed=seed), runs


def test_ablation_covers_every_policy_and_metric_with_bh_q_values():
    result, runs = _ablation()
    assert result.policies == ("uniform", "rock_freeze", "random_matched")
    assert result.metrics == ("correct", "loop", "tf")
    assert len(result.summaries) == 9 and len(result.differences) == 6
    assert {d.baseline for d in result.differences} == {"uniform"}
    p_values = [d.p_value for d in result.differences]
    assert [d.q_value for d in result.differences] == pytest.approx(stats.false_discovery_control(p_values))
    assert all(d.q_value >= d.p_value for d in result.differences)
    uniform_means = [float(np.mean(r.metrics["tf"])) for r in runs if r.policy == "uniform"]
    assert result.summary("uniform", "tf").seed_means == pytest.approx(uniform_means)
    with pytest.raises(KeyError):
        result.summary("uniform", "missing")
    with pytest.raises(KeyError):
        result.difference("uniform", "correct")  # the baseline is not compared with itself


def test_ablation_is_deterministic_and_each_result_has_its_own_stream():
    first, _ = _ablation(seed=11)
    assert first == _ablation(seed=11)[0]
    assert first.differences != _ablation(seed=12)[0].differences
    # Adding a policy leaves the others' intervals and p-values as they were (q-values do change: more tests).
    more, _ = _ablation(seed=11, policies=("rock_freeze", "random_matched", "rock_online"))
    for d in first.differences:
        other = more.difference(d.policy, d.metric)
        assert (other.ci_low, other.ci_high, other.p_value) == (d.ci_low, d.ci_high, d.p_value)


def test_ablation_pairs_on_common_seeds_only():
    runs = _runs("uniform", [[1, 0], [0, 0]]) + [RunOutcomes("rock_freeze", 1, {"correct": [1, 1]})]
    runs += [RunOutcomes("late", 7, {"correct": [1, 1]})]
    result = ablation_stats(runs, n_resamples=100)
    assert result.difference("rock_freeze", "correct").seeds == (1,)
    assert result.difference("rock_freeze", "correct").delta == 1.0
    late = result.difference("late", "correct")
    assert late.seeds == () and math.isnan(late.delta) and math.isnan(late.q_value)
    assert "| late | correct | n/a | n/a | n/a | n/a | 0 × 2 |" in ablation_table(result)


def test_ablation_refuses_inconsistent_runs():
    good = _runs("uniform", [[1, 0, 1]])
    cases = [
        (good + good, "Two runs of policy 'uniform' with seed 0"),
        (_runs("rock_freeze", [[1, 0, 1]]), "No run of the baseline"),
        (good + _runs("soft", [[1, 0]]), "different problem counts"),
        (good + [RunOutcomes("soft", 0, {"loop": [0, 0, 0]})], "has no metric"),
        ([], "no run"),
    ]
    for runs, message in cases:
        with pytest.raises(ValueError, match=message):
            ablation_stats(runs)
    with pytest.raises(ValueError, match="not in every run"):
        ablation_stats(good, metrics=["divergence"])
    with pytest.raises(ValueError, match="finite"):
        RunOutcomes("uniform", 0, {"tf": [0.1, float("nan")]})
    with pytest.raises(ValueError, match="non-empty"):
        RunOutcomes("uniform", 0, {"tf": []})


def test_everything_is_json_and_the_table_has_every_row():
    result, runs = _ablation()
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert data["baseline"] == "uniform" and len(data["differences"]) == 6
    assert "crossed bootstrap" in data["method"]
    assert RunOutcomes.from_dict(json.loads(json.dumps(runs[0].to_dict()))).to_dict() == runs[0].to_dict()
    table = ablation_table(result)
    assert table.count("\n| rock_freeze | ") == 4 and "| policy | seeds | correct | loop | tf |" in table
    assert "Δ vs uniform" in table and "95 % interval" in table
    assert isinstance(result, AblationStats)
