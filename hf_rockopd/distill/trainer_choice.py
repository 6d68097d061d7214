"""Which trainer `hf-rockopd distill` runs: `--trainer gkd` ([`~hf_rockopd.RockOPDTrainer`], the default) or
`--trainer distillation` ([`~hf_rockopd.RockDistillationTrainer`], with `--use_vllm`/`--vllm_mode`).

distill's options are parsed once, as a [`~hf_rockopd.RockOPDConfig`]; [`distillation_config`] carries them over to
a [`~hf_rockopd.RockDistillationConfig`], and refuses the GKD-only settings that would otherwise change silently.

Example:
```python
>>> from hf_rockopd import RockOPDConfig
>>> from hf_rockopd.distill.trainer_choice import distillation_config
>>> config = distillation_config(RockOPDConfig(output_dir="out", max_new_tokens=32, beta=0.5, report_to="none"))
>>> type(config).__name__, config.max_completion_length, config.beta, config.use_vllm
('RockDistillationConfig', 32, 0.5, False)
```
"""

from __future__ import annotations

import dataclasses
from typing import Any

from datasets import Dataset

from ..trainers.config import RockOPDConfig
from ..trainers.distillation_config import RockDistillationConfig


__all__ = ["TRAINER_CHOICES", "VLLM_MODES", "build_trainer", "distillation_config", "prompts_only"]

TRAINER_CHOICES = ("gkd", "distillation")
VLLM_MODES = ("colocate", "server")

# GKDConfig/SFTConfig fields without a DistillationConfig counterpart that change what is trained; refused unless
# they hold these values (the others, e.g. packing or dataset_text_field, never applied to on-policy prompts).
_GKD_ONLY = {"lmbda": 1.0, "seq_kd": False}
# Kept at DistillationConfig's value: GKDTrainer forces it off itself, SFTConfig's default is on.
_NOT_CARRIED = {"remove_unused_columns"}


def distillation_config(
    args: RockOPDConfig, use_vllm: bool = False, vllm_mode: str = "colocate"
) -> RockDistillationConfig:
    """`args` as a [`~hf_rockopd.RockDistillationConfig`]: every field both configs have, `max_new_tokens` as
    `max_completion_length`, `loss_temperature` as set, plus the vLLM settings. `ValueError` for a GKD-only setting
    (`lmbda` below 1, `seq_kd`): `DistillationTrainer` is always on-policy.

    Example: see the module docstring.
    """
    for name, default in _GKD_ONLY.items():
        if getattr(args, name) != default:
            raise ValueError(
                f"{name}={getattr(args, name)!r} is a GKDTrainer option; --trainer distillation is always on-policy "
                f"(the student generates every completion). Keep {name}={default!r} or use --trainer gkd."
            )
    targets = {f.name for f in dataclasses.fields(RockDistillationConfig) if f.init} - _NOT_CARRIED
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init and f.name in targets}
    values.update(max_completion_length=args.max_new_tokens, use_vllm=use_vllm, vllm_mode=vllm_mode)
    return RockDistillationConfig(**values)


def prompts_only(dataset: Dataset) -> Dataset:
    """Conversations (`messages`) as `DistillationTrainer`'s prompts: every turn before the first assistant turn.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> from hf_rockopd.distill.trainer_choice import prompts_only
    >>> rows = Dataset.from_list([{"messages": [{"role": "user", "content": "2+3?"},
    ...                                         {"role": "assistant", "content": "5"}]}])
    >>> prompts_only(rows)[0]["prompt"]
    [{'role': 'user', 'content': '2+3?'}]
    ```
    """

    def to_prompt(row: dict[str, Any]) -> dict[str, Any]:
        turns = row["messages"]
        first_answer = next((i for i, turn in enumerate(turns) if turn["role"] == "assistant"), len(turns))
        return {"prompt": turns[:first_answer]}

    return dataset.map(to_prompt, remove_columns=dataset.column_names)


def build_trainer(
    trainer: str,
    *,
    student: Any,
    teacher: Any,
    args: RockOPDConfig | RockDistillationConfig,
    train_dataset: Dataset,
    tokenizer: Any,
    peft_config: Any = None,
    use_vllm: bool = False,
    vllm_mode: str = "colocate",
):
    """The trainer distill runs: [`~hf_rockopd.RockOPDTrainer`] (`"gkd"`) on `messages`, or
    [`~hf_rockopd.RockDistillationTrainer`] (`"distillation"`) on the prompts of those messages (`args` converted
    with [`distillation_config`] unless it already is a `RockDistillationConfig`).

    Example: `hf_rockopd.distill.run_distillation` calls it with the parsed `--trainer`.
    """
    if trainer == "gkd":
        from ..trainers.gkd import RockOPDTrainer

        return RockOPDTrainer(
            model=student,
            teacher_model=teacher,
            args=args,
            train_dataset=train_dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    if trainer == "distillation":
        from ..trainers.distillation import RockDistillationTrainer

        if not isinstance(args, RockDistillationConfig):
            args = distillation_config(args, use_vllm=use_vllm, vllm_mode=vllm_mode)
        return RockDistillationTrainer(
            model=student,
            teacher_model=teacher,
            args=args,
            train_dataset=prompts_only(train_dataset),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    raise ValueError(f"trainer must be one of {', '.join(TRAINER_CHOICES)}, got {trainer!r}.")
