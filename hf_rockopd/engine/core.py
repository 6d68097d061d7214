"""`RockTokenEngine`: everything a trainer does around its loss to train with token weights, in one component.

A trainer base (TRL's `GKDTrainer` for `RockOPDTrainer`, `DistillationTrainer` next) keeps its own generation, data
and training loop, builds one engine after its models are prepared, and hands it each micro-batch:

- set-up: the policy is built from the config (or given) before any model loads ([`build_policy`]); the engine checks
  that student and teacher share a vocabulary, that a rock-set file matches the tokenizer and that both models stop
  on the same ids, and sets the policy up for the vocabulary;
- the loss: [`RockTokenEngine.plan`] weights the positions and picks the rows to project,
  [`RockTokenEngine.project_causal_lm`] (or [`RockTokenEngine.project_hidden`] on hidden states a trainer
  computed itself) runs the heads on those rows only, [`RockTokenEngine.finish`] normalizes, updates the policy and
  logs `rock/*`; [`RockTokenEngine.compute_loss`] chains the three;
- [`RockTokenEngine.count_completions`]: the accumulation step's global token count (the `"tokens"` normalizer) and
  the `completions/*` metrics, in one gather;
- files: the policy state in checkpoints and `rock_tokens.json`.
"""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping, Sequence
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn as nn
from transformers.utils import logging
from trl.models.utils import _ForwardRedirection

from ..losses import weighted_loss
from ..models.introspection import backbone, check_same_vocabulary, special_token_ids, vocab_size
from ..policies import TokenBatch, TokenPolicy, get_policy
from ..policies.rock_set import check_rock_set_tokenizer, write_rock_tokens
from .per_teacher import PerTeacherStatistics
from ..teachers import TopKTeacher
from .metrics import completion_sums, gather_sum, log_completion_metrics, log_rock_metrics, rock_metric_sums
from .sharding import check_fsdp_setup, fsdp_requested, gathered_heads
from .state import load_policy_state, save_policy_state
from .weighting import (
    LossPlan,
    Projection,
    check_finite,
    checked_weights,
    fill_scores,
    normalizer,
    probe_rows,
    project_rows,
)


logger = logging.get_logger(__name__)

__all__ = ["RockArguments", "RockTokenEngine", "build_policy", "check_supported_setup", "zero3_refusal"]


class RockArguments(Protocol):
    """The fields of a trainer config the engine reads (all of them are in [`~hf_rockopd.trainers.RockOPDConfig`])."""

    beta: float
    seed: int
    loss_temperature: float
    loss_chunk_size: int
    rock_normalization: str
    rock_probe_fraction: float
    rock_policy: str
    rock_policy_kwargs: dict[str, Any] | None
    rock_policy_reset_on_resume: bool


def build_policy(rock_policy: TokenPolicy | str | None, args: RockArguments) -> TokenPolicy:
    """The trainer's policy: `rock_policy` itself, or the registered name (`args.rock_policy` when `None`) built with
    `args.rock_policy_kwargs`. Build it before loading models, so a bad name or option fails in seconds.

    Example:
    ```python
    >>> from types import SimpleNamespace
    >>> from hf_rockopd.engine import build_policy
    >>> build_policy(None, SimpleNamespace(rock_policy="rock_freeze", rock_policy_kwargs={"token_ids": [3]})).name
    'rock_freeze'
    ```
    """
    if isinstance(rock_policy, TokenPolicy):
        return rock_policy
    if rock_policy is not None and not isinstance(rock_policy, str):
        raise TypeError(f"rock_policy must be a TokenPolicy or a registered name, got {type(rock_policy).__name__}.")
    return get_policy(rock_policy or args.rock_policy, **(args.rock_policy_kwargs or {}))


