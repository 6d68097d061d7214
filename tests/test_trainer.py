"""Both rock-token trainers end to end on tiny models: parity with TRL, alignment, frozen rows, LoRA, 4-bit, resume,
bad input. Tests taking `kind` run once per trainer (`RockOPDTrainer`, `RockDistillationTrainer`; tests/trainer_kinds.py);
the others are about `RockOPDTrainer`'s GKD-specific behaviour (`lmbda`, its collator, its generation)."""

import copy
import json
import logging
import os
import re

import pytest
import torch
from trainer_kinds import KINDS
from trl.experimental.gkd import GKDTrainer

from hf_rockopd import RockOPDConfig
from hf_rockopd.engine import POLICY_STATE_NAME
from hf_rockopd.losses import per_token_divergence
from hf_rockopd.models import build_tiny_causal_lm
from hf_rockopd.policies import TokenPolicy
from hf_rockopd.policies.rock_set import ROCK_TOKENS_NAME


make_trainer = KINDS["gkd"].make  # RockOPDTrainer on the tests' messages dataset


def dataset_batch(trainer, n=4):
    """An off-policy batch (the dataset's own completions), so numbers are deterministic."""
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
    return {k: v for k, v in inputs.items() if torch.is_tensor(v)}


def full_per_token_divergence(student, teacher, inputs, beta):
    """Reference: full (B, L, V) logits of both models, then TRL's shift; returns (divergence, valid mask)."""
    with torch.no_grad():
        s = student(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[:, :-1]
        t = teacher(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[:, :-1]
    labels = inputs["labels"][:, 1:]
    div = per_token_divergence(s.reshape(-1, s.shape[-1]), t.reshape(-1, t.shape[-1]), beta).view(labels.shape)
    return div, labels != -100, (s, t, labels)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_uniform_loss_equals_trl_generalized_jsd(kind, student, teacher, tokenizer, kind_args, beta):
    trainer = kind.make(student, teacher, kind_args(beta=beta, rock_policy="uniform"), tokenizer)
    inputs = kind.batch(trainer)
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.compute_loss(trainer.model, inputs)
    _, _, (s, t, labels) = full_per_token_divergence(trainer.model, trainer.teacher_model, kind.view(inputs), beta)
    reference = GKDTrainer.generalized_jsd_loss(s, t, labels=labels, beta=beta)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-7)


def test_identical_teacher_gives_zero_loss(kind, student, tokenizer, kind_args):
    trainer = kind.make(student, copy.deepcopy(student), kind_args(rock_policy="uniform"), tokenizer)
    inputs = kind.batch(trainer)
    assert trainer.compute_loss(trainer.model, inputs).abs().item() < 1e-6


def most_common_completion_token(inputs):
    labels = inputs["labels"][:, 1:]
    ids = labels[labels != -100]
    return int(torch.bincount(ids).argmax())


def test_freeze_weight_is_decided_by_the_predicted_token_not_the_input_token(
    kind, student, teacher, tokenizer, kind_args
):
    """The paper's released code froze the position *after* each rock token; the label must decide."""
    probe = kind.make(student, teacher, kind_args(), tokenizer)
    inputs = kind.batch(probe)
    view = kind.view(inputs)
    rock = most_common_completion_token(view)
    trainer = kind.make(
        student, teacher, kind_args(rock_policy="rock_freeze", rock_policy_kwargs={"token_ids": [rock]}), tokenizer
    )
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.compute_loss(trainer.model, inputs).item()

    div, valid, _ = full_per_token_divergence(trainer.model, trainer.teacher_model, view, beta=1.0)
    label = view["labels"][:, 1:]
    input_token = view["input_ids"][:, :-1]
    n_valid = valid.sum()
    correct = (div * (valid & (label != rock))).sum() / n_valid
    shifted = (div * (valid & (input_token != rock))).sum() / n_valid  # the paper's off-by-one
    assert (valid & (label == rock)).sum() >= 3
    assert ours == pytest.approx(correct.item(), rel=1e-5)
    assert abs(ours - shifted.item()) > 1e-3 * abs(correct.item())


class _RowCounter:
    def __init__(self, module):
        self.rows = 0
        self.handle = module.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.rows += args[0].reshape(-1, args[0].shape[-1]).shape[0]


@pytest.mark.parametrize("probe_fraction", [0.0, 0.5])
def test_frozen_positions_are_never_projected(kind, student, teacher, tokenizer, kind_args, probe_fraction):
    probe = kind.make(student, teacher, kind_args(), tokenizer)
    inputs = kind.batch(probe)
    rock = most_common_completion_token(kind.view(inputs))
    args = kind_args(
        rock_policy="rock_freeze",
        rock_policy_kwargs={"token_ids": [rock]},
        rock_probe_fraction=probe_fraction,
        loss_chunk_size=7,
    )
    trainer = kind.make(student, teacher, args, tokenizer)
    label = kind.view(inputs)["labels"][:, 1:]
    valid = label != -100
    n_valid, n_frozen = int(valid.sum()), int((valid & (label == rock)).sum())
    assert n_frozen >= 3 and n_valid < label.numel()  # prompt positions exist and are not projected either

    s_count = _RowCounter(trainer.model.get_output_embeddings())
    t_count = _RowCounter(trainer.teacher_model.get_output_embeddings())
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()  # the fused loss computed every gradient in its forward: the backward projects nothing
    assert torch.isfinite(loss)
    # +1: the student head runs on one row to find the tensors it trains (`losses._trainable_leaves`).
    if probe_fraction == 0.0:
        assert s_count.rows == n_valid - n_frozen + 1
        assert t_count.rows == n_valid - n_frozen
    else:
        assert n_valid - n_frozen < t_count.rows < n_valid
        assert s_count.rows == t_count.rows + 1
    projected = trainer._metrics["train"]["rock/projected_fraction"][-1]
    assert projected == pytest.approx(t_count.rows / n_valid)
    assert trainer._metrics["train"]["rock/frozen_fraction"][-1] == pytest.approx(n_frozen / n_valid)


def test_tokens_normalization_keeps_the_learning_rate_of_unfrozen_tokens(kind, student, teacher, tokenizer, kind_args):
    probe = kind.make(student, teacher, kind_args(), tokenizer)
    inputs = kind.batch(probe)
    view = kind.view(inputs)
    rock = most_common_completion_token(view)
    losses = {}
    for norm in ("tokens", "weights"):
        args = kind_args(rock_policy="rock_freeze", rock_policy_kwargs={"token_ids": [rock]}, rock_normalization=norm)
        trainer = kind.make(student, teacher, args, tokenizer)
        trainer.model.eval()
        with torch.no_grad():
            losses[norm] = trainer.compute_loss(trainer.model, inputs).item()
    div, valid, _ = full_per_token_divergence(trainer.model, trainer.teacher_model, view, beta=1.0)
    keep = valid & (view["labels"][:, 1:] != rock)
    assert losses["tokens"] == pytest.approx(((div * keep).sum() / valid.sum()).item(), rel=1e-5)
    assert losses["weights"] == pytest.approx(((div * keep).sum() / keep.sum()).item(), rel=1e-5)


def test_gradient_accumulation_is_exact(kind, student, teacher, tokenizer, tmp_path):
    """One optimizer step over 4 sequences: batch 4 x 1 and batch 2 x 2 accumulation give the same update (for
    `DistillationTrainer`, `num_items_in_batch` is counted over the whole generation batch)."""
    results = []
    for bs, ga in ((4, 1), (2, 2)):
        args = kind.args(
            tmp_path / f"ga{ga}",
            per_device_train_batch_size=bs,
            gradient_accumulation_steps=ga,
            max_steps=1,
            lmbda=0.0,  # off-policy: the dataset completions, identical in both runs
            optim="sgd",
            learning_rate=1.0,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
        )
        trainer = kind.make(copy.deepcopy(student), teacher, args, tokenizer)
        trainer.train()
        results.append({k: v.detach().clone() for k, v in trainer.model.named_parameters()})
    changed = 0
    for name, value in results[0].items():
        torch.testing.assert_close(value, results[1][name], rtol=1e-4, atol=1e-6)
        changed += int(not torch.equal(value, student.state_dict()[name]))
    assert changed > 0


def test_num_items_counts_the_generated_completions(student, teacher, tokenizer, args_factory):
    trainer = make_trainer(student, teacher, args_factory(max_steps=1, max_new_tokens=9), tokenizer)
    seen = {}
    original = trainer.compute_loss

    def spy(model, inputs, return_outputs=False, num_items_in_batch=None):
        seen["num_items"] = int(num_items_in_batch)
        seen["generated"] = int((inputs["labels"][:, 1:] != -100).sum())
        seen["width"] = inputs["input_ids"].shape[1] - inputs["prompts"].shape[1]
        return original(model, inputs, return_outputs, num_items_in_batch)

    trainer.compute_loss = spy
    trainer.train()
    assert seen["width"] <= 9  # the completions are the student's, not the dataset's
    assert seen["num_items"] == seen["generated"]


def test_generation_keeps_kv_cache_with_gradient_checkpointing(student, teacher, tokenizer, args_factory):
    trainer = make_trainer(student, teacher, args_factory(gradient_checkpointing=True, max_steps=1), tokenizer)
    assert trainer.generation_kwargs["use_cache"] is True
    calls = []
    original = trainer.model.generate

    def spy(*args, **kwargs):
        calls.append(kwargs["generation_config"].use_cache)
        return original(*args, **kwargs)

    trainer.model.generate = spy
    trainer.train()
    assert calls and all(calls)


def test_no_distillation_trainer_migration_warning(student, teacher, tokenizer, args_factory, caplog):
    with caplog.at_level(logging.WARNING):
        make_trainer(student, teacher, args_factory(lmbda=1.0, temperature=1.0), tokenizer)
    assert "fully covered by `DistillationTrainer`" not in caplog.text


def test_config_defaults_follow_the_paper_and_keep_trls_objective():
    args = RockOPDConfig(output_dir="unused")
    assert (args.lmbda, args.beta, args.temperature, args.loss_temperature) == (1.0, 1.0, 1.0, 1.0)
    assert args.rock_normalization == "tokens"
    # uniform by default: a drop-in GKD user keeps TRL's objective; rocks are opt-in (README, "Token policies")
    assert args.rock_policy == "uniform" and args.rock_policy_kwargs == {}
    online = RockOPDConfig(output_dir="unused", rock_policy="rock_online", rock_policy_kwargs='{"top_k": 7}')
    assert online.rock_policy_kwargs["top_k"] == 7


def test_training_writes_rock_tokens_and_policy_state(kind, student, teacher, tokenizer, kind_args):
    args = kind_args(
        rock_policy="rock_online",
        rock_policy_kwargs={"warmup_steps": 1, "refresh_every": 1, "persistence": 1, "top_k": 4, "exclude_top_frequent": 1},
        max_steps=3,
        save_strategy="steps",
        save_steps=2,
        max_new_tokens=16,
    )
    trainer = kind.make(student, teacher, args, tokenizer)
    trainer.train()
    out = args.output_dir
    for directory in (out, os.path.join(out, "checkpoint-2")):
        with open(os.path.join(directory, ROCK_TOKENS_NAME)) as f:
            payload = json.load(f)
        assert payload["vocab_size"] == len(tokenizer) and payload["policy"] == "rock_online"
        assert 1 <= len(payload["token_ids"]) <= 4
        for row in payload["tokens"]:
            assert row["token"] == tokenizer.decode([row["token_id"]])
            assert row["count"] >= 2 and row["mean_divergence"] > 0
            assert row["rock_score"] == pytest.approx(row["count"] * row["mean_divergence"])
    assert os.path.isfile(os.path.join(out, "checkpoint-2", POLICY_STATE_NAME))
    with open(os.path.join(out, ROCK_TOKENS_NAME)) as f:
        assert json.load(f)["token_ids"] == trainer.rock_policy.rock_ids()
    logged = [log for log in trainer.state.log_history if "rock/set_size" in log]
    assert logged[0]["rock/set_size"] == 0 and logged[-1]["rock/set_size"] >= 1
    assert all(0 <= log["rock/frozen_fraction"] <= 1 for log in logged)


ONLINE = {"warmup_steps": 1, "refresh_every": 1, "persistence": 1, "top_k": 4, "exclude_top_frequent": 1}


def test_a_card_that_fails_to_render_does_not_abort_a_checkpoint(kind, student, teacher, tokenizer, kind_args,
                                                                 monkeypatch):
    """TRL writes the card before the checkpoint's weights: a failing card must not leave a checkpoint that cannot be
    resumed, nor stop the run. Outside a checkpoint (`push_to_hub`) the error is raised as it is."""
    import hf_rockopd.trainers.common as common

    def broken(*args, **kwargs):
        raise RuntimeError("'smoothing' is undefined")

    warned = []
    monkeypatch.setattr(common, "model_card_from_trainer", broken)
    monkeypatch.setattr(common.logger, "warning", lambda message, *a, **k: warned.append(message))
    args = kind_args(max_steps=2, save_strategy="steps", save_steps=1, max_new_tokens=8)
    trainer = kind.make(student, teacher, args, tokenizer)
    trainer.train()
    assert trainer.state.global_step == 2
    for step in (1, 2):
        assert os.path.isfile(os.path.join(args.output_dir, f"checkpoint-{step}", "trainer_state.json"))
    assert sum("the model card was not written (RuntimeError: 'smoothing' is undefined)" in m for m in warned) == 2
    with pytest.raises(RuntimeError, match="smoothing"):
        trainer.create_model_card()


def test_resume_restores_policy_state_exactly(kind, student, teacher, tokenizer, tmp_path):
    common = dict(
        rock_policy="rock_online",
        rock_policy_kwargs=ONLINE,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        max_new_tokens=10,
    )
    full = kind.make(copy.deepcopy(student), teacher, kind.args(tmp_path / "full", **common), tokenizer)
    full.train()
    resumed = kind.make(copy.deepcopy(student), teacher, kind.args(tmp_path / "resumed", **common), tokenizer)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))

    a, b = full.rock_policy.state_dict(), resumed.rock_policy.state_dict()
    assert a["rocks"] == b["rocks"] and len(a["rocks"]) > 0
    torch.testing.assert_close(a["totals"], b["totals"])
    assert a["step"] == b["step"] == 3


