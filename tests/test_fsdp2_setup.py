"""Which FSDP set-ups RockOPDTrainer refuses, and why, without launching processes (the runs are in test_fsdp2.py)."""

from types import SimpleNamespace

import pytest
import torch

from hf_rockopd.engine import RockTokenEngine, build_policy, check_supported_setup
from hf_rockopd.engine.sharding import check_fsdp_accelerator, gathered_heads, is_fsdp2
from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer


def fsdp_args(**plugin):
    return SimpleNamespace(fsdp=True, world_size=1, fsdp_plugin_args={"fsdp_version": 2, "reshard_after_forward": True,
                                                                     **plugin})


def test_fsdp2_with_full_sharding_passes_the_start_up_check():
    check_supported_setup(fsdp_args(), fsdp2=True)


def test_trainers_that_do_not_shard_their_teacher_are_refused_fsdp():
    refusal = "OtherTrainer does not support FSDP yet.*RockDistillationTrainer support FSDP2"
    with pytest.raises(ValueError, match=refusal):
        check_supported_setup(fsdp_args(), "OtherTrainer")


@pytest.mark.parametrize("version", [1, "1"])
def test_fsdp1_is_refused_with_the_fsdp2_setting_to_use(version):
    with pytest.raises(ValueError, match=r'supports FSDP2 only.*fsdp_config=\{"version": 2\}.*--fsdp_version 2'):
        check_supported_setup(fsdp_args(fsdp_version=version), fsdp2=True)


def test_accelerate_launch_fsdp2_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    check_supported_setup(SimpleNamespace(fsdp=None, world_size=1, fsdp_plugin_args=None), fsdp2=True)
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(ValueError, match="this run sets cpu_offload"):
        check_supported_setup(SimpleNamespace(fsdp=None, world_size=1, fsdp_plugin_args=None), fsdp2=True)


@pytest.mark.parametrize(
    "plugin, named",
    [({"cpu_offload": True}, "cpu_offload"), ({"activation_checkpointing": True}, "activation_checkpointing"),
     ({"reshard_after_forward": False}, "reshard_after_forward=False")],
)
def test_untested_fsdp2_options_are_refused(plugin, named):
    with pytest.raises(ValueError, match=f"full sharding only.*this run sets {named}"):
        check_supported_setup(fsdp_args(**plugin), fsdp2=True)


def test_fsdp_that_accelerate_turned_into_ddp_is_refused():
    # accelerate 1.16 on CPU: FSDP asked for, the processes set up as MULTI_CPU (DDP).
    accelerator = SimpleNamespace(is_fsdp2=False, distributed_type="DistributedType.MULTI_CPU")
    with pytest.raises(ValueError, match="accelerate enables FSDP on GPUs.*only, not on CPU. Drop fsdp"):
        check_fsdp_accelerator(fsdp_args(), accelerator)
    check_fsdp_accelerator(SimpleNamespace(fsdp=None), accelerator)  # no FSDP asked for: DDP is what was asked


def test_hsdp_meshes_are_refused():
    accelerator = SimpleNamespace(is_fsdp2=True, parallelism_config=SimpleNamespace(fsdp_dim_names=("dp_replicate",
                                                                                                      "dp_shard")))
    with pytest.raises(ValueError, match="one data-parallel mesh dimension only"):
        check_fsdp_accelerator(fsdp_args(), accelerator)


def test_4bit_students_are_refused_under_fsdp2():
    class Linear4bit(torch.nn.Linear):  # the class name is what the engine recognizes
        pass

    tokenizer = build_tiny_tokenizer()
    student, teacher = build_tiny_causal_lm(tokenizer, seed=0), build_tiny_causal_lm(tokenizer, seed=1)
    student.model.layers[0].mlp.up_proj = Linear4bit(32, 64)
    args = SimpleNamespace(rock_policy="uniform", rock_policy_kwargs={})
    accelerator = SimpleNamespace(is_fsdp2=True, unwrap_model=lambda m: m, num_processes=2, process_index=0)
    with pytest.raises(ValueError, match="4-bit students are supported on a single process or with DDP only"):
        RockTokenEngine(args, build_policy(None, args), student, teacher, accelerator=accelerator)


def test_unsharded_models_keep_their_own_heads():
    student, teacher = build_tiny_causal_lm(seed=0), build_tiny_causal_lm(seed=1)
    assert not is_fsdp2(student)
    with gathered_heads(student, teacher) as (student_head, teacher_head):
        assert student_head is student.lm_head and teacher_head is teacher.lm_head


def test_deepspeed_zero3_is_refused_without_adapters_and_zero2_is_not(monkeypatch):
    zero3 = SimpleNamespace(fsdp=None, world_size=1, hf_deepspeed_config=SimpleNamespace(is_zero3=lambda: True))
    with pytest.raises(ValueError, match="ZeRO-3 with a frozen output head only.*use FSDP2"):
        check_supported_setup(zero3)
    check_supported_setup(zero3, peft=True)  # a LoRA student: run, equal to one process (test_fsdp2_deepspeed.py)
    check_supported_setup(SimpleNamespace(fsdp=None, world_size=1, hf_deepspeed_config=SimpleNamespace(
        is_zero3=lambda: False)))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(ValueError, match="ZeRO-3"):
        check_supported_setup(SimpleNamespace(fsdp=None, world_size=1))


def test_a_trainable_head_is_refused_under_zero3_once_the_student_is_built():
    # PEFT with the head trained (`modules_to_save=["lm_head"]`) passes the start-up check; the built student does not.
    tokenizer = build_tiny_tokenizer()
    student, teacher = build_tiny_causal_lm(tokenizer, seed=0), build_tiny_causal_lm(tokenizer, seed=1)
    args = SimpleNamespace(rock_policy="uniform", rock_policy_kwargs={},
                           hf_deepspeed_config=SimpleNamespace(is_zero3=lambda: True))
    with pytest.raises(ValueError, match="ZeRO-3 with a frozen output head only"):
        RockTokenEngine(args, build_policy(None, args), student, teacher)
    student.lm_head.requires_grad_(False)
    RockTokenEngine(args, build_policy(None, args), student, teacher)
