"""`RockTokenArguments`: the rock-token fields that every trainer config of the package adds to its TRL base.

[`~hf_rockopd.trainers.RockOPDConfig`] (on `GKDConfig`) and [`~hf_rockopd.trainers.RockDistillationConfig`] (on
`DistillationConfig`) both inherit this dataclass, so a field, its help text and its checks exist once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..policies import available_policies, build_policy_options, parse_policy_kwargs


__all__ = ["NORMALIZATIONS", "RockTokenArguments", "accelerator_supports_bf16"]

NORMALIZATIONS = ("tokens", "weights")


def _has_accelerator() -> bool:
    import torch

    return torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()


def accelerator_supports_bf16() -> bool:
    """Whether a bf16-capable accelerator (CUDA with bf16, or XPU) is present.

    Example:
    ```python
    >>> from hf_rockopd.trainers.fields import accelerator_supports_bf16
    >>> isinstance(accelerator_supports_bf16(), bool)
    True
    ```
    """
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return hasattr(torch, "xpu") and torch.xpu.is_available()


@dataclass
class RockTokenArguments:
    r"""
    The rock-token fields of a trainer config; mixed into a TRL config before it (`class C(RockTokenArguments,
    TRLConfig)`), so that TRL's fields keep their order (`output_dir` stays the first positional argument).

    Parameters:
        rock_policy (`str`, *optional*, defaults to `"uniform"`):
            Registered name of the token policy that weights each completion token (see
            `hf_rockopd.policies.available_policies()`). A policy object passed to the trainer overrides it. The
            default keeps TRL's objective (every completion token weighted 1); rocks are opt-in (`"rock_online"`,
            `"rock_freeze"`, ...), since neither the paper at full scale nor our Qwen ablation found freezing to help
            quality (docs/ablate.md).
        rock_policy_kwargs (`dict[str, Any]` or `str`, *optional*):
            Keyword arguments of the policy, as a dict or a JSON object string.
        rock_probe_fraction (`float`, *optional*, defaults to `0.0`):
            Fraction of zero-weight positions that are still scored (forward only, no gradient), so that metrics and
            online statistics keep measuring frozen tokens. `0.0` projects no frozen position at all.
        rock_policy_reset_on_resume (`bool`, *optional*, defaults to `False`):
            When resuming from a checkpoint whose policy state is missing or unreadable, continue with a fresh policy
            (with a warning) instead of failing.
        rock_normalization (`str`, *optional*, defaults to `"tokens"`):
            `"tokens"`: divide the weighted divergence sum by the number of valid completion tokens of the global
            batch (all processes and accumulation steps), so down-weighting tokens never raises the effective learning
            rate of the others. `"weights"`: divide by the sum of the weights of each micro-batch (the paper's
            soft-weight ablation, whose effective learning rate grows as tokens are frozen).
        loss_chunk_size (`int`, *optional*, defaults to `512`):
            Rows projected through the output heads at once; loss memory is `O(loss_chunk_size × vocab)`.
        loss_temperature (`float`, *optional*, defaults to `1.0`):
            Temperature of the distributions inside the divergence (the paper: 1).

        > Parameters that control a teacher outside the trainer (docs/teacher.md)

        teacher_server_url (`str` or `dict[str, str]`, *optional*):
            Base URL of a served teacher speaking vLLM's `/v1/completions` with `prompt_logprobs` (`vllm serve
            TEACHER --max-logprobs K` on a GPU, `hf-rockopd serve-teacher` on a CPU). Pass `teacher_model=None`;
            the API key, if the server wants one, comes from `$HF_ROCKOPD_TEACHER_API_KEY`. Several teachers: a dict
            name -> URL (or its JSON string), and a dataset column `teacher` naming each example's teacher
            (`RockOPDTrainer`); rock statistics are pooled over the teachers.
        teacher_top_k (`int`, *optional*):
            Teacher log-probabilities per position: required with a server (its `prompt_logprobs`); with an in-process
            teacher, truncates it to its top-k (to measure what a served teacher would cost). The loss is then the
            divergence over those ids plus a tail bin, a lower bound of the full one.
        teacher_cache (`str`, *optional*):
            Path of an offline teacher cache (`hf-rockopd teacher-cache`): the teacher's top-k of fixed sequences. A
            batch whose sequences it holds (the dataset's own completions, `lmbda < 1`) is read from it; the rest
            (the student's rollouts) goes to `teacher_server_url`, which is then required unless `lmbda=0`. Its
            top-k and temperature must be `teacher_top_k` and `loss_temperature` (a cache made otherwise is refused).
        rock_statistics_per_teacher (`bool`, *optional*, defaults to `False`):
            With several served teachers (`teacher_server_url` a dict, `RockOPDTrainer`): also count each teacher's
            token divergences and write its own rock table to `rock_tokens.json` (`per_teacher`). The frozen set
            stays pooled over the teachers.
        teacher_request_timeout (`float`, *optional*, defaults to `60.0`):
            Seconds to wait for one answer of the server.
        teacher_max_retries (`int`, *optional*, defaults to `3`):
            Further tries after a connection error, a timeout or a 5xx answer, before the step fails with an error
            naming the URL.
        teacher_retry_backoff (`float`, *optional*, defaults to `1.0`):
            Seconds before the first retry, doubled at each next one.

    Example:
    ```python
    >>> from hf_rockopd.trainers import RockDistillationConfig, RockOPDConfig
    >>> from hf_rockopd.trainers.fields import RockTokenArguments
    >>> issubclass(RockOPDConfig, RockTokenArguments) and issubclass(RockDistillationConfig, RockTokenArguments)
    True
    ```
    """

    rock_policy: str = field(
        # Uniform by default: a drop-in GKD / Distillation user keeps TRL's objective. The paper's full-scale runs
        # scored uniform 48.1 against rock-freeze 44.3 (arXiv 2605.09253), and examples/reports/qwen_ablation found
        # no quality difference; rocks are a choice to measure, not a default.
        default="uniform",
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
    teacher_server_url: dict[str, str] | str | None = field(
        default=None,
        metadata={
            "help": "Base URL of a served teacher (vLLM's /v1/completions with prompt_logprobs; `vllm serve` on a GPU, "
            "`hf-rockopd serve-teacher` on a CPU), or a JSON dict name -> URL for several teachers (a dataset column "
            "`teacher` names each example's). Pass teacher_model=None."
        },
    )
    teacher_top_k: int | None = field(
        default=None,
        metadata={
            "help": "Teacher log-probabilities per position: required with a server; with an in-process teacher, "
            "truncates it to its top-k. The loss is then over those ids plus a tail bin."
        },
    )
    teacher_cache: str | None = field(
        default=None,
        metadata={
            "help": "Offline teacher cache (hf-rockopd teacher-cache): fixed sequences are read from it, the rest goes "
            "to teacher_server_url (required unless lmbda=0). Its top-k must be teacher_top_k."
        },
    )
    rock_statistics_per_teacher: bool = field(
        default=False,
        metadata={"help": "Several served teachers: also write each teacher's own rock table to rock_tokens.json "
                  "(the frozen set stays pooled)."},
    )
    teacher_request_timeout: float = field(
        default=60.0, metadata={"help": "Seconds to wait for one answer of the teacher server."}
    )
    teacher_max_retries: int = field(
        default=3,
        metadata={"help": "Further tries after a connection error, a timeout or a 5xx answer of the teacher server."},
    )
    teacher_retry_backoff: float = field(
        default=1.0, metadata={"help": "Seconds before the first retry, doubled at each next one."}
    )

    def _prepare_trl_defaults(self) -> None:
        """What both configs adjust before TRL's own `__post_init__` runs."""
        self._bf16_off_without_accelerator()
        self._quiet_library_defaults()
        # Parsed before transformers' own parse of dict fields, whose bare `json.loads` error names neither the field
        # nor the value.
        self.rock_policy_kwargs = parse_policy_kwargs(self.rock_policy_kwargs)

    def _bf16_off_without_accelerator(self) -> None:
        # TRL turns bf16 on when unset; on a machine without a bf16 accelerator that is an error in transformers.
        # Fall back to float32 there, so the same script runs on a laptop and on a GPU. Call before TRL's checks.
        if self.bf16 is None and not self.fp16 and not self.use_cpu and not accelerator_supports_bf16():
            self.bf16 = False

    def _quiet_library_defaults(self) -> None:
        # TRL's SFT-based configs default the deprecated `gradient_checkpointing` to True, and transformers warns
        # about it on every config; hand TRL's default to the new name, so a config warns only about what a user
        # wrote (any other value keeps the warning). Pinned memory means nothing without an accelerator.
        if getattr(self, "activation_checkpointing", False) is None and self.gradient_checkpointing is True:
            self.activation_checkpointing, self.gradient_checkpointing = True, None
        if self.dataloader_pin_memory and not _has_accelerator():
            self.dataloader_pin_memory = False

    def _check_length(self, name: str) -> None:
        """`ValueError` unless the length field `name` (`max_new_tokens`, `max_completion_length`) is an integer >= 1;
        TRL's configs accept 0 and negative counts, which leave no completion token to train on."""
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1 (new tokens per completion), got {value!r}.")

    def _check_rock_fields(self) -> None:
        """Range checks of the fields above (`ValueError` naming the field and the value), and the policy options
        parsed and checked by the policy's options dataclass."""
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
        self._check_teacher_fields()

    def _check_teacher_cache(self) -> None:
        """The cache's settings (its file's metadata only) against this config, before any model loads."""
        from ..teachers.cache import TeacherCache

        settings = TeacherCache.read_settings(self.teacher_cache)  # a missing or foreign file: its own error
        if self.teacher_top_k is None:
            raise ValueError(
                f"teacher_top_k is required with teacher_cache: the cache {self.teacher_cache!r} holds top-"
                f"{settings.top_k}; set teacher_top_k={settings.top_k}."
            )
        problems = settings.mismatches(top_k=self.teacher_top_k, temperature=self.loss_temperature)
        if problems:
            raise ValueError(
                f"teacher_cache {self.teacher_cache!r} was made with other settings ({'; '.join(problems)}). Rebuild "
                "it with `hf-rockopd teacher-cache` at these settings, or match them."
            )
        lmbda = getattr(self, "lmbda", 1.0)  # RockDistillationConfig has none: every batch is a rollout
        if self.teacher_server_url is None and lmbda > 0:
            raise ValueError(
                f"teacher_cache without teacher_server_url needs lmbda=0 (RockOPDConfig; got {lmbda}): a cache holds "
                "fixed sequences only, and the student's rollouts are new text that only a live teacher can score. "
                "Set teacher_server_url, or lmbda=0 for purely off-policy distillation from the cache."
            )
        if getattr(self, "seq_kd", False):
            raise ValueError("seq_kd=True generates with the teacher, which a teacher_cache cannot; set seq_kd=False.")

    def _check_teacher_fields(self) -> None:
        """The served / top-k teacher's fields, checked before any model loads."""
        url, k = self.teacher_server_url, self.teacher_top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"teacher_top_k must be an integer >= 1, got {k!r}.")
        urls = url if isinstance(url, dict) else {"": url} if url is not None else {}
        if isinstance(url, dict) and not url:
            raise ValueError("teacher_server_url is an empty dict: give at least one name -> URL.")
        for name, one in urls.items():
            if not isinstance(name, str) or (isinstance(url, dict) and not name):
                raise ValueError(f"teacher_server_url: teacher names must be non-empty strings, got {name!r}.")
            if not isinstance(one, str) or not one.startswith(("http://", "https://")):
                shown = f"teacher_server_url[{name!r}]" if name else "teacher_server_url"
                raise ValueError(f"{shown} must be an http(s) URL such as http://127.0.0.1:8000, got {one!r}.")
        if url is not None:
            if k is None:
                raise ValueError(
                    "teacher_top_k is required with teacher_server_url: the number of log-probabilities the server "
                    "returns per position (vLLM's prompt_logprobs; what k costs: docs/teacher.md)."
                )
            if self.loss_temperature != 1.0:
                raise ValueError(
                    f"loss_temperature={self.loss_temperature} cannot be used with a served teacher: vLLM's prompt "
                    "log-probabilities are at temperature 1, and a truncated distribution cannot be re-tempered "
                    "exactly. Use loss_temperature=1.0, or an in-process teacher."
                )
        if self.teacher_cache is not None:
            self._check_teacher_cache()
        if self.rock_statistics_per_teacher and not isinstance(url, dict):
            raise ValueError(
                "rock_statistics_per_teacher=True needs several served teachers (teacher_server_url as a dict name -> "
                f"URL), got teacher_server_url={url!r}."
            )
        if not math.isfinite(self.teacher_request_timeout) or self.teacher_request_timeout <= 0:
            raise ValueError(f"teacher_request_timeout must be > 0 seconds, got {self.teacher_request_timeout}.")
        retries = self.teacher_max_retries
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"teacher_max_retries must be an integer >= 0, got {retries!r}.")
        if not math.isfinite(self.teacher_retry_backoff) or self.teacher_retry_backoff < 0:
            raise ValueError(f"teacher_retry_backoff must be >= 0 seconds, got {self.teacher_retry_backoff}.")
