"""The loss-path benchmark's implementations compute the same loss, and its agreement check catches a wrong one."""

import json
import math
import os
import sys

import pytest
import torch


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.loss_path import (  # noqa: E402
    DIVERGENCE_PATH,
    AgreementError,
    LossCase,
    _parse_case,
    check_agreement,
    make_inputs,
    ratios,
    run_case,
    run_once,
)


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


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_divergence_path_agrees_with_the_fused_loss(beta):
    case = LossCase(hidden=16, vocab=64, batch=2, length=24, beta=beta, frozen=0.5, chunk_size=5)
    inputs = make_inputs(case)
    fused = {k: v.clone() for k, v in run_once("rockopd", inputs, case).items()}
    diffs = check_agreement(run_once(DIVERGENCE_PATH, inputs, case), fused, DIVERGENCE_PATH)
    assert max(diffs.values()) <= 1e-5
    # Frozen rows carry no gradient on either path.
    frozen_rows = (inputs["weights"] == 0).reshape(-1)
    assert float(fused["grad_h"][frozen_rows].abs().max()) == 0.0


def test_run_case_times_the_divergence_path_on_request():
    from benchmarks.tables import loss_path_table

    case = LossCase(hidden=16, vocab=64, batch=2, length=8, beta=1.0, frozen=0.0, chunk_size=4)
    record = run_case(case, repeats=1, divergence_path=True)
    assert record["status"][DIVERGENCE_PATH] == "ok"
    assert set(record["agreement"]) == {"gkd", "distillation", DIVERGENCE_PATH}
    assert max(record["agreement"][DIVERGENCE_PATH].values()) <= 1e-5
    record["ratios"] = ratios(record)
    assert record["ratios"]["divergence_path_vs_fused_time"] == pytest.approx(
        record["median_s"][DIVERGENCE_PATH] / record["median_s"]["rockopd"]
    )
    table = loss_path_table([record]).splitlines()
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    row = [cell.strip() for cell in table[2].strip("|").split("|")]
    assert len(header) == len(row) and "chunk" in header and "ours div. path s" in header
    assert row[header.index("chunk")] == "4"
    assert float(row[header.index("time div. path/ours")]) == pytest.approx(
        record["ratios"]["divergence_path_vs_fused_time"], abs=0.006
    )