def test_resume_without_policy_state_fails_unless_reset_is_asked(kind, student, teacher, tokenizer, tmp_path):
    common = dict(rock_policy="rock_online", rock_policy_kwargs=ONLINE, max_steps=2, save_strategy="steps", save_steps=2)
    first = kind.make(copy.deepcopy(student), teacher, kind.args(tmp_path / "a", **common), tokenizer)
    first.train()
    checkpoint = tmp_path / "a" / "checkpoint-2"
    os.remove(checkpoint / POLICY_STATE_NAME)
    again = kind.make(
        copy.deepcopy(student), teacher, kind.args(tmp_path / "b", **{**common, "max_steps": 3}), tokenizer
    )
    with pytest.raises(ValueError, match="rock_policy_reset_on_resume"):
        again.train(resume_from_checkpoint=str(checkpoint))

    (checkpoint / POLICY_STATE_NAME).write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="unreadable"):
        again.train(resume_from_checkpoint=str(checkpoint))

    fresh = kind.make(
        copy.deepcopy(student),
        teacher,
        kind.args(tmp_path / "c", **{**common, "max_steps": 3, "rock_policy_reset_on_resume": True}),
        tokenizer,
    )
    fresh.train(resume_from_checkpoint=str(checkpoint))
    assert fresh.state.global_step == 3


