"""The paired verdict of a distillation: exact McNemar against scipy's binomial test by hand, result.json's shape."""

import math

import pytest
from scipy import stats

from hf_rockopd.evaluation.paired import correct_flags, distillation_verdict, mcnemar_exact


def test_mcnemar_exact_counts_only_discordant_problems():
    first = [True] * 30 + [False] * 60 + [True] * 7 + [False] * 3
    second = [True] * 30 + [False] * 60 + [False] * 7 + [True] * 3
    test = mcnemar_exact(first, second)
    assert (test.only_first, test.only_second, test.num_problems) == (7, 3, 100)
    # Two-sided exact binomial on the 10 discordant problems: 2 * P(X <= 3 | n=10, p=1/2).
    expected = 2 * sum(math.comb(10, k) for k in range(4)) / 2**10
    assert test.p_value == pytest.approx(expected)
    assert test.p_value == pytest.approx(stats.binomtest(7, 10, 0.5).pvalue)
    # Symmetric in its two sides; identical flags give p = 1.
    assert mcnemar_exact(second, first).p_value == pytest.approx(test.p_value)
    assert mcnemar_exact(first, first).p_value == 1.0


def test_mcnemar_refuses_unpaired_input():
    with pytest.raises(ValueError, match="same problems"):
        mcnemar_exact([True, False], [True])
    with pytest.raises(ValueError, match="at least one"):
        mcnemar_exact([], [])


def _evaluation(flags, gold=None, **extra):
    gold = gold or [str(i) for i in range(len(flags))]
    return {"accuracy": sum(flags) / len(flags), "cut_ratio": 0.1, "loop_rate": 0.0,
            "teacher_forced_divergence": 0.2, "teacher_accuracy": 0.8, "teacher_accuracy_low": 0.7,
            "teacher_accuracy_high": 0.9, "records": [{"gold": g, "correct": f} for g, f in zip(gold, flags)], **extra}


def test_verdict_has_result_json_shape_and_paired_values():
    before = _evaluation([False] * 20 + [True] * 5)
    uniform = _evaluation([True] * 12 + [False] * 8 + [True] * 5, teacher_forced_divergence=0.15)
    rocks = _evaluation([True] * 4 + [False] * 16 + [True] * 5)
    result, details = distillation_verdict(before, {"uniform": uniform, "rock_online": rocks},
                                           teacher="T", student="S", steps=200)
    assert set(result) == {"pair", "steps", "num_eval_problems", "teacher_accuracy", "runs",
                           "p_value_rocks_vs_uniform"}
    assert result["pair"] == {"teacher": "T", "student": "S"}
    assert result["num_eval_problems"] == 25 and result["steps"] == 200
    row = result["runs"]["uniform"]
    assert set(row) == {"accuracy_before", "accuracy_after", "p_value_vs_before", "cut_after", "loops_after",
                        "tf_divergence_before", "tf_divergence_after"}
    assert row["accuracy_before"] == 0.2 and row["accuracy_after"] == 17 / 25
    assert row["p_value_vs_before"] == pytest.approx(stats.binomtest(12, 12, 0.5).pvalue)
    assert row["tf_divergence_before"] == 0.2 and row["tf_divergence_after"] == 0.15
    assert result["p_value_rocks_vs_uniform"] == pytest.approx(stats.binomtest(0, 8, 0.5).pvalue)
    # Gap closed: (0.68 - 0.2) / (0.8 - 0.2).
    assert details["runs"]["uniform"]["gap_closed"] == pytest.approx(0.8)
    assert details["runs"]["uniform"]["after"]["low"] < 0.68 < details["runs"]["uniform"]["after"]["high"]


def test_verdict_refuses_other_problems_and_missing_records():
    before = _evaluation([True, False, True])
    with pytest.raises(ValueError, match="other problems"):
        distillation_verdict(before, {"uniform": _evaluation([True, False, True], gold=["a", "b", "c"])},
                             teacher="T", student="S", steps=1)
    with pytest.raises(ValueError, match="no per-problem records"):
        correct_flags({"accuracy": 0.5})