def test_a_timing_run_out_of_memory_is_retried_without_gkd(monkeypatch):
    from benchmarks import loss_path
    from benchmarks.tables import loss_path_table

    calls = []

    def fake_spawn(mode, payload, timeout):
        calls.append((mode, payload.get("impls", payload.get("impl"))))
        if mode == "memory":
            return {"status": "ok", "peak_bytes": 2**30, "baseline_bytes": 0}
        if "gkd" in payload["impls"]:
            return {"status": "OOM", "reason": "worker died (rc 1): can't allocate memory"}
        times = {impl: [1.0] for impl in payload["impls"]}
        return {"times": times, "agreement": {}, "referee": {}, "loss": 0.5}

    monkeypatch.setattr(loss_path, "_spawn", fake_spawn)
    record = loss_path.run_case(LossCase(16, 64, 2, 8, 1.0, 0.0), repeats=1)
    assert calls[-2:] == [("time", ["rockopd", "gkd", "distillation"]), ("time", ["rockopd", "distillation"])]
    assert record["time_status"] == {"gkd": "OOM"} and "can't allocate" in record["reason"]["gkd_time"]
    assert set(record["median_s"]) == {"rockopd", "distillation"}
    record["ratios"] = ratios(record)
    assert "time_vs_gkd" not in record["ratios"] and record["ratios"]["mem_vs_gkd"] == 1.0
    row = loss_path_table([record]).splitlines()[2].strip("|").split("|")
    assert row[6].strip() == "OOM"  # GKD's time; its memory (column 10) was measured
    assert row[10].strip() == "1.000"


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_float64_reference_matches_autograd_through_the_head(beta):
    from benchmarks.loss_path import reference_float64

    case = LossCase(hidden=8, vocab=50, batch=2, length=5, beta=beta, frozen=0.3)
    inputs = make_inputs(case)
    # Blocks of 16 over 50 vocabulary entries and chunks of 3 over 10 rows: ragged last block and chunk.
    exact = reference_float64(inputs, case, rows_per_chunk=3, vocab_block=16)
    h = inputs["h_s"].detach().double().requires_grad_(True)
    w = inputs["head_s"].weight.detach().double().requires_grad_(True)
    ls = torch.log_softmax(h @ w.T, -1)
    lt = torch.log_softmax(inputs["h_t"].double() @ inputs["head_t"].weight.double().T, -1)
    if beta == 0.0:
        div = (lt.exp() * (lt - ls)).sum(-1)
    elif beta == 1.0:
        div = (ls.exp() * (ls - lt)).sum(-1)
    else:
        lm = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), 0)
        div = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    loss = (div * inputs["weights"].reshape(-1).double()).sum() / case.rows
    loss.backward()
    assert float(exact["loss"]) == pytest.approx(float(loss), rel=1e-12)
    torch.testing.assert_close(exact["grad_h"], h.grad, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(exact["grad_w"], w.grad, rtol=1e-10, atol=1e-14)
    ours = run_once("rockopd", inputs, case)
    assert max(check_agreement(ours, exact, "rockopd").values()) <= 1e-5


def test_relative_difference_is_blockwise_exact(monkeypatch):
    from benchmarks import loss_path

    a, b = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    whole = float((a - b).norm() / b.norm())
    monkeypatch.setattr(loss_path, "_REL_BLOCK", 64)
    assert loss_path._rel(a.float(), b.float()) == pytest.approx(whole, rel=1e-6)
    assert loss_path._rel(b, b) == 0.0


def test_case_spec_parses_chunk_and_memory_only():
    case, timed = _parse_case("576,49152,4,256,0.5,0.2")
    assert (case.hidden, case.vocab, case.length, case.beta, case.frozen, case.chunk_size, timed) == (
        576, 49152, 256, 0.5, 0.2, 512, True
    )
    case, timed = _parse_case("2048,151936,4,256,1.0,0.0,256,memory")
    assert (case.chunk_size, timed) == (256, False)
    with pytest.raises(SystemExit, match="H,V,B,L,BETA,FROZEN"):
        _parse_case("576,49152,4,256")
    with pytest.raises(SystemExit, match="chunk_size must be >= 1, got 0"):
        _parse_case("576,49152,4,256,1.0,0.0,0")


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


@pytest.mark.parametrize("teacher_hidden", [24, 12])
def test_a_teacher_of_another_width_agrees_with_every_path_and_float64(teacher_hidden):
    """The GPU grid's Qwen3-8B-wide teacher over a Qwen3-1.7B-wide student, at toy sizes (wider and narrower)."""
    from benchmarks.loss_path import reference_float64, relative_differences

    case = LossCase(16, 64, 2, 8, 0.5, 0.5, chunk_size=3, teacher_hidden=teacher_hidden)
    inputs = make_inputs(case)
    assert inputs["h_t"].shape == (16, teacher_hidden) and inputs["head_t"].weight.shape == (64, teacher_hidden)
    ours = {k: v.clone() for k, v in run_once("rockopd", inputs, case).items()}
    for impl in ("gkd", "distillation"):
        assert max(relative_differences(run_once(impl, inputs, case), ours).values()) < 1e-5
    assert max(relative_differences(ours, reference_float64(inputs, case)).values()) < 1e-5


def test_gpu_benchmark_smoke_runs_every_part_and_records_agreement(tmp_path):
    """`benchmarks.gpu --smoke` on the CPU: the script a device session runs, at toy sizes, end to end."""
    import subprocess

    from benchmarks.tables import gpu_loss_table, gpu_step_table

    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--smoke", "--out", str(out), "--repeats", "1", "--steps", "2",
           "--max-new-tokens", "4", "--variants", "full,lora"]  # fmt: skip
    root = os.path.join(os.path.dirname(__file__), "..")
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failures"] == [] and result["meta"]["device"] == "cpu" and result["meta"]["variants"] == ["full", "lora"]
    assert len(result["loss_path"]) == 4
    for record in result["loss_path"]:
        assert set(record["agreement"]) == {"gkd", "distillation"}
        assert max(v for a in record["agreement"].values() for v in a.values()) < 1e-5
        # bf16: every implementation is compared with float64 on the same bf16 inputs; ours is not the worst.
        bf16 = {k: v["loss_rel"] for k, v in record["bf16_vs_float64"].items()}
        assert set(bf16) == {"rockopd", "gkd", "distillation"} and bf16["rockopd"] < 1e-2
        assert record["ratios"]["time_vs_gkd"] > 0 and record["peak_bytes"].keys() == record["median_s"].keys()
    assert "time_vs_own_uniform" in result["loss_path"][-1]["ratios"]
    steps = {(r["variant"], r["trainer"]): r for r in result["train_step"]}
    assert set(steps) == {(v, t) for v in ("full", "lora") for t in ("gkd", "rockopd")}
    assert steps[("lora", "rockopd")]["trainable_params"] < steps[("full", "rockopd")]["trainable_params"]
    for record in steps.values():
        assert record["median"]["completion_tokens"] == 16  # batch 4 x 4 new tokens, a random model never stops
        assert record["median"]["total_s"] >= record["median"]["generation_s"] > 0
    assert set(result["train_step_ratios"]) == {"full", "lora"}
    assert "| 16/24 | 256 | 8 | 1.0 | 0.5 |" in gpu_loss_table(result["loss_path"])
    assert gpu_step_table(result["train_step"]).count("| total step s |") == 2


