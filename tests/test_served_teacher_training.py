"""Both trainers with a served teacher (a real `hf-rockopd serve-teacher` on loopback): equal to the in-process teacher
at k = V, a top-k run, the refusals before any model loads, and faults that stop a step with an error naming it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import make_args
from served_teacher import VOCAB, TeacherServer, free_port, save_tiny_teacher, server, teacher_dir  # noqa: F401 (fixtures)

from hf_rockopd.models import build_tiny_causal_lm
from hf_rockopd.policies.rock_set import load_rock_tokens
from hf_rockopd.teachers import TeacherServerError






def _train(kind, tmp_path, tokenizer, teacher, name, **overrides):
    args = kind.args(tmp_path / name, **overrides)
    trainer = kind.make(build_tiny_causal_lm(tokenizer, seed=0), teacher, args, tokenizer)
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return trainer, losses


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_served_teacher_at_full_vocabulary_equals_the_in_process_teacher(kind, tmp_path, tokenizer, teacher,
                                                                         server, beta):  # fmt: skip
    # Plain SGD: Adam divides each gradient by its own scale, which turns float32 noise in a near-zero gradient into
    # a full step, so weights would say nothing about the loss's gradients.
    in_process, expected = _train(kind, tmp_path, tokenizer, teacher, "local", beta=beta, optim="sgd")
    served, losses = _train(kind, tmp_path, tokenizer, None, "served", beta=beta, optim="sgd",
                            teacher_server_url=server.url, teacher_top_k=VOCAB)  # fmt: skip
    assert served.teacher_model is None
    assert len(losses) == len(expected) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for p, q in zip(served.model.parameters(), in_process.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    teacher_info = load_rock_tokens(tmp_path / "served")["teacher"]
    assert teacher_info["top_k"] == VOCAB and teacher_info["source"] == f"server {server.url}"


def test_top_k_run_trains_on_a_lower_bound(kind, tmp_path, tokenizer, teacher, server):
    _, full = _train(kind, tmp_path, tokenizer, teacher, "full")
    _, sparse = _train(kind, tmp_path, tokenizer, None, "k4", teacher_server_url=server.url, teacher_top_k=4)
    # Step 1 scores the same completions (same student, same seed): the tail-bin loss is below the dense one.
    assert 0 < sparse[0] < full[0]


def test_in_process_top_k_equals_the_served_top_k(kind, tmp_path, tokenizer, teacher, server):
    _, local = _train(kind, tmp_path, tokenizer, teacher, "local", teacher_top_k=8)
    _, served = _train(kind, tmp_path, tokenizer, None, "served", teacher_server_url=server.url, teacher_top_k=8)
    torch.testing.assert_close(torch.tensor(served), torch.tensor(local), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------- refusals ----
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(teacher_server_url="http://127.0.0.1:1"), "teacher_top_k is required"),
        (dict(teacher_server_url="127.0.0.1:8000", teacher_top_k=4), "http"),
        (dict(teacher_server_url="http://127.0.0.1:1", teacher_top_k=4, loss_temperature=0.7), "temperature 1"),
        (dict(teacher_server_url={"a": "http://x", "b": "y"}, teacher_top_k=4), r"teacher_server_url\['b'\] must be"),
        (dict(teacher_server_url={}, teacher_top_k=4), "empty dict"),
        (dict(teacher_top_k=0), "teacher_top_k must be"),
        (dict(teacher_request_timeout=0), "teacher_request_timeout"),
        (dict(teacher_max_retries=-1), "teacher_max_retries"),
        (dict(teacher_server_url="http://127.0.0.1:1", teacher_top_k=4, seq_kd=True), "seq_kd"),
    ],
)
def test_bad_teacher_settings_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **overrides)


def test_unreachable_server_is_refused_before_any_model_loads(kind, tmp_path, tokenizer):
    url = f"http://127.0.0.1:{free_port()}"
    args = kind.args(tmp_path / "out", teacher_server_url=url, teacher_top_k=4, teacher_max_retries=0)
    with pytest.raises(ValueError, match=f"No teacher server answers at {url}.*vllm serve"):
        kind.make("no/such-student", None, args, tokenizer)


def test_top_k_above_the_servers_limit_is_refused_before_any_model_loads(kind, tmp_path, tokenizer, teacher_dir):
    served = TeacherServer(teacher_dir, max_top_k=8).start()
    try:
        args = kind.args(tmp_path / "out", teacher_server_url=served.url, teacher_top_k=16)
        with pytest.raises(ValueError, match="--max_top_k 16"):
            kind.make("no/such-student", None, args, tokenizer)
    finally:
        served.kill()


def test_teacher_model_and_server_together_are_refused(kind, tmp_path, tokenizer, teacher):
    args = kind.args(tmp_path / "out", teacher_server_url="http://127.0.0.1:1", teacher_top_k=4)
    with pytest.raises(ValueError, match="either in this process or outside"):
        kind.make(build_tiny_causal_lm(tokenizer), teacher, args, tokenizer)


# --------------------------------------------------------------------------------------------------- faults ----
def test_server_killed_mid_run_fails_the_step_naming_it_and_the_url(kind, tmp_path, tokenizer, teacher_dir):
    served = TeacherServer(teacher_dir, max_top_k=VOCAB).start()
    args = kind.args(tmp_path / "out", teacher_server_url=served.url, teacher_top_k=4, max_steps=3,
                     teacher_max_retries=1, teacher_retry_backoff=0.01, teacher_request_timeout=5)  # fmt: skip
    trainer = kind.make(build_tiny_causal_lm(tokenizer), None, args, tokenizer)
    served.kill()
    with pytest.raises(TeacherServerError, match=f"Step 0: The teacher at {served.url}.* after 2 tries"):
        trainer.train()


def test_sigkilled_server_then_resume_ends_as_the_uninterrupted_run(kind, tmp_path, tokenizer, teacher_dir):
    """Checkpoint at step 2, the server killed, the run failing at step 2; the server restarted and the run resumed
    from its checkpoint: the same final weights as a run whose server never went down."""
    served = TeacherServer(teacher_dir, max_top_k=VOCAB).start()
    common = dict(teacher_server_url=served.url, teacher_top_k=8, max_steps=4, save_strategy="steps", save_steps=2,
                  teacher_max_retries=0, teacher_request_timeout=5, optim="sgd")  # fmt: skip
    try:
        clean = kind.make(build_tiny_causal_lm(tokenizer), None, kind.args(tmp_path / "clean", **common), tokenizer)
        clean.train()

        class KillAfterCheckpoint:
            def on_save(self, args, state, control, **kwargs):
                if state.global_step == 2:
                    served.kill()

        from transformers import TrainerCallback

        callback = type("Kill", (KillAfterCheckpoint, TrainerCallback), {})()
        broken = kind.make(build_tiny_causal_lm(tokenizer), None, kind.args(tmp_path / "broken", **common),
                           tokenizer, callbacks=[callback])  # fmt: skip
        with pytest.raises(TeacherServerError, match="Step 2"):
            broken.train()
        assert os.path.isdir(tmp_path / "broken" / "checkpoint-2")
        served.start()
        resumed = kind.make(build_tiny_causal_lm(tokenizer), None, kind.args(tmp_path / "broken", **common), tokenizer)
        resumed.train(resume_from_checkpoint=str(tmp_path / "broken" / "checkpoint-2"))
    finally:
        served.kill()
    for p, q in zip(resumed.model.parameters(), clean.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_malformed_answer_fails_the_step_naming_it(kind, tmp_path, tokenizer, monkeypatch, server):
    """A server that answers NaN: the step fails with an error naming the step, the URL and the position."""
    args = kind.args(tmp_path / "out", teacher_server_url=server.url, teacher_top_k=4)
    trainer = kind.make(build_tiny_causal_lm(tokenizer), None, args, tokenizer)
    client = trainer.rock_engine.topk_teacher.client
    real = client._request

    def nan_answer(method, path, what, **kwargs):
        answer = real(method, path, what, **kwargs)
        if path == "/v1/completions":
            entry = answer["choices"][0]["prompt_logprobs"][3]
            entry[next(iter(entry))]["logprob"] = float("nan")
        return answer

    monkeypatch.setattr(client, "_request", nan_answer)
    with pytest.raises(TeacherServerError, match=f"Step 0: The teacher at {server.url} answered sequence 0 "
                                                 "malformed: position 3.*NaN"):  # fmt: skip
        trainer.train()
    assert json.dumps(trainer.state.log_history).count('"loss"') == 0  # no step was logged with a made-up loss


# ---------------------------------------------------------------------------------------------- several teachers ----
@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    servers = {}
    # b is peaked: tiny random models are all near-uniform, so two of them barely differ in loss.
    for name, seed, scale in (("a", 1, 1.0), ("b", 2, 50.0)):
        path = save_tiny_teacher(tmp_path_factory.mktemp(f"teacher_{name}"), seed=seed, head_scale=scale)
        servers[name] = TeacherServer(path, max_top_k=VOCAB).start()
    yield servers
    for served in servers.values():
        served.kill()


def _routed_loss(tmp_path, tokenizer, urls, column):
    from trainer_kinds import KINDS

    kind = KINDS["gkd"]
    dataset = kind.dataset(4).add_column("teacher", column)
    args = kind.args(tmp_path / "out", teacher_server_url=urls, teacher_top_k=16)
    trainer = kind.make(build_tiny_causal_lm(tokenizer, seed=0), None, args, tokenizer, dataset=dataset)
    batch = kind.batch(trainer) | {"teacher": list(column)}
    trainer.model.eval()
    return float(trainer.compute_loss(trainer.model, batch))


def test_the_teacher_column_routes_each_example(tmp_path, tokenizer, two_servers):
    urls = {name: served.url for name, served in two_servers.items()}
    routed = _routed_loss(tmp_path, tokenizer, urls, ["a", "a", "b", "b"])
    swapped = _routed_loss(tmp_path, tokenizer, urls, ["b", "b", "a", "a"])
    assert abs(routed - swapped) > 1e-3 * routed  # the column decides which teacher scores a row (noise: ~1e-7)
    # Swapping the column is swapping the servers behind the names.
    crossed = _routed_loss(tmp_path, tokenizer, {"a": urls["b"], "b": urls["a"]}, ["a", "a", "b", "b"])
    assert crossed == pytest.approx(swapped, rel=1e-6)
    # One name for every row is the single-teacher run against that server.
    single = _routed_loss(tmp_path, tokenizer, urls["a"], ["a"] * 4)
    assert _routed_loss(tmp_path, tokenizer, urls, ["a"] * 4) == pytest.approx(single, rel=1e-6)


def test_unknown_teacher_name_fails_at_the_first_batch(tmp_path, tokenizer, two_servers):
    from trainer_kinds import KINDS

    kind = KINDS["gkd"]
    urls = {name: served.url for name, served in two_servers.items()}
    dataset = kind.dataset(8).add_column("teacher", ["a", "c"] * 4)
    args = kind.args(tmp_path / "out", teacher_server_url=json.dumps(urls), teacher_top_k=4)  # a JSON string, as a CLI gives
    trainer = kind.make(build_tiny_causal_lm(tokenizer), None, args, tokenizer, dataset=dataset)
    with pytest.raises(ValueError, match=r"Step 0: unknown teacher 'c' in the `teacher` column; the served teachers are 'a', 'b'"):
        trainer.train()


def test_several_teachers_are_refused_by_the_distillation_trainer(tmp_path, tokenizer, two_servers):
    from trainer_kinds import KINDS

    kind = KINDS["distillation"]
    args = kind.args(tmp_path / "out", teacher_server_url={n: s.url for n, s in two_servers.items()}, teacher_top_k=4)
    with pytest.raises(ValueError, match="RockOPDTrainer only"):
        kind.make("no/such-student", None, args, tokenizer)


def test_per_teacher_rock_statistics(tmp_path, tokenizer, two_servers):
    from trainer_kinds import KINDS

    kind = KINDS["gkd"]
    urls = {name: served.url for name, served in two_servers.items()}
    dataset = kind.dataset(8).add_column("teacher", ["a", "b"] * 4)
    # The tables are selected as the policy selects: tiny runs need rock_online's thresholds lowered.
    online = {"warmup_steps": 1, "refresh_every": 1, "persistence": 1, "top_k": 5, "min_count": 1,
              "exclude_top_frequent": 0}  # fmt: skip
    args = kind.args(tmp_path / "out", teacher_server_url=urls, teacher_top_k=16, rock_statistics_per_teacher=True,
                     rock_policy="rock_online", rock_policy_kwargs=online)  # fmt: skip
    trainer = kind.make(build_tiny_causal_lm(tokenizer, seed=0), None, args, tokenizer, dataset=dataset)
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    tables = load_rock_tokens(tmp_path / "out")["per_teacher"]
    assert set(tables) == {"a", "b"}
    stats = trainer.rock_engine.per_teacher
    for name, rows in tables.items():
        assert len(rows) == 5 and [r["rock_score"] for r in rows] == sorted((r["rock_score"] for r in rows), reverse=True)
        for row in rows:  # each row is that teacher's own count and mean divergence of the token
            i = row["token_id"]
            assert row["count"] == int(stats.count[name][i])
            assert row["mean_divergence"] == pytest.approx(float(stats.divergence[name][i] / stats.count[name][i]))
    # b is peaked (head x 50): the student diverges from it far more, token for token.
    assert tables["b"][0]["mean_divergence"] > 5 * tables["a"][0]["mean_divergence"]
    with pytest.raises(ValueError, match="rock_statistics_per_teacher=True needs several served teachers"):
        kind.args(tmp_path / "x", teacher_server_url=urls["a"], teacher_top_k=4, rock_statistics_per_teacher=True)
