"""Both rock-token trainers under DeepSpeed with two gloo processes on CPU, against one process over the same global
batch: ZeRO-2 (full fine-tune), and ZeRO-3 with a LoRA student and the teacher held as ZeRO-3 inference (partitioned
too, by TRL's `prepare_deepspeed`).

`deepspeed` is in the test extras (`pip install -e ".[test]"`; with `DS_BUILD_OPS=0` it installs in seconds, no op is
compiled at install) and the test is skipped only where it is missing. DeepSpeed's CPU accelerator
(`DS_ACCELERATOR=cpu`) falls back to gloo without Intel's oneCCL bindings. ZeRO-3 with a trainable head (a fully
fine-tuned student) is refused at start-up (see `test_fsdp2_setup.py`): ZeRO-3 partitions the output head, which the
loss projects outside the model's forward.
"""

import os
import sys

import launching
import pytest
import torch
from trainer_kinds import KINDS

from test_fsdp2 import ROOT, SCRIPT, TOL


pytest.importorskip("deepspeed")


def run(out, mode, kind, *extra):
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"] if mode != "single" else [
        sys.executable]
    return launching.launch([*launcher, SCRIPT, str(out), mode, "--kind", kind, *extra], os.path.join(out, "console.log"),
                            cwd=ROOT, env=env)


def run_both(tmp_path, kind, zero, *extra):
    """The ZeRO-`zero` run on 2 processes and the one-process run over the same global batch; their rank dumps."""
    procs = [run(tmp_path / "deepspeed", "deepspeed", kind, "--zero", str(zero), *extra),
             run(tmp_path / "single", "single", kind, *extra)]  # fmt: skip
    for proc in procs:
        launching.finish(proc)
    ranks = [torch.load(tmp_path / "deepspeed" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return ranks, torch.load(tmp_path / "single" / "rank0.pt", weights_only=False)


def assert_equal_to_one_process(ranks, single):
    assert all(d["distributed_type"] == "DistributedType.DEEPSPEED" and d["world_size"] == 2 for d in ranks)
    assert len(single["losses"]) == 2 and ranks[0]["losses"] == ranks[1]["losses"]
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]), **TOL)
    assert ranks[0]["student"].keys() == single["student"].keys()
    for name, value in single["student"].items():
        for d in ranks:
            torch.testing.assert_close(d["student"][name], value, **TOL, msg=name)
    assert ranks[0]["rock_ids"] and ranks[0]["rock_ids"] == ranks[1]["rock_ids"] == single["rock_ids"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_zero2_equals_one_process_over_the_global_batch(tmp_path, kind):
    assert_equal_to_one_process(*run_both(tmp_path, kind, 2))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_zero3_lora_student_with_a_zero3_teacher_equals_one_process(tmp_path, kind):
    ranks, single = run_both(tmp_path, kind, 3, "--lora")
    assert_equal_to_one_process(ranks, single)
    assert any("lora_" in name for name in single["student"]) and all(d["student_zero3"] for d in ranks)
    # The teacher is partitioned: each rank holds about half of every parameter, never the whole. (It runs under
    # `no_grad` and is in no optimizer; TRL's `prepare_deepspeed` leaves its `requires_grad` as loaded.)
    for name, info in ranks[0]["teacher_shards"].items():
        assert info["zero3"], name
        assert sum(d["teacher_shards"][name]["local"] for d in ranks) >= info["full"] > info["local"], name
