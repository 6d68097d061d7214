"""Both rock-token trainers under FSDP2 with two gloo processes on CPU, against one process over the same global batch.

Every run is parametrized over the trainer kinds (`gkd`: `RockOPDTrainer`, `distillation`: `RockDistillationTrainer`;
see tests/trainer_kinds.py). The launched script (`tests/scripts/fsdp_train.py`) goes through the Trainer's FSDP path
(`fsdp=True`, `fsdp_config={"version": 2}`): accelerate's FSDP2 preparation of the student and its FSDP checkpoints,
and the teacher sharded by the trainer. accelerate 1.16 sets a CPU run up as DDP even when FSDP is asked for, so the
script switches its accelerator state to FSDP (the only patch; see its docstring).

- `equal`: 2 steps of `rock_online` (refresh every step after one warm-up step) on completions both runs share (`gkd`:
  the dataset's, `lmbda=0`; `distillation`: greedy decoding), FSDP2 on 2 processes x 2 prompts against one process x
  4 prompts.
- `lora`: as `equal` with a LoRA student (q/v projections, r=4): only the adapters train, the head stays frozen.
- `resume`: 3 on-policy steps (sampled, generation with sharded layers), a checkpoint every 2 steps; a run SIGKILLed
  at the end of step 3 resumed from `checkpoint-2` must end where the uninterrupted run ends.
"""

import os
import sys

import launching
import pytest
import torch

from test_distributed_trainer import assert_same_state
from trainer_kinds import KINDS


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "fsdp_train.py")
TOL = dict(rtol=0, atol=1e-5)  # float32, the same global batch: reduction order is the only difference


def launch(out, mode, *extra, kind="gkd", expect_ok=True, log="console"):
    os.makedirs(out, exist_ok=True)
    extra = (*extra, "--kind", kind)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if mode == "fsdp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", SCRIPT, str(out), mode, *extra]
    else:
        cmd = [sys.executable, SCRIPT, str(out), mode, *extra]
    return launching.launch(cmd, os.path.join(out, f"{log}.log"), cwd=ROOT, env=env, expect_ok=expect_ok)


finish = launching.finish


def dumps(out, ranks=(0, 1)):
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in ranks]


@pytest.fixture(scope="module", params=sorted(KINDS))
def equal(tmp_path_factory, request):
    base = tmp_path_factory.mktemp(f"fsdp_equal_{request.param}")
    # Launched together: the two runs are independent, and this machine may be shared.
    runs = [launch(base / "fsdp", "fsdp", kind=request.param), launch(base / "single", "single", kind=request.param)]
    for run in runs:
        finish(run)
    return base, dumps(base / "fsdp"), dumps(base / "single", ranks=(0,))[0]


@pytest.fixture(scope="module", params=sorted(KINDS))
def resume(tmp_path_factory, request):
    base = tmp_path_factory.mktemp(f"fsdp_resume_{request.param}")
    common = ("--lmbda", "1", "--steps", "3", "--save-every", "2")
    kind = request.param
    full = launch(base / "full", "fsdp", *common, kind=kind)
    killed = launch(base / "kill", "fsdp", *common, "--kill-at", "3", kind=kind, expect_ok=False)
    finish(full)
    assert finish(killed) != 0
    checkpoint = base / "kill" / "checkpoint-2"
    assert checkpoint.is_dir() and not (base / "kill" / "checkpoint-3").exists()
    finish(launch(base / "kill", "fsdp", *common, "--resume", str(checkpoint), kind=kind, log="resumed"))
    return dumps(base / "full"), dumps(base / "kill")


@pytest.fixture(scope="module", params=sorted(KINDS))
def lora(tmp_path_factory, request):
    base = tmp_path_factory.mktemp(f"fsdp_lora_{request.param}")
    kind = request.param
    runs = [launch(base / "fsdp", "fsdp", "--lora", kind=kind), launch(base / "single", "single", "--lora", kind=kind)]
    for run in runs:
        finish(run)
    return dumps(base / "fsdp"), dumps(base / "single", ranks=(0,))[0]


def test_the_run_is_fsdp2_on_two_gloo_processes(equal):
    _, ranks, single = equal
    assert [d["rank"] for d in ranks] == [0, 1]
    assert all(d["world_size"] == 2 and d["is_fsdp2"] and d["distributed_type"] == "DistributedType.FSDP" for d in ranks)
    assert single["world_size"] == 1 and not single["is_fsdp2"]
    assert all(d["global_step"] == 2 for d in (*ranks, single))


