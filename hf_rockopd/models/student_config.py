"""The student's model options of `hf-rockopd distill` and `ablate`: TRL's `ModelConfig` (LoRA, 4-bit) with distill's
defaults, and the quantization config built from it.

Example:
```python
>>> from hf_rockopd.models.student_config import StudentModelConfig
>>> StudentModelConfig(load_in_4bit=True).use_peft
True
```
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch
from trl import ModelConfig, get_quantization_config

from ..utils.checks import check_at_least, check_range

__all__ = ["StudentModelConfig", "quantization_config", "student_model_config"]


# TRL's options of a model loaded by name; distill loads its models by --teacher/--student instead.
_REFUSED_MODEL_OPTIONS = {
    "model_name_or_path": (None, "name the models with --teacher and --student"),
    "model_revision": ("main", "give a local path or a Hub id at the wanted revision"),
    "attn_implementation": (None, "the models use transformers' default attention"),
}


@dataclass
class StudentModelConfig(ModelConfig):
    r"""
    TRL's [`~trl.ModelConfig`] for the student of `hf-rockopd distill`: LoRA (`use_peft`, `lora_*`) and 4-bit or
    8-bit loading (`load_in_4bit`, `bnb_4bit_quant_type`, ...), built with `trl.get_peft_config` and
    `trl.get_quantization_config`.

    Same fields and flags as TRL's, with the defaults distill always had: adapters on all linear layers
    (`lora_target_modules=["all-linear"]`), a quantized student trains LoRA adapters (QLoRA: `load_in_4bit` implies
    `use_peft`), and the 4-bit compute dtype follows the device (bfloat16 on CUDA, float32 otherwise) unless `dtype`
    is given. TRL's options for loading a model by name (`model_name_or_path`, `model_revision`, `attn_implementation`)
    are refused: distill's models are `--teacher` and `--student`.

    Example:
    ```python
    >>> from trl import get_peft_config
    >>> from hf_rockopd.distill import StudentModelConfig
    >>> config = StudentModelConfig(load_in_4bit=True, lora_r=8)
    >>> config.use_peft, get_peft_config(config).target_modules
    (True, 'all-linear')
    >>> StudentModelConfig(lora_dropout=1.5)
    Traceback (most recent call last):
    ...
    ValueError: lora_dropout must be in [0, 1), got 1.5.
    ```
    """

    dtype: str | None = field(
        default=None,
        metadata={
            "help": "Compute dtype of a 4-bit student (default: bfloat16 on CUDA, float32 otherwise); distill loads "
            "the models in their saved dtype.",
            "choices": ["bfloat16", "float16", "float32"],
        },
    )
    lora_target_modules: list[str] | None = field(
        default_factory=lambda: ["all-linear"],
        metadata={"help": "Modules that get adapters: 'all-linear' or module names (e.g. q_proj v_proj)."},
    )

    def __post_init__(self):
        targets = [self.lora_target_modules] if isinstance(self.lora_target_modules, str) else self.lora_target_modules
        if targets is not None and any("," in target for target in targets):
            # The old DistillArguments took one comma-separated string; a module name never holds a comma.
            warnings.warn(
                "A comma-separated lora_target_modules is deprecated and will be removed in the next release; give "
                "the names separated by spaces (--lora_target_modules q_proj v_proj) or as a YAML list.",
                FutureWarning,
                stacklevel=3,
            )
            targets = [name.strip() for target in targets for name in target.split(",") if name.strip()]
        self.lora_target_modules = targets
        super().__post_init__()
        if self.load_in_4bit or self.load_in_8bit:
            self.use_peft = True  # a quantized base cannot be trained itself: QLoRA
        check_at_least(self, "lora_r", "lora_alpha")
        check_range(self, "lora_dropout", 0, 1, high_open=True)
        for name, (default, instead) in _REFUSED_MODEL_OPTIONS.items():
            value = getattr(self, name, default)
            if value != default:
                raise ValueError(f"{name} is not an option of hf-rockopd distill, got {value!r}: {instead}.")


def student_model_config(model_args: ModelConfig | None) -> StudentModelConfig:
    """`model_args` as a [`StudentModelConfig`] (a plain TRL `ModelConfig` is checked the same way).

    Example:
    ```python
    >>> from trl import ModelConfig
    >>> from hf_rockopd.models.student_config import student_model_config
    >>> student_model_config(ModelConfig(use_peft=True, lora_r=4)).lora_r
    4
    ```
    """
    if model_args is None:
        return StudentModelConfig()
    if isinstance(model_args, StudentModelConfig):
        return model_args
    return StudentModelConfig(**{f.name: getattr(model_args, f.name) for f in dataclasses.fields(ModelConfig)})


def quantization_config(model_args: StudentModelConfig):
    """The bitsandbytes config of a 4-bit or 8-bit student (None otherwise); the 4-bit compute dtype follows the device
    unless `dtype` is given."""
    if model_args.load_in_4bit and model_args.dtype is None:
        # bf16 matmuls where the accelerator has them; nf4 on the CPU computes in float32.
        model_args = dataclasses.replace(model_args, dtype="bfloat16" if torch.cuda.is_available() else "float32")
    return get_quantization_config(model_args)
