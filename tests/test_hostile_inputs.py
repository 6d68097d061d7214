"""Hostile inputs: each is handled correctly (and said so) or stopped with a clear error before training.

The tests that take a `kind` run against both trainers (`RockOPDTrainer` and `RockDistillationTrainer`, see
tests/trainer_kinds.py); the collator tests are `RockOPDTrainer`'s alone (`RockDistillationTrainer` takes prompts only
and never truncates them).
"""

import logging
import math

import pytest
from conftest import make_dataset
from datasets import Dataset
from trainer_kinds import KINDS
from trl.experimental.utils import DataCollatorForChatML

from hf_rockopd.models import build_tiny_causal_lm
from hf_rockopd.policies.rock_set import save_rock_set
from hf_rockopd.trainers.data import OnPolicyChatMLCollator, PromptTooLongError


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


# ---------------------------------------------------------------------------------------------- set-up ----
def test_fsdp1_is_refused_before_any_model_is_loaded(kind, student, tokenizer, kind_args, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # `accelerate launch --use_fsdp`: version 1 unless told
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    name = kind.trainer_class.__name__
    with pytest.raises(ValueError, match=f"{name} supports FSDP2 only, and this run asks for FSDP version 1"):
        # A teacher path that does not exist: the FSDP check must come first.
        kind.make(student, "/nonexistent/teacher", kind_args(), tokenizer)


@pytest.mark.parametrize(
    "env, named",
    [("FSDP_OFFLOAD_PARAMS", "cpu_offload"), ("FSDP_ACTIVATION_CHECKPOINTING", "activation_checkpointing")],
)
def test_untested_fsdp2_options_are_refused_before_any_model_is_loaded(
    kind, student, tokenizer, kind_args, monkeypatch, env, named
):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv(env, "true")
    name = kind.trainer_class.__name__
    with pytest.raises(ValueError, match=f"{name} under FSDP2 has been run with full sharding only.*sets {named}"):
        kind.make(student, "/nonexistent/teacher", kind_args(), tokenizer)


def test_deepspeed_zero3_without_adapters_is_refused_before_any_model_is_loaded(
    kind, student, tokenizer, kind_args, monkeypatch
):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # `accelerate launch --use_deepspeed --zero_stage 3`
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    name = kind.trainer_class.__name__
    with pytest.raises(ValueError, match=f"{name} supports DeepSpeed ZeRO-3 with a frozen output head only.*FSDP2"):
        kind.make(student, "/nonexistent/teacher", kind_args(), tokenizer)
    from peft import LoraConfig

    # With adapters the start-up check passes: what fails next is loading the missing teacher.
    with pytest.raises(OSError, match="/nonexistent/teacher"):
        kind.make(student, "/nonexistent/teacher", kind_args(), tokenizer, peft_config=LoraConfig(r=4))


def test_processes_that_did_not_join_a_group_are_refused(kind, student, teacher, tokenizer, kind_args, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2 processes, but the Trainer runs single-process.*use_cpu=True"):
        kind.make(student, teacher, kind_args(), tokenizer)


def test_missing_tokenizer_is_a_clear_error(kind, student, teacher, kind_args):
    # A model built in code has no name to load a tokenizer from (RockDistillationTrainer, like TRL, would try).
    with pytest.raises(ValueError, match=r"needs processing_class.*AutoTokenizer\.from_pretrained"):
        kind.trainer_class(model=student, teacher_model=teacher, args=kind_args(), train_dataset=kind.dataset())


def test_processing_class_that_is_not_a_tokenizer_is_a_type_error(kind, student, teacher, kind_args):
    with pytest.raises(TypeError, match=r"processing_class must be a tokenizer.*got str: 'student/name'"):
        kind.make(student, teacher, kind_args(), "student/name")


@pytest.mark.parametrize(
    "role, value, error",
    [("model", None, TypeError), ("model", 3, TypeError), ("teacher_model", 3, TypeError),
     ("teacher_model", None, ValueError)],
)
def test_models_of_the_wrong_kind_are_refused_naming_the_argument(
    kind, student, teacher, tokenizer, kind_args, role, value, error
):
    models = {"model": student, "teacher_model": teacher, role: value}
    with pytest.raises(error, match=f"needs (a )?{role}"):
        kind.make(models["model"], models["teacher_model"], kind_args(), tokenizer)


PROMPT_COLUMN_REFUSAL = {
    "gkd": r"neither 'messages' nor 'prompt'; it has \['answer', 'question'\]",
    "distillation": r"train_dataset has no 'prompt' column; it has \['answer', 'question'\]",
}


def test_dataset_without_messages_or_prompt_fails_before_training(kind, student, teacher, tokenizer, kind_args):
    dataset = Dataset.from_list([{"question": "2+2?", "answer": "4"}])
    with pytest.raises(ValueError, match=PROMPT_COLUMN_REFUSAL[kind.name]):
        kind.make(student, teacher, kind_args(), tokenizer, dataset=dataset)


def test_eval_dataset_without_prompts_fails_before_training(kind, student, teacher, tokenizer, kind_args):
    bad = Dataset.from_list([{"question": "2+2?"}])
    with pytest.raises(ValueError, match=r"it has \['question'\]"):
        kind.make(student, teacher, kind_args(), tokenizer, eval_dataset={"held_out": bad})


def test_chat_messages_given_to_the_distillation_trainer_name_the_fix(student, teacher, tokenizer, tmp_path):
    distillation = KINDS["distillation"]
    with pytest.raises(ValueError, match=r"'messages' is RockOPDTrainer's format.*prompts_only\(dataset\)"):
        distillation.make(student, teacher, distillation.args(tmp_path), tokenizer, dataset=make_dataset(4))


# -------------------------------------------------------------------------------------- prompt lengths ----
def long_prompt_dataset(n_words):
    return Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": "short?"}, {"role": "assistant", "content": "yes"}]},
            {"messages": [{"role": "user", "content": "word " * n_words}, {"role": "assistant", "content": "ok"}]},
        ]
    )