def check_supported_setup(
    args: Any, trainer_name: str = "RockOPDTrainer", fsdp2: bool = False, peft: bool = False
) -> None:
    """Refuse process set-ups in which the loss would be wrong, each process would train on its own, or that have not
    been run (see the distributed matrix, docs/distributed.md). Called before any model is loaded.

    `fsdp2`: the trainer shards its teacher and checks its accelerator under FSDP2 (both rock-token trainers do, see
    `engine.sharding`); any other trainer is refused FSDP outright, since it has not been run with it. `peft`: the
    student is trained through adapters (`peft_config`, or a PEFT model), which DeepSpeed ZeRO-3 needs (its head must
    be frozen; checked again on the built student, see [`RockTokenEngine`]).

    Example:
    ```python
    >>> from types import SimpleNamespace
    >>> from hf_rockopd.engine import check_supported_setup
    >>> check_supported_setup(SimpleNamespace(fsdp="", world_size=1))  # one process, no FSDP: fine
    ```
    """
    if fsdp_requested(args) and not fsdp2:
        raise ValueError(
            f"{trainer_name} does not support FSDP yet (not run); RockOPDTrainer and RockDistillationTrainer support "
            "FSDP2. Supported here: a single process and DDP (`accelerate launch --multi_gpu`, or torchrun; "
            "use_cpu=True on CPU)."
        )
    check_fsdp_setup(args, trainer_name)
    if fsdp_requested(args) and (getattr(args, "teacher_server_url", None) or getattr(args, "teacher_top_k", None)):
        raise ValueError(
            f"{trainer_name}: a served or top-k teacher (teacher_server_url / teacher_top_k) under FSDP has not been "
            "run. Use one process or DDP with it, or an in-process full-vocabulary teacher under FSDP2."
        )
    if _deepspeed_zero3(args) and not peft:
        raise ValueError(zero3_refusal(trainer_name))
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and args.world_size == 1:
        raise ValueError(
            f"This process was launched as one of WORLD_SIZE={launched} processes, but the Trainer runs "
            "single-process, so every process would train and save its own model and rock set. On a machine "
            "without GPUs set use_cpu=True (or launch with ACCELERATE_USE_CPU=true) so the processes join a gloo "
            "group; on GPUs check that CUDA is visible to every process."
        )


def zero3_refusal(trainer_name: str) -> str:
    """Why a trainable output head is refused under DeepSpeed ZeRO-3, and what to use instead.

    Run here (DeepSpeed 0.19.8, CPU, gloo): the loss calls the head per chunk of weighted rows, outside the model's
    forward; ZeRO-3's hooks make that head an autograd fallback, and its partitioned linear refuses the head's
    gradient ("LinearFunctionForZeroStage3Backward returned an invalid gradient ... expected shape compatible with
    [0]"). A frozen head (LoRA) has no such gradient, and that run equals one process.

    Example:
    ```python
    >>> from hf_rockopd.engine.core import zero3_refusal
    >>> "FSDP2" in zero3_refusal("RockOPDTrainer")
    True
    ```
    """
    return (
        f"{trainer_name} supports DeepSpeed ZeRO-3 with a frozen output head only (a LoRA/PEFT student: pass "
        "peft_config): ZeRO-3 partitions the head, and the loss, which projects the weighted rows outside the model's "
        "forward, cannot hand it a trainable head's gradient. To shard a fully fine-tuned student use FSDP2 "
        '(fsdp=True, fsdp_config={"version": 2}), or ZeRO-2.'
    )


def _deepspeed_zero3(args: Any) -> bool:
    """Whether the Trainer's `deepspeed` config or `accelerate launch --use_deepspeed --zero_stage 3` asks for ZeRO-3."""
    config = getattr(args, "hf_deepspeed_config", None)
    if config is not None and config.is_zero3():
        return True
    deepspeed_env = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true")
    return deepspeed_env and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "") == "3"


def _stop_ids(value: Any) -> set[int]:
    return set() if value is None else {int(v) for v in (value if isinstance(value, (list, tuple)) else [value])}


def warn_on_eos_mismatch(student_eos: Any, teacher: nn.Module, tokenizer: Any) -> None:
    """Completions end at the student's stop ids; a teacher that stops elsewhere scores those ends as unlikely.

    Pad ids need no check: every position is masked by the attention mask, never matched by id.
    """
    student_stop = _stop_ids(student_eos) or _stop_ids(getattr(tokenizer, "eos_token_id", None))
    teacher_generation = getattr(teacher, "generation_config", None)
    teacher_stop = _stop_ids(getattr(teacher_generation, "eos_token_id", None)) or _stop_ids(
        teacher.config.get_text_config().eos_token_id
    )
    if student_stop and teacher_stop and not student_stop & teacher_stop:

        def shown(stop: set[int]) -> str:
            return ", ".join(f"{i} ({tokenizer.decode([i])!r})" for i in sorted(stop))

        logger.warning(
            f"The student's completions end with eos id(s) {shown(student_stop)}, but the teacher's eos is "
            f"{shown(teacher_stop)}. The teacher is scored on predicting the student's eos, which it "
            "may rate as unlikely, inflating the divergence of every final token. Use one chat template for both "
            "(set teacher.generation_config.eos_token_id) unless this is intended."
        )


