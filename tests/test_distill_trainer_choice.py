"""`hf-rockopd distill --trainer {gkd,distillation}` and `--use_vllm/--vllm_mode`: the choice is parsed, checked
before any model loads, carried over to `RockDistillationTrainer`, and runs end to end on tiny models."""

import importlib.util
import os

import pytest
from test_distill import tiny_run  # noqa: F401 - the tiny offline teacher and data of distill's tests

from hf_rockopd import RockDistillationConfig, RockOPDConfig
from hf_rockopd.commands.distill import parse_arguments
from hf_rockopd.distill import DistillArguments, run_distillation
from hf_rockopd.distill.trainer_choice import distillation_config
from hf_rockopd.policies.rock_set import ROCK_TOKENS_NAME
from hf_rockopd.trainers.distillation import VLLM_INSTALL


def test_the_default_trainer_is_gkd_and_the_flags_parse():
    script, _, _ = parse_arguments([])
    assert (script.trainer, script.use_vllm, script.vllm_mode) == ("gkd", False, "colocate")
    script, _, _ = parse_arguments(["--trainer", "distillation", "--vllm_mode", "server"])
    assert (script.trainer, script.vllm_mode) == ("distillation", "server")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_use_vllm_without_vllm_is_refused_at_parse_time_naming_the_install_command():
    with pytest.raises(ImportError, match=VLLM_INSTALL.replace("[", r"\[").replace("]", r"\]")):
        parse_arguments(["--trainer", "distillation", "--use_vllm"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"use_vllm": True}, "use_vllm needs --trainer distillation"),
        ({"trainer": "grpo"}, "trainer must be one of gkd, distillation, got 'grpo'"),
        ({"trainer": "distillation", "vllm_mode": "remote"}, "vllm_mode must be one of colocate, server"),
    ],
)
def test_bad_trainer_choices_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        DistillArguments(**overrides)


def test_training_options_carry_over_to_the_distillation_config(tmp_path):
    args = RockOPDConfig(
        output_dir=str(tmp_path), max_new_tokens=24, beta=0.25, temperature=0.9, learning_rate=3e-4, max_steps=5,
        rock_policy="rock_freeze", rock_policy_kwargs={"token_ids": [3]}, loss_chunk_size=64, report_to="none",
    )
    config = distillation_config(args, use_vllm=False, vllm_mode="server")
    assert isinstance(config, RockDistillationConfig)
    assert (config.max_completion_length, config.beta, config.temperature) == (24, 0.25, 0.9)
    assert (config.learning_rate, config.max_steps, config.output_dir) == (3e-4, 5, str(tmp_path))
    assert (config.rock_policy, config.rock_policy_kwargs["token_ids"], config.loss_chunk_size) == (
        "rock_freeze", [3], 64
    )
    assert config.loss_temperature == args.loss_temperature == 1.0  # distill's loss temperature is kept, not 0.9
    assert config.vllm_mode == "server"


@pytest.mark.parametrize("overrides", [{"lmbda": 0.5}, {"seq_kd": True}])
def test_gkd_only_settings_are_refused_for_the_distillation_trainer(tmp_path, overrides):
    with pytest.raises(ValueError, match="always on-policy"):
        distillation_config(RockOPDConfig(output_dir=str(tmp_path), report_to="none", **overrides))


def test_distill_runs_end_to_end_with_the_distillation_trainer(tiny_run):  # noqa: F811
    _, script, args = tiny_run
    result = run_distillation(
        script(trainer="distillation", skip_eval=True, num_eval_problems=0), args(), command="hf-rockopd distill"
    )
    assert os.path.isfile(os.path.join(result.output_dir, "model.safetensors"))
    assert os.path.isfile(os.path.join(result.output_dir, ROCK_TOKENS_NAME))
    losses = [log["loss"] for log in result.report["log_history"] if "loss" in log]
    assert len(losses) == 2 and all(loss >= 0 for loss in losses)
    assert any("rock/frozen_fraction" in log for log in result.report["log_history"])
