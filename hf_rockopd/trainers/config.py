"""`RockOPDConfig`: TRL's `GKDConfig` with the paper's on-policy defaults and the rock-token fields."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trl.experimental.gkd import GKDConfig

from ..policies import available_policies, build_policy_options, parse_policy_kwargs


NORMALIZATIONS = ("tokens", "weights")


def _accelerator_supports_bf16() -> bool:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return hasattr(torch, "xpu") and torch.xpu.is_available()


@dataclass
class RockOPDConfig(GKDConfig):
    r"""
    Configuration class for [`RockOPDTrainer`].

    Everything of [`~trl.experimental.gkd.GKDConfig`] (and so of `SFTConfig` and `TrainingArguments`) applies. The
    defaults follow the on-policy stage of the rock-token paper (arXiv 2605.09253): fully on-policy (`lmbda=1.0`),
    reverse KL (`beta=1.0`) and sampling at temperature 1.

    Parameters:
        > Parameters that control on-policy distillation (changed defaults)

        lmbda (`float`, *optional*, defaults to `1.0`):
            Fraction of batches whose completions the student generates itself (on-policy).
        beta (`float`, *optional*, defaults to `1.0`):
            Generalized JSD interpolation: `0.0` forward KL `KL(teacher‖student)`, `1.0` reverse KL
            `KL(student‖teacher)`, in between the mixture form. Same convention as TRL.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature of the on-policy completions.
        bf16 (`bool`, *optional*):
            As in TRL (on when unset), except that it stays off when no bf16-capable accelerator is present.

        > Parameters that control the token policy

        rock_policy (`str`, *optional*, defaults to `"rock_online"`):
            Registered name of the token policy that weights each completion token (see
            `hf_rockopd.policies.available_policies()`). A policy object passed to the trainer overrides it.
        rock_policy_kwargs (`dict[str, Any]` or `str`, *optional*):
            Keyword arguments of the policy, as a dict or a JSON object string.
        rock_probe_fraction (`float`, *optional*, defaults to `0.0`):
            Fraction of zero-weight positions that are still scored (forward only, no gradient), so that metrics and
            online statistics keep measuring frozen tokens. `0.0` projects no frozen position at all.
        rock_policy_reset_on_resume (`bool`, *optional*, defaults to `False`):
            When resuming from a checkpoint whose policy state is missing or unreadable, continue with a fresh policy
            (with a warning) instead of failing.

        > Parameters that control the loss

        rock_normalization (`str`, *optional*, defaults to `"tokens"`):
            `"tokens"`: divide the weighted divergence sum by the number of valid completion tokens of the global
            batch (all processes and accumulation steps), so down-weighting tokens never raises the effective learning
            rate of the others. `"weights"`: divide by the sum of the weights of each micro-batch (the paper's
            soft-weight ablation, whose effective learning rate grows as tokens are frozen).
        loss_chunk_size (`int`, *optional*, defaults to `512`):
            Rows projected through the output heads at once; loss memory is `O(loss_chunk_size × vocab)`.
        loss_temperature (`float`, *optional*, defaults to `1.0`):
            Temperature of the distributions inside the divergence (the paper: 1).

    Example:
    ```python
    >>> from hf_rockopd.trainers import RockOPDConfig
    >>> args = RockOPDConfig(output_dir="out", rock_policy="rock_online", rock_policy_kwargs='{"top_k": 50}')
    >>> args.rock_policy_kwargs, args.beta, args.rock_normalization
    ({'top_k': 50}, 1.0, 'tokens')
    ```
    """

    _VALID_DICT_FIELDS = GKDConfig._VALID_DICT_FIELDS + ["rock_policy_kwargs"]

    lmbda: float = field(
        default=1.0,
        metadata={"help": "Fraction of batches whose completions the student generates itself (on-policy)."},
    )
    beta: float = field(
        default=1.0,
        metadata={
            "help": "Generalized JSD interpolation: 0.0 forward KL(teacher||student), 1.0 reverse "
            "KL(student||teacher), in between the mixture form (TRL's convention)."
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={"help": "Sampling temperature of the on-policy completions."},
    )
    rock_policy: str = field(
        default="rock_online",
        metadata={"help": "Registered name of the token policy (see hf_rockopd.policies.available_policies())."},
    )
    rock_policy_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments of the policy, as a dict or a JSON object string."},
    )
    rock_probe_fraction: float = field(
        default=0.0,
        metadata={
            "help": "Fraction of zero-weight positions still scored (forward only) for metrics and online statistics."
        },
    )
    rock_policy_reset_on_resume: bool = field(
        default=False,
        metadata={
            "help": "On resume, continue with a fresh policy when the checkpoint's policy state is missing or "
            "unreadable, instead of failing."
        },
    )
    rock_normalization: str = field(
        default="tokens",
        metadata={
            "help": "'tokens': divide by the valid completion tokens of the global batch; 'weights': divide by the "
            "sum of the weights of each micro-batch.",
            "choices": list(NORMALIZATIONS),
        },
    )
    loss_chunk_size: int = field(
        default=512,
        metadata={"help": "Rows projected through the output heads at once (loss memory is chunk x vocab)."},
    )
    loss_temperature: float = field(
        default=1.0,
        metadata={"help": "Temperature of the distributions inside the divergence."},
    )

    def __post_init__(self):
        # TRL turns bf16 on when unset; on a machine without a bf16 accelerator that is an error in transformers.
        # Fall back to float32 there, so the same script runs on a laptop and on a GPU.
        if self.bf16 is None and not self.fp16 and not self.use_cpu and not _accelerator_supports_bf16():
            self.bf16 = False
        super().__post_init__()
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}.")
        if self.rock_normalization not in NORMALIZATIONS:
            raise ValueError(
                f"rock_normalization must be one of {', '.join(NORMALIZATIONS)}, got {self.rock_normalization!r}."
            )
        if isinstance(self.loss_chunk_size, bool) or int(self.loss_chunk_size) != self.loss_chunk_size:
            raise ValueError(f"loss_chunk_size must be an integer >= 1, got {self.loss_chunk_size!r}.")
        if self.loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size must be an integer >= 1, got {self.loss_chunk_size}.")
        if not math.isfinite(self.loss_temperature) or self.loss_temperature <= 0:
            raise ValueError(f"loss_temperature must be > 0, got {self.loss_temperature}.")
        if not 0.0 <= self.rock_probe_fraction <= 1.0:
            raise ValueError(f"rock_probe_fraction must be in [0, 1], got {self.rock_probe_fraction}.")
        self.rock_policy_kwargs = parse_policy_kwargs(self.rock_policy_kwargs)
        if self.rock_policy not in available_policies():
            raise ValueError(
                f"Unknown rock_policy {self.rock_policy!r}. Available policies: {', '.join(available_policies())}. "
                "Register your own with hf_rockopd.policies.register_policy before creating the config."
            )
        # Checked by the policy's options dataclass (the one place policy options are checked), as the checked values.
        self.rock_policy_kwargs = build_policy_options(self.rock_policy, self.rock_policy_kwargs)
