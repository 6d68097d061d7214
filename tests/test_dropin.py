"""Drop-in behaviour: what a `GKDTrainer` or `DistillationTrainer` user relies on holds for the rock-token trainers
with the uniform policy, and the places where they differ are errors, not silent changes.

The `DistillationTrainer` behaviours are written from TRL's documentation of that trainer (constructor arguments,
evaluation datasets as dicts, generation settings, `num_items_in_batch` normalization, logged metrics, saving), not
from TRL's tests.
"""

import os

import pytest
import torch
from trainer_kinds import KINDS

from hf_rockopd import RockDistillationConfig, RockDistillationTrainer, RockOPDTrainer
from hf_rockopd.engine import POLICY_STATE_NAME
from hf_rockopd.policies.rock_set import ROCK_TOKENS_NAME
from hf_rockopd.trainers import RockLossOutput


DISTILLATION = KINDS["distillation"]


# ----------------------------------------------------------------------------------- both trainers (gaps) ----
def test_eval_honours_a_callers_num_items_in_batch(kind, student, teacher, tokenizer, kind_args):
    trainer = kind.make(student, teacher, kind_args(), tokenizer)
    inputs = kind.batch(trainer)
    n_valid = int((kind.view(inputs)["labels"][:, 1:] != -100).sum())
    trainer.model.eval()
    with torch.no_grad():
        mean = trainer.compute_loss(trainer.model, inputs)
        given = trainer.compute_loss(trainer.model, inputs, num_items_in_batch=torch.tensor(3 * n_valid))
    torch.testing.assert_close(given, mean / 3, rtol=1e-5, atol=1e-8)


def test_return_outputs_gives_the_per_position_view_of_the_loss(kind, student, teacher, tokenizer, kind_args):
    trainer = kind.make(student, teacher, kind_args(), tokenizer)
    inputs = kind.batch(trainer)
    trainer.model.eval()
    with torch.no_grad():
        loss, outputs = trainer.compute_loss(trainer.model, inputs, return_outputs=True)
    assert isinstance(outputs, RockLossOutput)
    assert outputs.weights.shape == outputs.divergence.shape == outputs.mask.shape
    assert int(outputs.mask.sum()) == int((kind.view(inputs)["labels"][:, 1:] != -100).sum())
    expected = (outputs.weights * outputs.divergence).sum() / outputs.mask.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-8)


def test_teacher_model_init_kwargs_with_a_built_teacher_raises_before_loading(kind, teacher, tokenizer, kind_args):
    args = kind_args(teacher_model_init_kwargs={"dtype": "float32"})
    with pytest.raises(ValueError, match="already instantiated"):
        kind.make("/nonexistent/student", teacher, args, tokenizer)


@pytest.mark.parametrize("hook", ["compute_metrics", "preprocess_logits_for_metrics"])
def test_metric_hooks_are_refused_not_ignored(student, teacher, tokenizer, args_factory, hook):
    # RockOPDTrainer's evaluation returns no logits, so transformers would never call them.
    with pytest.raises(ValueError, match=f"does not support {hook}"):
        KINDS["gkd"].make(student, teacher, args_factory(), tokenizer, **{hook: lambda *a: {}})
    # DistillationTrainer has no such arguments; neither has its rock-token subclass.
    with pytest.raises(TypeError, match=hook):
        RockDistillationTrainer(model=student, teacher_model=teacher, **{hook: lambda *a: {}})


# ------------------------------------------------------------------------ DistillationTrainer drop-in ----
def test_models_and_tokenizer_given_by_path(student, teacher, tokenizer, tmp_path):
    student.save_pretrained(tmp_path / "student")
    tokenizer.save_pretrained(tmp_path / "student")
    teacher.save_pretrained(tmp_path / "teacher")
    trainer = RockDistillationTrainer(
        model=str(tmp_path / "student"),
        teacher_model=str(tmp_path / "teacher"),
        args=DISTILLATION.args(tmp_path / "out", max_steps=1),
        train_dataset=DISTILLATION.dataset(8),
    )
    assert trainer.processing_class.padding_side == "left"  # loaded from the student's path, as TRL documents
    assert trainer.teacher_model.config.num_hidden_layers == 3
    assert next(trainer.model.parameters()).dtype == torch.float32  # TRL's default dtype for a path
    trainer.train()
    assert trainer.state.global_step == 1