def test_lora_trains_only_the_adapter(kind, student, teacher, tokenizer, kind_args):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = kind.make(
        student, teacher, kind_args(max_steps=2, rock_policy="rock_online", rock_policy_kwargs=ONLINE), tokenizer,
        peft_config=peft_config,
    )
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    lora = [k for k in before if "lora_" in k]
    base = [k for k in before if "lora_" not in k]
    assert lora and base
    assert all(torch.equal(before[k], after[k].detach()) for k in base)
    assert any(not torch.equal(before[k], after[k].detach()) for k in lora if "lora_B" in k)


def test_4bit_nf4_student_with_lora_trains_on_cpu(kind, tokenizer, teacher, kind_args, tmp_path):
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    build_tiny_causal_lm(tokenizer, hidden_size=64, seed=0).save_pretrained(tmp_path / "student")
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "student", quantization_config=quantization)
    assert any(type(m).__name__ == "Linear4bit" for m in student.modules())
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = kind.make(student, teacher, kind_args(max_steps=2), tokenizer, peft_config=peft_config)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "lora_B" in k}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(v, after[k].detach()) for k, v in before.items())
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in trainer.state.log_history if "loss" in log)


# ------------------------------------------------------------------------------------------------ bad input ----
def test_vocab_mismatch_names_both_sizes(kind, student, tokenizer, kind_args):
    other = build_tiny_causal_lm(tokenizer, vocab_size=300, seed=3)
    with pytest.raises(ValueError, match=r"259.*300|300.*259"):
        kind.make(student, other, kind_args(), tokenizer)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rock_policy": "nope"}, "Available policies: entropy, loss_quantile"),
        ({"rock_normalization": "mean"}, "rock_normalization must be one of tokens, weights, got 'mean'"),
        ({"rock_policy": "rock_online", "rock_policy_kwargs": {"topk": 3}}, "does not take 'topk'"),
        ({"loss_chunk_size": 0}, "loss_chunk_size must be an integer >= 1, got 0"),
        ({"loss_temperature": 0.0}, "loss_temperature must be > 0"),
        ({"rock_probe_fraction": 1.5}, "rock_probe_fraction must be in"),
        ({"rock_policy_kwargs": "{not json"}, "rock_policy_kwargs is not valid JSON: '{not json'"),
        # `max_new_tokens` is `max_completion_length` for RockDistillationConfig (tests/trainer_kinds.py).
        ({"max_new_tokens": 0}, "must be an integer >= 1 (new tokens per completion), got 0"),
        ({"max_new_tokens": -1}, "must be an integer >= 1 (new tokens per completion), got -1"),
    ],
)
def test_bad_config_values_are_clear_errors(kind, overrides, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        kind.args(tmp_path, **overrides)


@pytest.mark.parametrize(
    "policy, kwargs, message",
    [
        ("rock_freeze", {"token_ids": [1], "weight": -0.5}, "weight must be a finite number >= 0, got -0.5"),
        ("rock_online", {"top_k": 0}, "top_k must be an integer >= 1, got 0"),
        ("loss_quantile", {"quantile": 1.0}, "quantile must be in (0, 1), got 1.0"),
        ("rock_freeze", {"token_ids": [100000]}, "outside the vocabulary [0, 259)"),
    ],
)
def test_bad_policy_values_fail_at_trainer_creation(kind, student, teacher, tokenizer, kind_args, policy, kwargs, message):
    with pytest.raises(ValueError) as err:
        kind.make(student, teacher, kind_args(rock_policy=policy, rock_policy_kwargs=kwargs), tokenizer)
    assert message in str(err.value)


def test_empty_train_dataset(kind, student, teacher, tokenizer, kind_args):
    with pytest.raises(ValueError, match="train_dataset is empty"):
        kind.make(student, teacher, kind_args(), tokenizer, dataset=kind.dataset(0))


def test_no_valid_completion_token_gives_exact_zero_with_finite_gradients(
    kind, student, teacher, tokenizer, kind_args, caplog
):
    trainer = kind.make(student, teacher, kind_args(), tokenizer)
    inputs = kind.drop_all_completion_tokens(kind.batch(trainer))
    trainer.model.train()
    with caplog.at_level(logging.WARNING):
        loss = trainer.compute_loss(trainer.model, inputs, num_items_in_batch=torch.tensor(0))
    assert loss.item() == 0.0
    loss.backward()
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and g.abs().max() == 0 for g in grads)
    assert "no completion token carries weight" in caplog.text


