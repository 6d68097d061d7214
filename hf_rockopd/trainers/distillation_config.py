"""`RockDistillationConfig`: TRL's stable `DistillationConfig` with the rock-token fields."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import DistillationConfig

from .fields import RockTokenArguments


__all__ = ["RockDistillationConfig"]


@dataclass
class RockDistillationConfig(RockTokenArguments, DistillationConfig):
    r"""
    Configuration class for [`RockDistillationTrainer`].

    Everything of [`~trl.DistillationConfig`] (and so of `TrainingArguments`) applies with TRL's defaults: vLLM
    generation (`use_vllm`, `vllm_mode="colocate"` or `"server"`), tools, `max_completion_length`, `beta=1.0`,
    `temperature=1.0`, `learning_rate=1e-6`. The rock-token fields are those of [`RockOPDConfig`] (shared through
    [`~hf_rockopd.trainers.fields.RockTokenArguments`]), with one difference below.

    Parameters:
        loss_temperature (`float`, *optional*):
            Temperature of the distributions inside the divergence. Unset (the default), it is `temperature`, as in
            `DistillationTrainer`, which samples and scores at one temperature. [`RockOPDConfig`] defaults it to 1.0.
        rock_policy, rock_policy_kwargs, rock_probe_fraction, rock_policy_reset_on_resume, rock_normalization,
        loss_chunk_size:
            As in [`RockOPDConfig`] (`rock_policy` defaults to `"uniform"`).
        teacher_server_url, teacher_top_k, teacher_cache, rock_statistics_per_teacher, teacher_request_timeout,
        teacher_max_retries, teacher_retry_backoff:
            A teacher outside the trainer, as in [`RockOPDConfig`]. With a server the loss temperature must be 1, so
            `temperature` (its default) must be 1 too, or `loss_temperature=1.0` set. Every batch here is a rollout,
            so a `teacher_cache` needs a server beside it and is only read for sequences it holds.
        bf16 (`bool`, *optional*):
            As in TRL (on when unset), except that it stays off when no bf16-capable accelerator is present.

    Example:
    ```python
    >>> from hf_rockopd.trainers import RockDistillationConfig
    >>> args = RockDistillationConfig(output_dir="out", temperature=0.8, rock_policy="uniform", report_to="none")
    >>> args.loss_temperature, args.beta, args.rock_normalization
    (0.8, 1.0, 'tokens')
    ```
    """

    _VALID_DICT_FIELDS = DistillationConfig._VALID_DICT_FIELDS + ["rock_policy_kwargs", "teacher_server_url"]

    loss_temperature: float | None = field(
        default=None,
        metadata={
            "help": "Temperature of the distributions inside the divergence; unset, the sampling `temperature` (as "
            "in DistillationTrainer)."
        },
    )

    def __post_init__(self):
        self._prepare_trl_defaults()
        super().__post_init__()
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}.")
        if self.max_completion_length is not None:  # None is allowed by TRL (generation defaults decide the length)
            self._check_length("max_completion_length")
        if self.loss_temperature is None:
            self.loss_temperature = self.temperature
        self._check_rock_fields()
