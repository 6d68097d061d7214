"""Both rock-token trainers under DeepSpeed ZeRO-2 with two gloo processes on CPU, against one process over the same
global batch.

`deepspeed` is in the test extras (`pip install -e ".[test]"`; with `DS_BUILD_OPS=0` it installs in seconds, no op is
compiled at install) and the test is skipped only where it is missing. DeepSpeed's CPU accelerator
(`DS_ACCELERATOR=cpu`) falls back to gloo without Intel's oneCCL bindings. ZeRO-3 is refused at start-up (see
`test_fsdp2_setup.py`): it partitions the output head, which the loss projects outside the model's forward.
"""

import os
import subprocess
import sys

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
    return subprocess.Popen([*launcher, SCRIPT, str(out), mode, "--kind", kind, *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_zero2_equals_one_process_over_the_global_batch(tmp_path, kind):
    procs = [run(tmp_path / "zero2", "deepspeed", kind, "--zero", "2"), run(tmp_path / "single", "single", kind)]
    for proc in procs:
        output, _ = proc.communicate(timeout=1800)
        assert proc.returncode == 0, output[-4000:]
    ranks = [torch.load(tmp_path / "zero2" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    single = torch.load(tmp_path / "single" / "rank0.pt", weights_only=False)
    assert all(d["distributed_type"] == "DistributedType.DEEPSPEED" and d["world_size"] == 2 for d in ranks)
    assert len(single["losses"]) == 2 and ranks[0]["losses"] == ranks[1]["losses"]
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]), **TOL)
    for name, value in single["student"].items():
        for d in ranks:
            torch.testing.assert_close(d["student"][name], value, **TOL, msg=name)
    assert ranks[0]["rock_ids"] and ranks[0]["rock_ids"] == ranks[1]["rock_ids"] == single["rock_ids"]
