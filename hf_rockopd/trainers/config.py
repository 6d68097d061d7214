"""`RockOPDConfig`: TRL's `GKDConfig` with the paper's on-policy defaults and the rock-token fields."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl.experimental.gkd import GKDConfig

from .fields import RockTokenArguments


@dataclass
class RockOPDConfig(RockTokenArguments, GKDConfig):
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

        > Parameters that control a teacher outside the trainer (docs/teacher.md)

        teacher_server_url (`str` or `dict[str, str]`, *optional*):
            Base URL of a served teacher speaking vLLM's `/v1/completions` with `prompt_logprobs` (`vllm serve
            TEACHER --max-logprobs K` on a GPU, `hf-rockopd serve-teacher` on a CPU). Pass `teacher_model=None`;
            the API key, if the server wants one, comes from `$HF_ROCKOPD_TEACHER_API_KEY`. `seq_kd` needs an
            in-process teacher. Several teachers: a dict name -> URL (or its JSON string), and a dataset column
            `teacher` naming each example's teacher; rock statistics are pooled over the teachers.
        teacher_top_k (`int`, *optional*):
            Teacher log-probabilities per position: required with a server (its `prompt_logprobs`); with an in-process
            teacher, truncates it to its top-k (to measure what a served teacher would cost). The loss is then the
            divergence over those ids plus a tail bin, a lower bound of the full one.
        rock_statistics_per_teacher (`bool`, *optional*, defaults to `False`):
            Several served teachers: also write each teacher's own rock table to `rock_tokens.json` (`per_teacher`);
            the frozen set stays pooled.
        teacher_cache (`str`, *optional*):
            Offline teacher cache (`hf-rockopd teacher-cache`): the dataset's own completions (`lmbda < 1`) are read
            from it, rollouts go to `teacher_server_url` (required unless `lmbda=0`). Top-k and temperature must
            match; a cache made otherwise is refused.
        teacher_request_timeout (`float`, *optional*, defaults to `60.0`):
            Seconds to wait for one answer of the server.
        teacher_max_retries (`int`, *optional*, defaults to `3`):
            Further tries after a connection error, a timeout or a 5xx answer, before the step fails with an error
            naming the URL.
        teacher_retry_backoff (`float`, *optional*, defaults to `1.0`):
            Seconds before the first retry, doubled at each next one.

    Example:
    ```python
    >>> from hf_rockopd.trainers import RockOPDConfig
    >>> args = RockOPDConfig(output_dir="out", rock_policy="rock_online", rock_policy_kwargs='{"top_k": 50}')
    >>> args.rock_policy_kwargs, args.beta, args.rock_normalization
    ({'top_k': 50}, 1.0, 'tokens')
    ```
    """

    _VALID_DICT_FIELDS = GKDConfig._VALID_DICT_FIELDS + ["rock_policy_kwargs", "teacher_server_url"]

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

    def __post_init__(self):
        self._prepare_trl_defaults()
        super().__post_init__()
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}.")
        self._check_length("max_new_tokens")
        self._check_rock_fields()
        if self.teacher_server_url is not None and self.seq_kd:
            raise ValueError(
                "seq_kd=True generates completions with the teacher, which needs it in memory: it cannot be used "
                "with teacher_server_url. Set seq_kd=False, or load the teacher in process."
            )