def test_prompt_longer_than_max_length_fails_at_start_naming_it(student, teacher, tokenizer, args_factory):
    # RockOPDTrainer only: RockDistillationTrainer has no max_length and never truncates a prompt.
    args = args_factory(max_length=32)
    with pytest.raises(PromptTooLongError, match=r"1 of 2 prompts are longer than max_length=32: #1 \(\d+ tokens\)"):
        KINDS["gkd"].make(student, teacher, args, tokenizer, dataset=long_prompt_dataset(40))


def test_prompt_is_kept_whole_when_the_dataset_answer_does_not_fit(tokenizer):
    messages = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "The sum is 42. So 42."}]
    prompt_ids = tokenizer(
        tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    max_length = len(prompt_ids) + 10
    ours = OnPolicyChatMLCollator(tokenizer=tokenizer, max_length=max_length)([{"messages": messages}])
    assert ours["prompts"][0].tolist() == prompt_ids
    assert ours["input_ids"].shape[1] == max_length
    assert int((ours["labels"] != -100).sum()) == 10  # the dataset answer is what got shortened
    # TRL's collator keeps the last max_length tokens instead and so cuts the question.
    trl = DataCollatorForChatML(tokenizer=tokenizer, max_length=max_length)([{"messages": messages}])
    assert trl["prompts"][0].tolist() != prompt_ids


def test_prompt_only_examples_are_accepted(tokenizer):
    batch = OnPolicyChatMLCollator(tokenizer=tokenizer, max_length=64)(
        [{"prompt": [{"role": "user", "content": "Hi"}]}, {"prompt": "<|im_start|>user\nHey<|im_end|>\n"}]
    )
    assert batch["prompts"].shape[0] == 2
    assert (batch["labels"] == -100).all()


# ---------------------------------------------------------------------------------------- completions ----
def test_empty_completion_for_every_prompt_trains_on_the_eos_token(kind, student, teacher, tokenizer, kind_args):
    trainer = kind.make(student, teacher, kind_args(max_steps=2), tokenizer)
    # The student can only say eos: every completion is the empty answer.
    trainer.generation_config.suppress_tokens = [i for i in range(len(tokenizer)) if i != tokenizer.eos_token_id]
    trainer.train()
    assert logged(trainer, "completions/mean_length") == [1.0, 1.0]
    assert logged(trainer, "completions/clipped_ratio") == [0.0, 0.0]
    losses = logged(trainer, "loss")
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)