def test_default_config_when_none_is_given(student, teacher, tokenizer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output_dir is relative
    trainer = RockDistillationTrainer(model=student, teacher_model=teacher, processing_class=tokenizer)
    assert isinstance(trainer.args, RockDistillationConfig)
    assert trainer.args.output_dir.endswith("-RockDistillation")
    assert (trainer.args.beta, trainer.args.temperature, trainer.args.rock_policy) == (1.0, 1.0, "uniform")


def test_other_config_classes_are_refused_with_the_fix(student, teacher, tokenizer, tmp_path):
    from trl import DistillationConfig

    with pytest.raises(TypeError, match="RockDistillationConfig"):
        args = DistillationConfig(str(tmp_path), bf16=False)
        RockDistillationTrainer(model=student, teacher_model=teacher, args=args)


def test_eval_datasets_given_as_a_dict_are_each_evaluated(student, teacher, tokenizer, tmp_path):
    args = DISTILLATION.args(tmp_path / "out", per_device_eval_batch_size=4)
    evals = {"easy": DISTILLATION.dataset(4), "hard": DISTILLATION.dataset(8)}
    trainer = DISTILLATION.make(student, teacher, args, tokenizer)
    trainer.eval_dataset = evals
    metrics = trainer.evaluate()
    assert metrics["eval_easy_loss"] > 0 and metrics["eval_hard_loss"] > 0


def test_generation_settings_reach_generation(student, teacher, tokenizer, tmp_path):
    args = DISTILLATION.args(
        tmp_path / "out", max_completion_length=6, temperature=0.9, top_k=5, generation_kwargs={"top_p": 0.8}
    )
    trainer = DISTILLATION.make(student, teacher, args, tokenizer)
    config = trainer.generation_config
    assert (config.max_new_tokens, config.temperature, config.top_k, config.top_p) == (6, 0.9, 5, 0.8)
    trainer.train()
    lengths = [log["completions/max_length"] for log in trainer.state.log_history if "completions/max_length" in log]
    assert lengths and max(lengths) <= 6


def test_logged_metrics_are_trls_plus_rock(student, teacher, tokenizer, tmp_path):
    trainer = DISTILLATION.make(student, teacher, DISTILLATION.args(tmp_path / "out"), tokenizer)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2
    trl_keys = {"loss", "grad_norm", "learning_rate", "num_tokens", "entropy", "step_time", "completions/mean_length",
                "completions/clipped_ratio", "completions/mean_terminated_length"}
    rock_keys = {"rock/frozen_fraction", "rock/projected_fraction", "rock/mean_divergence_other"}
    for log in logs:
        assert trl_keys | rock_keys <= set(log), (trl_keys | rock_keys) - set(log)


def test_saving_writes_the_model_the_rock_set_the_policy_state_and_the_card(student, teacher, tokenizer, tmp_path):
    args = DISTILLATION.args(tmp_path / "out", save_strategy="steps", save_steps=2)
    trainer = DISTILLATION.make(student, teacher, args, tokenizer)
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    for name in ("config.json", "model.safetensors", POLICY_STATE_NAME, ROCK_TOKENS_NAME):
        assert os.path.isfile(checkpoint / name), name
    trainer.save_model(str(tmp_path / "final"))
    assert os.path.isfile(tmp_path / "final" / "model.safetensors")
    assert os.path.isfile(tmp_path / "final" / ROCK_TOKENS_NAME)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "rock" in card.lower() and "distillation" in card


def test_rock_opd_trainer_still_refuses_nothing_it_accepted(student, teacher, tokenizer, args_factory):
    # The construction arguments GKDTrainer users pass (no metric hooks) keep working.
    trainer = RockOPDTrainer(
        model=student, teacher_model=teacher, args=args_factory(), train_dataset=KINDS["gkd"].dataset(4),
        processing_class=tokenizer, callbacks=[], optimizers=(None, None), formatting_func=None,
    )
    assert trainer.rock_policy.name == "uniform"


def test_hub_tags_name_both_bases_once():
    assert RockOPDTrainer._tag_names[:2] == ["trl", "gkd"]
    tags = RockDistillationTrainer._tag_names
    assert tags[:2] == ["trl", "distillation"] and len(tags) == len(set(tags)) and "rock-tokens" in tags