def test_teacher_parameters_are_shards_on_each_rank(equal):
    _, ranks, _ = equal
    for name, info in ranks[0]["teacher_shards"].items():
        assert info["dtensor"] and not info["requires_grad"], name
        locals_ = [d["teacher_shards"][name]["local"] for d in ranks]
        # Dim-0 shards: half each, one row more on rank 0 for an odd row count; together the whole.
        row = info["full"] // info["shape"][0]
        assert sum(locals_) == info["full"] and all(abs(n - info["full"] / 2) <= row for n in locals_), (name, locals_)
    # Still shards after training: resharded after every forward, never gathered for good.
    assert ranks[0]["teacher_shards_after"] == ranks[0]["teacher_shards"]


def test_loss_and_updated_weights_equal_one_process_over_the_global_batch(equal):
    _, (r0, r1), single = equal
    assert len(single["losses"]) == 2 and r0["losses"] == r1["losses"]
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(single["losses"]), **TOL)
    assert r0["student"].keys() == single["student"].keys()
    for name, value in single["student"].items():
        torch.testing.assert_close(r0["student"][name], value, **TOL, msg=name)
        torch.testing.assert_close(r1["student"][name], value, **TOL, msg=name)


def test_the_student_head_takes_the_hand_written_gradient_under_fsdp2(equal):
    _, ranks, single = equal
    for d in ranks:
        student = [seen for seen in d["head_paths"]["head_weight"] if seen[1]]
        teacher = [seen for seen in d["head_paths"]["head_weight"] if not seen[1]]
        # accelerate keeps the student's final norm + head unsharded after forward: the loss shares that parameter;
        # the teacher's root is resharded after forward: its head is gathered from shards.
        assert student and all(kind != "DTensor" for kind, _ in student)
        assert teacher and all(kind == "DTensor" for kind, _ in teacher)
        assert d["head_paths"]["hand_written"] and all(d["head_paths"]["hand_written"])
        # A head that is a shard when the loss runs gets its gradient reduce-scattered into the shard's grad.
        assert d["sharded_head_grad_error"] < 1e-6
    assert single["head_paths"]["hand_written"] and all(single["head_paths"]["hand_written"])


def test_the_student_moved(equal):
    from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer

    _, (r0, _), _ = equal
    start = build_tiny_causal_lm(build_tiny_tokenizer(), seed=0).state_dict()
    assert max((r0["student"][k] - start[k]).abs().max().item() for k in r0["student"]) > 1e-3


def test_lora_student_under_fsdp2_equals_one_process(lora):
    (r0, r1), single = lora
    assert r0["is_fsdp2"] and r0["losses"] == r1["losses"]
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(single["losses"]), **TOL)
    adapters = [name for name in single["student"] if "lora_" in name]
    assert adapters and r0["student"].keys() == single["student"].keys()
    for name, value in single["student"].items():
        torch.testing.assert_close(r0["student"][name], value, **TOL, msg=name)
    assert not r0["head_paths"]["hand_written"]  # the head is frozen: no head gradient at all
    assert r0["rock_ids"] == r1["rock_ids"] == single["rock_ids"]


def test_both_ranks_hold_the_same_rock_set_and_statistics_as_one_process(equal):
    _, (r0, r1), single = equal
    assert r0["rock_ids"] and r0["rock_ids"] == r1["rock_ids"] == single["rock_ids"]
    assert [s["rock_ids"] for s in r0["after_step"]] == [s["rock_ids"] for s in r1["after_step"]]
    assert [s["rock_ids"] for s in r0["after_step"]] == [s["rock_ids"] for s in single["after_step"]]
    assert_same_state(r0["state"], r1["state"])
    assert_same_state(r0["state"], single["state"])


def test_only_rank_0_writes_one_rock_tokens_json(equal):
    base, (r0, r1), _ = equal
    assert r0["rock_token_writes"] == [str(base / "fsdp")] and r1["rock_token_writes"] == []
    assert sorted(p for p in os.listdir(base / "fsdp") if p.endswith(".json")) == ["rock_tokens.json"]


def test_sigkilled_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run(resume):
    full, resumed = resume
    for a, b in zip(full, resumed):
        assert a["global_step"] == b["global_step"] == 3
        assert a["rock_ids"] == b["rock_ids"] and a["rock_ids"] == full[0]["rock_ids"]
        assert_same_state(a["state"], b["state"])
        for name, value in a["student"].items():
            torch.testing.assert_close(b["student"][name], value, **TOL, msg=name)
