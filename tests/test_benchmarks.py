"""The loss-path benchmark's implementations compute the same loss, and its agreement check catches a wrong one."""

import json
import os
import sys

import pytest
import torch


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.loss_path import AgreementError, LossCase, check_agreement, make_inputs, ratios, run_once  # noqa: E402


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("frozen", [0.0, 0.5])
def test_anchors_agree_with_ours(beta, frozen):
    case = LossCase(hidden=16, vocab=64, batch=2, length=24, beta=beta, frozen=frozen, chunk_size=7)
    inputs = make_inputs(case)
    assert 0 < int((inputs["weights"] == 0).sum()) < case.rows if frozen else bool((inputs["weights"] == 1).all())
    ours = {k: v.clone() for k, v in run_once("rockopd", inputs, case).items()}
    assert float(ours["loss"]) > 0
    for anchor in ("gkd", "distillation"):
        diffs = check_agreement(run_once(anchor, inputs, case), ours, anchor)
        assert max(diffs.values()) <= 1e-5


def test_agreement_check_catches_a_wrong_loss_and_gradient():
    case = LossCase(hidden=16, vocab=64, batch=2, length=8, beta=1.0, frozen=0.0)
    inputs = make_inputs(case)
    ours = {k: v.clone() for k, v in run_once("rockopd", inputs, case).items()}
    gkd = {k: v.clone() for k, v in run_once("gkd", inputs, case).items()}
    with pytest.raises(AgreementError, match="loss_rel"):
        check_agreement({**gkd, "loss": gkd["loss"] * (1 + 1e-4)}, ours, "gkd")
    with pytest.raises(AgreementError, match="grad_w_rel"):
        check_agreement({**gkd, "grad_w": gkd["grad_w"] * 1.01}, ours, "gkd")
    # A loss of another beta is a different number, not a rounding difference.
    other = make_inputs(case)
    wrong = run_once("gkd", other, LossCase(**{**case.__dict__, "beta": 0.0}))
    with pytest.raises(AgreementError):
        check_agreement(wrong, ours, "gkd")


def test_ratios_are_ours_over_each_anchor():
    record = {
        "median_s": {"rockopd": 1.0, "gkd": 4.0, "distillation": 2.0, "rockopd_uniform": 2.0},
        "peak_bytes": {"rockopd": 10, "gkd": 100},
    }
    assert ratios(record) == {
        "time_vs_gkd": 0.25,
        "mem_vs_gkd": 0.1,
        "time_vs_distillation": 0.5,
        "time_vs_own_uniform": 0.5,
    }


def test_case_rejects_bad_values():
    with pytest.raises(ValueError, match="frozen"):
        LossCase(hidden=8, vocab=16, batch=1, length=4, beta=1.0, frozen=1.0)
    with pytest.raises(ValueError, match="beta"):
        LossCase(hidden=8, vocab=16, batch=1, length=4, beta=1.5, frozen=0.0)
    assert torch.equal(make_inputs(LossCase(8, 16, 1, 4, 1.0, 0.0))["h_t"], make_inputs(LossCase(8, 16, 1, 4, 1.0, 0.0))["h_t"])


def test_scaling_fits_time_and_memory_on_the_length_sweep_only(tmp_path):
    from benchmarks import scaling

    def record(hidden, vocab, length, beta=1.0, frozen=0.0):
        blv = 4 * length * vocab
        return {
            "case": {"hidden": hidden, "vocab": vocab, "batch": 4, "length": length, "beta": beta, "frozen": frozen},
            "status": {"rockopd": "ok", "gkd": "ok" if length < 1024 else "OOM"},
            "peak_bytes": {"rockopd": 1e8, **({"gkd": 10 * blv} if length < 1024 else {})},
            "median_s": {"rockopd": 1e-8 * blv, **({"gkd": 2e-8 * blv} if length < 1024 else {})},
        }

    records = [record(576, 49152, n) for n in (256, 512, 1024)]
    records += [record(576, 49152, 256, beta=0.5), record(576, 49152, 256, frozen=0.5), record(2048, 151936, 256)]
    memory, time = scaling.fit_growth(records, "memory"), scaling.fit_growth(records, "time")
    assert memory["rockopd"]["exponent"] == pytest.approx(0.0, abs=1e-9)
    assert memory["gkd"]["exponent"] == pytest.approx(1.0)
    assert time["rockopd"]["exponent"] == pytest.approx(1.0)
    # Only the H=576 uniform beta 0/1 points: the mixture, frozen and other-head records are not in the fit.
    assert [p["length"] for p in time["rockopd"]["points"]] == [256, 512, 1024]
    assert len(time["gkd"]["points"]) == 2
    with pytest.raises(ValueError, match="quantity must be one of"):
        scaling.fit_growth(records, "flops")
    path = tmp_path / "lp.json"
    path.write_text(json.dumps({"meta": {"budget_gib": 12.0}, "records": records}))
    assert scaling.main([str(path), "--plot", str(tmp_path / "s.png"), "--out", str(tmp_path / "s.json")]) == 0
    assert (tmp_path / "s.png").stat().st_size > 10_000
    assert set(json.loads((tmp_path / "s.json").read_text())) == {"memory", "time"}