def test_completion_at_the_length_limit_is_scored_and_reported_as_clipped(
    kind, student, teacher, tokenizer, kind_args
):
    trainer = kind.make(student, teacher, kind_args(max_steps=2, max_new_tokens=7), tokenizer)
    # Neither eos nor pad: every completion runs to the limit, and its last token is an ordinary one.
    trainer.generation_config.suppress_tokens = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    seen = []
    original = trainer.compute_loss

    def spy(model, inputs, *args, **kwargs):
        seen.append(kind.view(inputs)["labels"].clone())
        return original(model, inputs, *args, **kwargs)

    trainer.compute_loss = spy
    trainer.train()
    assert logged(trainer, "completions/mean_length") == [7.0, 7.0]
    assert logged(trainer, "completions/clipped_ratio") == [1.0, 1.0]
    # The last generated token (the final column) is a scored label in every row.
    assert seen and all((labels[:, -1] != -100).all() for labels in seen)
    assert all(math.isfinite(x) for x in logged(trainer, "loss"))


# ------------------------------------------------------------------------------------ special tokens ----
def test_teacher_with_another_eos_is_warned_about(kind, student, teacher, tokenizer, kind_args, caplog):
    teacher.generation_config.eos_token_id = 3
    teacher.config.eos_token_id = 3
    with caplog.at_level(logging.WARNING):
        kind.make(student, teacher, kind_args(), tokenizer)
    assert "end with eos id(s) 256 ('<|im_end|>'), but the teacher's eos is 3" in caplog.text


def test_teacher_with_another_pad_id_gives_the_same_loss(kind, tokenizer, kind_args):
    def loss_with(pad_id):
        student = build_tiny_causal_lm(tokenizer, seed=0)
        teacher = build_tiny_causal_lm(tokenizer, seed=1, num_hidden_layers=3)
        teacher.config.pad_token_id = pad_id
        teacher.generation_config.pad_token_id = pad_id
        trainer = kind.make(student, teacher, kind_args(), tokenizer)
        return trainer.compute_loss(trainer.model, kind.batch(trainer)).item()

    # Padding is masked by position (attention mask, labels), never matched by id.
    assert loss_with(tokenizer.pad_token_id) == loss_with(0)


# ---------------------------------------------------------------------------------------- rock sets ----
def test_rock_set_from_another_tokenizer_of_the_same_size_names_the_file(
    kind, student, teacher, tokenizer, kind_args, tmp_path
):
    path = tmp_path / "rock_set.json"
    save_rock_set(path, [{"token_id": 65, "token": "zz"}, {"token_id": 66, "token": tokenizer.decode([66])}],
                  vocab_size=len(tokenizer), tokenizer_name="other/tokenizer")
    args = kind_args(rock_policy="rock_freeze", rock_policy_kwargs={"token_ids": str(path)})
    with pytest.raises(ValueError, match=r"rock_set.json' was made with another tokenizer \('other/tokenizer'\): 1 of"):
        kind.make(student, teacher, args, tokenizer)


def test_rock_set_from_the_same_tokenizer_is_accepted(kind, student, teacher, tokenizer, kind_args, tmp_path):
    path = tmp_path / "rock_set.json"
    save_rock_set(path, [{"token_id": 65, "token": tokenizer.decode([65])}], vocab_size=len(tokenizer))
    args = kind_args(rock_policy="rock_freeze", rock_policy_kwargs={"token_ids": str(path)})
    assert kind.make(student, teacher, args, tokenizer).rock_policy.rock_ids() == [65]


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not valid JSON"),
        ('{"token_ids": []}', "has an empty token_ids list"),
        ('{"token_ids": [5, 100000]}', r"ids outside the vocabulary \[0, 259\)"),
        ('{"token_ids": [5], "vocab_size": 49152}', "was made for a vocabulary of 49152 tokens"),
    ],
)
def test_bad_rock_set_files_fail_at_trainer_creation_naming_the_file(
    kind, student, teacher, tokenizer, kind_args, tmp_path, content, message
):
    path = tmp_path / "bad_rocks.json"
    path.write_text(content)
    args = kind_args(rock_policy="rock_freeze", rock_policy_kwargs={"token_ids": str(path)})
    with pytest.raises(ValueError, match="bad_rocks.json") as err:
        kind.make(student, teacher, args, tokenizer)
    assert err.match(message)


def test_messages_without_an_answer_are_all_prompt(tokenizer):
    """A dataset of questions only (no assistant turn) is valid on-policy data: the whole conversation is the prompt."""
    from hf_rockopd.trainers.data import OnPolicyChatMLCollator

    collator = OnPolicyChatMLCollator(tokenizer=tokenizer, max_length=128)
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt_ids, completion_ids = collator.split({"messages": question})
    expected = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    assert prompt_ids == tokenizer(expected, add_special_tokens=False)["input_ids"] and completion_ids == []
    with pytest.raises(ValueError, match="empty `messages` list"):
        collator.split({"messages": []})