class FreezeEverything(TokenPolicy):
    name = "freeze_everything_test"

    def weights(self, batch):
        return torch.zeros(batch.mask.shape)


def test_all_weights_zero_gives_exact_zero(kind, student, teacher, tokenizer, kind_args, caplog):
    trainer = kind.make(student, teacher, kind_args(), tokenizer, rock_policy=FreezeEverything())
    inputs = kind.batch(trainer)
    trainer.model.train()
    with caplog.at_level(logging.WARNING):
        loss = trainer.compute_loss(trainer.model, inputs, num_items_in_batch=torch.tensor(50))
    assert loss.item() == 0.0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)
    assert "no completion token carries weight" in caplog.text


class NegativePolicy(TokenPolicy):
    name = "negative_test"

    def weights(self, batch):
        return -batch.mask.float()


def test_negative_weights_from_a_policy_are_rejected(kind, student, teacher, tokenizer, kind_args):
    trainer = kind.make(student, teacher, kind_args(), tokenizer, rock_policy=NegativePolicy())
    with pytest.raises(ValueError, match="negative or non-finite weights"):
        trainer.compute_loss(trainer.model, kind.batch(trainer))


def test_nan_teacher_raises_naming_the_step(kind, student, teacher, tokenizer, kind_args):
    with torch.no_grad():
        teacher.lm_head.weight[5] = float("nan")
    trainer = kind.make(student, teacher, kind_args(), tokenizer)
    trainer.state.global_step = 7
    with pytest.raises(FloatingPointError, match="at step 7"):
        trainer.compute_loss(trainer.model, kind.batch(trainer))


def test_teacher_model_init_kwargs_without_dtype(kind, student, teacher, tokenizer, kind_args, tmp_path):
    teacher.save_pretrained(tmp_path / "teacher")
    args = kind_args(teacher_model_init_kwargs={"low_cpu_mem_usage": True})
    trainer = kind.make(student, str(tmp_path / "teacher"), args, tokenizer)
    assert trainer.teacher_model.config.num_hidden_layers == 3


def test_evaluate_reports_loss_and_rock_metrics_without_learning(kind, student, teacher, tokenizer, kind_args):
    args = kind_args(rock_policy="rock_online", rock_policy_kwargs=ONLINE, per_device_eval_batch_size=4)
    trainer = kind.make(student, teacher, args, tokenizer, eval_dataset=kind.dataset(8))
    before = trainer.rock_policy.state_dict()
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0 and "eval_rock/frozen_fraction" in metrics
    after = trainer.rock_policy.state_dict()
    torch.testing.assert_close(before["pending"], after["pending"])  # evaluation batches teach the policy nothing