class RockTokenEngine:
    """The rock-token loss, metrics and files of one training run, composed into a trainer.

    Args:
        args: the trainer's config ([`RockArguments`] fields: `beta`, `loss_temperature`, `loss_chunk_size`,
            `rock_normalization`, `rock_probe_fraction`, `rock_policy_kwargs`, `rock_policy_reset_on_resume`, `seed`).
        policy: the token policy (see [`build_policy`]); `setup` is called here with the shared vocabulary size.
        student: the student, unwrapped (PEFT wrappers are fine); only checked here, each loss call gets the model.
        teacher: the teacher as the trainer holds it (possibly wrapped by accelerate); its backbone runs through
            its wrapper's forward. Or a [`~hf_rockopd.teachers.TopKTeacher`] (a served teacher, an in-process one
            truncated to its top-k): its targets are asked for each batch and the loss is the tail-bin divergence
            (`hf_rockopd.losses.sparse`).
        accelerator: the trainer's `Accelerator`, for unwrapping and for sums over processes; `None` is one process.
        tokenizer: decodes rock tokens and checks rock-set files (a processor's `tokenizer` is used).
        student_eos: the stop id(s) of the student's generation config, checked against the teacher's.

    Example:
    ```python
    >>> import torch
    >>> from types import SimpleNamespace
    >>> from hf_rockopd.engine import RockTokenEngine, build_policy
    >>> from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer
    >>> tokenizer = build_tiny_tokenizer()
    >>> student, teacher = build_tiny_causal_lm(tokenizer, seed=0), build_tiny_causal_lm(tokenizer, seed=1)
    >>> args = SimpleNamespace(beta=1.0, loss_temperature=1.0, loss_chunk_size=512, rock_normalization="tokens",
    ...                        rock_probe_fraction=0.0, rock_policy="uniform", rock_policy_kwargs={},
    ...                        rock_policy_reset_on_resume=False, seed=0)
    >>> engine = RockTokenEngine(args, build_policy(None, args), student, teacher, tokenizer=tokenizer)
    >>> ids = torch.tensor([[40, 41, 42, 43]])
    >>> inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([[-100, -100, 42, 43]])}
    >>> loss = engine.compute_loss(student, inputs, training=False)
    >>> loss.ndim, bool(loss > 0)
    (0, True)
    ```
    """

    def __init__(
        self,
        args: RockArguments,
        policy: TokenPolicy,
        student: nn.Module,
        teacher: nn.Module,
        accelerator: Any | None = None,
        tokenizer: Any | None = None,
        student_eos: int | Sequence[int] | None = None,
    ):
        self.args = args
        self.policy = policy
        self.teacher = teacher
        self.accelerator = accelerator
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        # Micro-batches trained so far; seeds the probe draw (with the step and rank). The trainer advances it.
        self.micro_step = 0
        self._redirect = _ForwardRedirection()
        # A top-k teacher is asked for targets; a model teacher's hidden states are projected through its head.
        self.topk_teacher = teacher if isinstance(teacher, TopKTeacher) else None
        if self.topk_teacher is not None:
            self.vocab_size = vocab_size(student)
            self.topk_teacher.check_vocabulary(self.vocab_size, self.tokenizer)
        else:
            unwrapped_teacher = self._unwrap(teacher)
            self.vocab_size = check_same_vocabulary(student, unwrapped_teacher)
        self._set_special_ids(student, student_eos)
        self.policy.setup(self.vocab_size)
        # Several served teachers: each one's own rock table beside the pooled set (`engine.per_teacher`).
        per_teacher = getattr(args, "rock_statistics_per_teacher", False)
        self.per_teacher = PerTeacherStatistics(self.vocab_size) if per_teacher else None
        for source in (getattr(policy, "source", None), getattr(policy, "rock_source", None)):
            if source is not None and self.tokenizer is not None:
                check_rock_set_tokenizer(source, self.tokenizer.decode)
        if self.tokenizer is not None and self.topk_teacher is None:
            warn_on_eos_mismatch(student_eos, unwrapped_teacher, self.tokenizer)
        self.has_4bit_layers = any(type(m).__name__ == "Linear4bit" for m in student.modules())
        if self.has_4bit_layers and accelerator is not None and getattr(accelerator, "is_fsdp2", False):
            raise ValueError(
                "4-bit students are supported on a single process or with DDP only, not under FSDP2 (not run: the "
                "packed weights are not sharded like floating-point ones). Drop fsdp/fsdp_config, or train a LoRA "
                "student in float precision."
            )
        head = student.get_output_embeddings()
        if _deepspeed_zero3(args) and head is not None and any(p.requires_grad for p in head.parameters()):
            raise ValueError(zero3_refusal("The trainer"))

    @property
    def num_processes(self) -> int:
        """Processes training together (1 without an accelerator)."""
        return self.accelerator.num_processes if self.accelerator is not None else 1

    def _unwrap(self, model: nn.Module) -> nn.Module:
        return self.accelerator.unwrap_model(model) if self.accelerator is not None else model

    # ------------------------------------------------------------------------------------------------- loss ----
    def plan(
        self,
        token_ids: torch.Tensor,
        mask: torch.Tensor,
        *,
        step: int,
        training: bool,
        num_items_in_batch: torch.Tensor | None = None,
        accumulation_steps: int = 1,
    ) -> LossPlan:
        """Weight the valid positions of a micro-batch and choose the rows to project.

        `token_ids[b, t]` is the token loss position `t` predicts (its label, never the input token at `t`) and `mask`
        the positions that count. `num_items_in_batch` is the accumulation step's valid-position count over all
        processes (see [`count_completions`]); `accumulation_steps` its number of micro-batches.
        """
        process = self.accelerator.process_index if self.accelerator is not None else 0
        batch = TokenBatch(token_ids=token_ids.masked_fill(~mask, 0), mask=mask, step=step, training=training)
        plan = LossPlan(
            batch=batch,
            grad_rows=mask,
            probe_rows=torch.zeros_like(mask),
            n_valid=mask.sum(),
            num_items_in_batch=num_items_in_batch,
            accumulation_steps=accumulation_steps,
        )
        if not (self.policy.needs_divergence or self.policy.needs_entropy):
            plan.weights = checked_weights(self.policy, batch)
            plan.grad_rows = plan.weights > 0
            plan.row_weights = plan.weights[plan.grad_rows]
            plan.normalizer = self._normalizer(plan, training)
        # Seeded by step and micro-step (and rank), so a resumed run probes the same positions.
        seed_key = (self.args.seed, step, self.micro_step, process)
        plan.probe_rows = probe_rows(mask & ~plan.grad_rows, self.args.rock_probe_fraction, seed_key)
        return plan

    def _normalizer(self, plan: LossPlan, training: bool) -> torch.Tensor:
        return normalizer(
            self.args.rock_normalization,
            plan.row_weights,
            plan.n_valid,
            training=training,
            num_items_in_batch=plan.num_items_in_batch,
            accumulation_steps=plan.accumulation_steps,
            num_processes=self.num_processes,
        )

    def _last_hidden_state(self, model: nn.Module, **inputs: Any) -> torch.Tensor:
        return backbone(model)(**inputs).last_hidden_state

    def project_causal_lm(self, student: nn.Module, inputs: dict[str, torch.Tensor], plan: LossPlan) -> Projection:
        """Both backbones on `inputs` (`input_ids`, `attention_mask`; loss position `t` predicts token `t + 1`), then
        the heads on the plan's rows. `student` is unwrapped: call this inside the student wrapper's forward (as
        [`compute_loss`] does) so DDP sees the computation."""
        model_inputs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "use_cache": False}
        student_hidden = self._last_hidden_state(student, **model_inputs)[:, :-1]
        if self.topk_teacher is not None:
            # Loss position t predicts token t + 1: the targets of tokens 1.. (row i of `targets` is token i's).
            needed = torch.zeros_like(inputs["attention_mask"], dtype=torch.bool)
            needed[:, 1:] = plan.grad_rows | plan.probe_rows
            targets = self.topk_targets(
                inputs["input_ids"], inputs["attention_mask"], needed, plan.batch.step, inputs.get("teacher")
            )
            return self.project_hidden(plan, student_hidden, targets[:, 1:].to(student_hidden.device), student)
        self.teacher.eval()
        teacher = self._unwrap(self.teacher)
        with torch.no_grad():
            # Through the teacher's wrapper (DeepSpeed, DDP) too, so its parameters are gathered for the forward.
            teacher_forward = partial(self._last_hidden_state, teacher)
            teacher_hidden = self._redirect(self.teacher, teacher, teacher_forward, **model_inputs)
        return self.project_hidden(plan, student_hidden, teacher_hidden[:, :-1], student)

    def project_hidden(
        self, plan: LossPlan, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, student: nn.Module
    ) -> Projection:
        """The heads of the unwrapped `student` and of the teacher on the plan's rows of hidden states a trainer
        computed (`(B, T, H)`, aligned with the plan's masks): [`project_rows`] with the config's divergence settings.
        With a top-k teacher `teacher_hidden` is its packed targets (`(B, T, 2, W)`, see [`topk_targets`]) and the
        loss is the tail-bin divergence.
        Under FSDP2 the heads are gathered once here, not per chunk (see `sharding`); otherwise they are the models'."""
        # A top-k teacher has no head: `teacher_hidden` is then its packed targets (`losses.sparse.pack_topk`).
        teacher = None if self.topk_teacher is not None else self._unwrap(self.teacher)
        with gathered_heads(student, teacher, student_hidden.dtype, teacher_hidden.dtype) as heads:
            return project_rows(
                plan,
                student_hidden,
                teacher_hidden,
                student,
                teacher,
                beta=self.args.beta,
                temperature=self.args.loss_temperature,
                chunk_size=self.args.loss_chunk_size,
                heads=heads,
            )

    def topk_targets(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        needed: torch.Tensor,
        step: int,
        routing: Sequence[str | None] | None = None,
    ) -> torch.Tensor:
        """The top-k teacher's packed targets of a batch (row `i`: token `i`), for the `needed` positions; `routing`
        names each row's teacher when several are served (the batch's `teacher` column)."""
        return self.topk_teacher.targets(input_ids, attention_mask, step=step, needed=needed, routing=routing)

    def finish(self, plan: LossPlan, projection: Projection, metrics: MutableMapping[str, list] | None) -> torch.Tensor:
        """The micro-batch's loss from its projection: weights (if decided late), normalization, the policy's update
        (training only) and the `rock/*` metrics appended to `metrics` (skipped when `None`)."""
        batch = plan.batch
        check_finite(projection, batch.step)
        fill_scores(batch, plan.grad_rows, plan.probe_rows, projection)
        if plan.weights is None:
            plan.weights = checked_weights(self.policy, batch)
            plan.row_weights = plan.weights[plan.grad_rows]
            plan.normalizer = self._normalizer(plan, batch.training)
            loss = weighted_loss(projection.grad.divergence, plan.row_weights, plan.normalizer) + projection.anchor
        else:
            loss = projection.loss + projection.anchor
        if plan.row_weights.sum() == 0:
            logger.warning(
                f"Step {batch.step}: no completion token carries weight in this micro-batch ({int(plan.n_valid)} "
                "valid, all weights 0); its loss is 0.0."
            )
        if batch.training:
            self.policy.update(batch, plan.weights)
        if metrics is not None:
            fraction = self.args.rock_probe_fraction
            sums = rock_metric_sums(batch, plan.weights, plan.grad_rows, plan.probe_rows, fraction)
            log_rock_metrics(metrics, gather_sum(sums, self.accelerator), fraction, self.policy)
        return loss

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        *,
        step: int = 0,
        training: bool | None = None,
        num_items_in_batch: torch.Tensor | None = None,
        accumulation_steps: int = 1,
        metrics: MutableMapping[str, list] | None = None,
        return_plan: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, LossPlan]:
        """The weighted distillation loss of a causal-LM batch (`input_ids`, `attention_mask`, `labels` with -100
        outside completions), as `RockOPDTrainer.compute_loss` computes it. `model` is the student as the trainer
        holds it (possibly DDP-wrapped); `training` defaults to `model.training`. With `return_plan`, `(loss, plan)`:
        the plan holds the weights and the scored divergences."""
        training = model.training if training is None else training
        target = inputs["labels"][:, 1:]
        plan = self.plan(
            target,
            target != -100,
            step=step,
            training=training,
            num_items_in_batch=num_items_in_batch,
            accumulation_steps=accumulation_steps,
        )
        student = self._unwrap(model)
        projection = self._redirect(model, student, self.project_causal_lm, student, inputs, plan)
        loss = self.finish(plan, projection, metrics)
        if self.per_teacher is not None and training:
            self.per_teacher.update(plan.batch, inputs["teacher"])
        return (loss, plan) if return_plan else loss

    def count_completions(
        self,
        labels: Sequence[torch.Tensor],
        generated: Sequence[bool],
        eos_ids: int | Sequence[int] | None,
        device: torch.device | str,
        metrics: MutableMapping[str, list] | None = None,
    ) -> torch.Tensor | None:
        """The valid completion positions of an accumulation step's micro-batches over all processes (the
        `num_items_in_batch` of [`plan`]), with the `completions/*` metrics of the `generated` ones appended to
        `metrics`, all from one gather. `None` for an empty step."""
        if not labels:
            return None
        sums = completion_sums([batch_labels.to(device) for batch_labels in labels], generated, eos_ids)
        sums = gather_sum(sums, self.accelerator)
        if metrics is not None:
            log_completion_metrics(metrics, sums)
        return sums[0].to(torch.int64)

    # ------------------------------------------------------------------------------------------------ files ----
    def save_policy_state(self, checkpoint: str | os.PathLike) -> str:
        """Write the policy's state into `checkpoint` (see `hf_rockopd.engine.state`); return the file's path."""
        return save_policy_state(self.policy, checkpoint)

    def _set_special_ids(self, student: nn.Module, student_eos: Any) -> None:
        """Tell the policy the stop and control ids (the tokenizer's, and the trainer's stop ids), which a selecting
        policy never picks as rocks; ids a user set on the policy are kept."""
        if self.policy.special_ids:
            return
        ids = _stop_ids(student_eos)
        if self.tokenizer is not None:
            ids.update(special_token_ids(self.tokenizer, student))
        self.policy.special_ids = tuple(sorted(ids))

    def load_policy_state(self, checkpoint: str | os.PathLike) -> None:
        """Restore the policy from `checkpoint`; with `rock_policy_reset_on_resume`, a missing or unreadable state
        gives a fresh policy and a warning instead of a `ValueError`."""
        try:
            load_policy_state(self.policy, checkpoint)
        except (FileNotFoundError, ValueError, KeyError, TypeError) as err:
            if self.args.rock_policy_reset_on_resume:
                logger.warning(f"Resuming from {checkpoint} with a fresh {self.policy.name!r} policy: {err}.")
                self.policy.setup(self.vocab_size)  # special_ids stay as set at construction
                return
            raise ValueError(
                f"Cannot restore the token policy from checkpoint {os.fspath(checkpoint)!r}: {err}. Resume from a "
                "complete checkpoint, or set rock_policy_reset_on_resume=True to continue with a fresh policy."
            ) from err

    def write_rock_tokens(self, directory: str | os.PathLike, step: int) -> str:
        """Write the policy's current rock set, decoded, to `directory/rock_tokens.json`; return the path."""
        return write_rock_tokens(
            directory,
            self.policy.rock_table(),
            vocab_size=self.vocab_size,
            tokenizer=self.tokenizer,
            policy=self.policy.name,
            policy_kwargs=json.loads(json.dumps(self.args.rock_policy_kwargs or {}, default=str)),
            step=step,
            teacher=self.teacher_description,
            **({"per_teacher": self.per_teacher_tables()} if self.per_teacher is not None else {}),
        )

    def per_teacher_tables(self) -> dict[str, list[dict[str, Any]]]:
        """Each served teacher's own rock table, selected as the policy selects (see `engine.per_teacher`)."""
        policy = self.policy
        return self.per_teacher.tables(
            top_k=getattr(policy, "top_k", 50), min_count=getattr(policy, "min_count", 2),
            exclude_top_frequent=getattr(policy, "exclude_top_frequent", 5), exclude_ids=policy.special_ids,
        )  # fmt: skip

    @property
    def teacher_description(self) -> dict[str, Any]:
        """What the divergences (and so the rock statistics) were measured against: the full vocabulary of an
        in-process teacher, or a top-k teacher's k and source (the divergence is then its tail-bin lower bound)."""
        if self.topk_teacher is None:
            return {"source": "in-process", "top_k": None, "divergence": "full vocabulary"}
        return {
            "source": self.topk_teacher.source,
            "top_k": self.topk_teacher.top_k,
            "divergence": "top-k + tail bin (a lower bound of the full-vocabulary divergence)",
        }
