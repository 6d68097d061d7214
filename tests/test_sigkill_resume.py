"""A training process SIGKILLed after a checkpoint, then resumed, ends exactly where an uninterrupted run ends (both
rock-token trainers)."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from hf_rockopd.engine import POLICY_STATE_NAME
from hf_rockopd.policies.rock_set import ROCK_TOKENS_NAME


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_then_sigkill.py")


def run(*argv):
    env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, SCRIPT, *map(str, argv)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module", params=["gkd", "distillation"])
def runs(tmp_path_factory, request):
    base = tmp_path_factory.mktemp(f"sigkill_{request.param}")
    full = run(base / "full", "full", "--trainer", request.param)
    assert full.returncode == 0, full.stderr[-3000:]
    killed = run(base / "killed", "kill", "--trainer", request.param)
    return base, killed, request.param


def test_the_process_really_died_by_sigkill_after_its_checkpoint(runs):
    base, killed, _ = runs
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert os.path.isfile(base / "killed" / "checkpoint-2" / POLICY_STATE_NAME)
    assert os.path.isfile(base / "killed" / "checkpoint-2" / ROCK_TOKENS_NAME)
    assert not os.path.exists(base / "killed" / "checkpoint-4")
    assert not os.path.exists(base / "killed" / "final.pt")


def test_resumed_run_equals_the_uninterrupted_run(runs):
    base, _, kind = runs
    resumed = run(base / "killed", "resume", base / "killed" / "checkpoint-2", "--trainer", kind)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    full = torch.load(base / "full" / "final.pt", weights_only=False)
    again = torch.load(base / "killed" / "final.pt", weights_only=False)
    assert full["global_step"] == again["global_step"] == 6
    assert len(full["rock_ids"]) > 0 and full["rock_ids"] == again["rock_ids"]
    a, b = full["policy_state"], again["policy_state"]
    assert a.keys() == b.keys() and a["rocks"] == b["rocks"] and a["step"] == b["step"]
    torch.testing.assert_close(a["totals"], b["totals"], rtol=0, atol=0)
    for name, weight in full["student"].items():
        torch.testing.assert_close(weight, again["student"][name], rtol=0, atol=0, msg=name)


def test_resuming_the_last_checkpoint_trains_nothing(runs):
    # transformers' loop steps once before it compares the step with max_steps: resuming checkpoint-6 of a 6-step run
    # trained a 7th step (the real-budget run's uniform student got 201 of 200). It must load the checkpoint and stop.
    base, _, kind = runs
    again = run(base / "again", "resume", base / "full" / "checkpoint-6", "--trainer", kind)
    assert again.returncode == 0, again.stderr[-3000:]
    full = torch.load(base / "full" / "final.pt", weights_only=False)
    loaded = torch.load(base / "again" / "final.pt", weights_only=False)
    assert loaded["global_step"] == 6 and not os.path.exists(base / "again" / "checkpoint-7")
    assert loaded["rock_ids"] == full["rock_ids"] and loaded["policy_state"]["step"] == full["policy_state"]["step"]
    for name, weight in full["student"].items():
        torch.testing.assert_close(weight, loaded["student"][name], rtol=0, atol=0, msg=name)


def test_a_checkpoint_past_max_steps_is_refused(runs, tmp_path):
    base, _, kind = runs
    past = run(tmp_path / "past", "resume", base / "full" / "checkpoint-6", "--trainer", kind, "--max_steps", "4")
    assert past.returncode != 0
    assert "is at step 6, past max_steps=4" in past.stderr and "set max_steps to at least 6" in past.stderr