def test_gpu_benchmark_refuses_a_full_run_without_cuda(capsys):
    from benchmarks import gpu

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit):
        gpu.main(["--device", "cpu"])
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("trainer_name", ["distillation", "rockdistillation", "rockdistillation_half", "rockopd_half"])
def test_train_step_times_the_distillation_pair_and_the_half_frozen_rows(tmp_path, trainer_name):
    from datasets import Dataset

    from benchmarks.train_step import train_steps
    from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer, prune_decoder_layers

    tokenizer = build_tiny_tokenizer()
    teacher = build_tiny_causal_lm(tokenizer, hidden_size=64, num_hidden_layers=4, seed=1)
    data = Dataset.from_list(
        [{"messages": [{"role": "user", "content": f"{i}+{i}?"}, {"role": "assistant", "content": "x"}]}
         for i in range(8)]
    )  # fmt: skip
    out = train_steps(trainer_name, prune_decoder_layers(teacher, keep=[0, 3]), teacher, tokenizer, data, steps=2,
                      batch=2, max_new_tokens=4, seed=0, output_dir=str(tmp_path))  # fmt: skip
    assert len(out["steps"]) == 2 and out["sampled_tensors_changed"] != "0/0"
    for step in out["steps"]:
        assert step["completion_tokens"] <= 8 and step["total_s"] >= step["generation_s"] > 0
        assert step["loss_forward_s"] > 0 and step["backward_s"] > 0
    if trainer_name.endswith("_half"):
        # Half of each batch's positions, rounded down (exactly 0.5 for an even count).
        assert 0.25 <= out["frozen_fraction"] <= 0.5
    elif trainer_name == "rockdistillation":
        assert out["frozen_fraction"] == 0.0


