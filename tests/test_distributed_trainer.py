"""Both rock-token trainers under `accelerate launch` with two gloo processes: one rock set, global statistics, one
file.

The launched script (`tests/scripts/train_rock_online.py`) records every batch each rank's `rock_online` policy
learned from. Replaying the two ranks' batches of each step, concatenated, through one single-process policy must give
the statistics and rock sets the ranks hold: that is what "statistics are global" means.
"""

import importlib.util
import math
import os
import sys

import launching
import pytest
import torch

from hf_rockopd.policies import RockOnlinePolicy, TokenBatch


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_rock_online.py")


def script_constants():
    spec = importlib.util.spec_from_file_location("train_rock_online", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.POLICY_KWARGS, module.STEPS


def assert_same_state(a, b, path="state"):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.shape == b.shape, path
        if a.is_floating_point():
            # All-reduced sums add the ranks' partial sums in another order than one process does.
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True, msg=path)
        else:
            assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for key in a:
            assert_same_state(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, path


def concatenated(records):
    """One (1, N) TokenBatch holding the rows of every rank's batch of one step."""
    fields = ("token_ids", "mask", "divergence", "scored", "student_entropy", "teacher_entropy", "logit_grad_norm")
    flat = {f: torch.cat([r[f].reshape(1, -1) for r in records], dim=1) for f in fields}
    return TokenBatch(
        flat["token_ids"], flat["mask"], records[0]["step"], divergence=flat["divergence"], scored=flat["scored"],
        student_entropy=flat["student_entropy"], teacher_entropy=flat["teacher_entropy"],
        logit_grad_norm=flat["logit_grad_norm"],
    )


@pytest.fixture(scope="module", params=["gkd", "distillation"])
def ranks(tmp_path_factory, request):
    out = tmp_path_factory.mktemp(f"ddp_{request.param}")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", SCRIPT, str(out), request.param,
    ]
    launching.finish(launching.launch(cmd, out / "console.log", cwd=ROOT, env=env), timeout=600)
    dumps = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return out, dumps


def test_both_ranks_ran_in_one_gloo_group(ranks):
    _, dumps = ranks
    assert [d["rank"] for d in dumps] == [0, 1]
    assert all(d["world_size"] == 2 and d["distributed_type"] == "DistributedType.MULTI_CPU" for d in dumps)
    _, steps = script_constants()
    assert all(len(d["seen"]) == steps for d in dumps)
    # Each rank scored its own prompts: the batches differ, so agreement below is not trivial.
    assert not torch.equal(dumps[0]["seen"][0]["token_ids"], dumps[1]["seen"][0]["token_ids"])


def test_every_rank_ends_with_the_same_rock_set_and_statistics(ranks):
    _, (r0, r1) = ranks
    assert len(r0["rock_ids"]) > 0
    assert r0["rock_ids"] == r1["rock_ids"]
    assert [s["rock_ids"] for s in r0["after_step"]] == [s["rock_ids"] for s in r1["after_step"]]
    assert_same_state(r0["state"], r1["state"])


def test_statistics_equal_one_process_over_the_global_batch(ranks):
    _, (r0, r1) = ranks
    kwargs, _ = script_constants()
    reference = RockOnlinePolicy(**kwargs)
    reference.setup(r0["vocab_size"])
    rock_sets = []
    for a, b in zip(r0["seen"], r1["seen"]):
        batch = concatenated([a, b])
        reference.update(batch, reference.weights(batch))
        rock_sets.append(reference.rock_ids())
    assert rock_sets == [s["rock_ids"] for s in r0["after_step"]]
    assert_same_state(reference.state_dict(), r0["state"])


def test_loss_is_finite_and_identical_on_all_ranks(ranks):
    _, (r0, r1) = ranks
    _, steps = script_constants()
    assert len(r0["losses"]) == steps
    assert all(math.isfinite(x) and x > 0 for x in r0["losses"])
    assert r0["losses"] == r1["losses"]  # logged losses are averaged over processes


def test_only_the_main_process_writes_rock_tokens(ranks):
    out, (r0, r1) = ranks
    assert r0["rock_token_writes"] == [str(out)] and r1["rock_token_writes"] == []
    assert sorted(p for p in os.listdir(out) if p.endswith(".json")) == ["rock_tokens.json"]
    from hf_rockopd.policies.rock_set import load_rock_set

    assert load_rock_set(out / "rock_tokens.json")["token_ids"] == r0["rock_ids"]