def test_half_frozen_policy_freezes_half_of_the_valid_positions_the_same_way_each_run():
    from benchmarks.half_frozen import HalfFrozenPolicy
    from hf_rockopd.policies import TokenBatch

    mask = torch.tensor([[True] * 7 + [False] * 3, [True] * 5 + [False] * 5])
    batch = TokenBatch(torch.zeros(2, 10, dtype=torch.long), mask, step=3)
    weights = HalfFrozenPolicy().weights(batch)
    assert int(((weights == 0) & mask).sum()) == 6 and (weights[~mask] == 0).all()
    assert set(weights[mask].tolist()) == {0.0, 1.0}
    assert torch.equal(weights, HalfFrozenPolicy().weights(batch))  # seeded by the step
    assert not torch.equal(weights, HalfFrozenPolicy().weights(TokenBatch(batch.token_ids, mask, step=4)))


def test_train_step_prints_and_writes_each_of_ours_over_its_anchor(tmp_path, monkeypatch, capsys):
    import subprocess

    from benchmarks import train_step

    totals = {"gkd": 2.0, "rockopd": 1.8, "rockopd_half": 1.2, "distillation": 2.0, "rockdistillation": 2.0,
              "rockdistillation_half": 1.0}  # fmt: skip

    def fake_worker(cmd, **kwargs):  # a worker process's last line, without training
        name = cmd[cmd.index("--worker") + 1]
        total = totals[name]
        step = {"generation_s": 1.0, "loss_forward_s": total / 4, "backward_s": total / 4,
                "loss_backward_s": total / 2, "optimizer_s": 0.1, "total_s": total, "peak_bytes": 1,
                "completion_tokens": 8, "completion_tokens_per_s": 8 / total}  # fmt: skip
        out = {"steps": [step, step], "frozen_fraction": 0.5 if name.endswith("_half") else 0.0}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(out) + "\n", stderr="")

    monkeypatch.setattr(train_step.subprocess, "run", fake_worker)
    path = tmp_path / "train_step.json"
    assert train_step.main(["--steps", "2", "--out", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["ratios"]["total_s"] == pytest.approx(0.9)
    assert result["ratios_half"]["loss_backward_s"] == pytest.approx(0.6)
    assert result["ratios_distillation"]["total_s"] == pytest.approx(1.0)
    assert result["ratios_distillation_half"]["loss_backward_s"] == pytest.approx(0.5)
    assert result["rockdistillation_half"]["frozen_fraction"] == 0.5
    printed = capsys.readouterr().out
    half = "ratios_distillation_half (rockdistillation_half / distillation): loss+backward 0.500x, total step 0.500x"
    assert half in printed
    assert f"wrote {path}" in printed


def test_gpu_check_dry_run_runs_the_whole_sequence_on_the_cpu(tmp_path):
    """`benchmarks.gpu_check --dry-run`: the sequence a GPU session runs in one command, at tiny sizes, the CUDA-only
    tests reported as skipped."""
    import subprocess

    out = tmp_path / "gpu_check.json"
    root = os.path.join(os.path.dirname(__file__), "..")
    # A budget far above the dry run's time: on a loaded machine the default one (sized for a GPU session) left step
    # rows skipped, which is the deadline's own test below, not this one.
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--budget-s", "3600", "--out",
                           str(out)], cwd=root, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    stages = result["stages"]
    assert result["failures"] == [] and result["meta"]["device_name"] == "cpu (dry run)"
    assert list(stages) == ["cuda_tests", "qlora_step", "loss_rows", "step_rows"]
    assert stages["cuda_tests"]["status"] == "skipped" and "no CUDA" in stages["cuda_tests"]["reason"]
    # One QLoRA step of each trainer, and it changed the adapters (a 4-bit layer cut off from its gradient would not).
    qlora = stages["qlora_step"]["runs"]
    assert set(qlora) == {"rockopd", "rockdistillation"}
    assert all(r["status"] == "ok" and not r["sampled_tensors_changed"].startswith("0/") for r in qlora.values())
    rows = stages["loss_rows"]["rows"]
    assert [r["case"]["beta"] for r in rows] == [0.0, 0.5, 1.0]
    assert all(max(v for a in r["agreement"].values() for v in a.values()) < 1e-5 for r in rows)
    runs = {(r["trainer"], r["beta"]) for r in stages["step_rows"]["runs"] if "median" in r}
    assert runs == {(t, b) for t in ("gkd", "rockopd", "distillation", "rockdistillation") for b in (0.0, 0.5, 1.0)}
    ratios = {(r["trainer"], r["anchor"], r["beta"]) for r in stages["step_rows"]["ratios"]}
    assert ratios == {(t, a, b) for t, a in (("rockopd", "gkd"), ("rockdistillation", "distillation"))
                      for b in (0.0, 0.5, 1.0)}  # fmt: skip


def test_gpu_training_runs_past_the_deadline_are_recorded_as_skipped():
    from benchmarks import gpu

    seen = []
    records = gpu.run_training_steps(torch.device("cpu"), True, 2, 2, 4, 0, seen.append, variants=("lora",),
                                     trainers=("rockopd", "gkd"), betas=(0.0,), deadline=0.0)  # fmt: skip
    assert records == seen and [r["trainer"] for r in records] == ["rockopd", "gkd"]
    assert all("budget" in r["skipped"] and "median" not in r for r in records)


def test_decode_benchmark_measures_both_paths_and_checks_the_greedy_tokens(tmp_path, monkeypatch):
    """benchmarks/decode.py on a tiny saved model: MKL, packed body, packed body + head rows with ratios to the floor,
    the LoRA student's rows, and the packed greedy tokens equal the dense ones."""
    import json
    import math

    from benchmarks import decode
    from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    build_tiny_causal_lm(tokenizer, seed=0).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    monkeypatch.setattr(decode, "read_bandwidth", lambda: 10e9)  # the 1 GiB read is the slow part; not under test
    out = tmp_path / "decode.json"
    assert decode.main(["--models", str(tmp_path / "tiny"), "--batches", "1", "3", "--tokens", "3", "--threads",
                        "--lora_models", str(tmp_path / "tiny"), "--lora_batches", "2", "--out", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["models"][0]["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [(m, b) for m in ("mkl", "packed", "packed_head") for b in (1, 3)]
    # A tiny model's step is the difference of two short timings: under load it can even come out negative, so only
    # its form is checked here, not its size.
    assert all(math.isfinite(r["step_s"]) and r["ratio_to_floor"] == r["step_s"] / result["models"][0]["floor_s"]
               for r in rows)  # fmt: skip
    assert [r["same_greedy_rows"] for r in rows if r["mode"] != "mkl"] == [1, 3, 1, 3]
    table = out.with_suffix(".md").read_text()
    assert "packed body + head" in table and "packed base layers" in table
    lora = result["lora_models"][0]
    # Under LoRA every base layer is packed, the head is not; zero-initialised adapters keep the greedy tokens.
    assert lora["packed_layers"] == 7 * 2
    assert [(r["mode"], r["batch"], r["same_greedy_rows"]) for r in lora["rows"]] == [
        ("lora_mkl", 2, None), ("lora_packed_base", 2, 2)
    ]


def test_decode_threads_study_runs_each_setting_in_its_own_process(tmp_path):
    """benchmarks/decode_threads.py on a tiny saved model: one fresh process per setting and round (OpenMP reads its
    environment at start-up), each compared with the first setting of its own round."""
    import json

    from benchmarks import decode_threads
    from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    build_tiny_causal_lm(tokenizer, seed=0).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "threads.json"
    assert decode_threads.main(["--model", str(tmp_path / "tiny"), "--batch", "2", "--tokens", "2", "--repeats", "1",
                                "--settings", "default", "OMP_WAIT_POLICY=ACTIVE", "--out", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert [(r["setting"], r["env"]) for r in result["runs"]] == [
        ("default", {}), ("OMP_WAIT_POLICY=ACTIVE", {"OMP_WAIT_POLICY": "ACTIVE"})
    ]
    assert result["rows"][0]["ratios_to_first"] == [1.0]
    assert "OMP_WAIT_POLICY=ACTIVE" in out.with_suffix(".md").read_text()
