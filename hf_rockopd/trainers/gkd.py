"""`RockOPDTrainer`: TRL's `GKDTrainer` with a token-weighted, chunked divergence and pluggable token policies."""

from __future__ import annotations

import json
import logging as py_logging
import os
import random
import textwrap
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl.experimental.gkd import GKDTrainer
from trl.models.utils import _ForwardRedirection, unwrap_model_for_generation

from .config import RockOPDConfig
from .data import OnPolicyChatMLCollator, check_prompt_lengths
from .losses import ChunkedDivergence, chunked_divergence, chunked_weighted_loss, weighted_loss
from .model_card import CARD_NAME, model_card_from_trainer
from .modeling import backbone, check_same_vocabulary, logits_fn
from .models import unpack_cpu_4bit_weights
from .policies import TokenBatch, TokenPolicy, get_policy
from .rock_set import check_rock_set_tokenizer, save_rock_set


logger = logging.get_logger(__name__)

POLICY_STATE_NAME = "rock_policy_state.pt"
ROCK_TOKENS_NAME = "rock_tokens.json"


@contextmanager
def _without_gkd_migration_warning():
    """Hide GKDTrainer's "fully covered by `DistillationTrainer`" warning.

    It fires for exactly our defaults (`lmbda=1`, `temperature=1`) and is wrong for us: DistillationTrainer has no
    token weights, which is the point of this trainer.
    """
    gkd_logger = py_logging.getLogger("trl.experimental.gkd.gkd_trainer")

    def drop(record: py_logging.LogRecord) -> bool:
        return "fully covered by `DistillationTrainer`" not in record.getMessage()

    gkd_logger.addFilter(drop)
    try:
        yield
    finally:
        gkd_logger.removeFilter(drop)


def _check_supported_setup(args: RockOPDConfig) -> None:
    """Refuse process set-ups in which the loss would be wrong or each process would train on its own."""
    fsdp = bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")
    if fsdp:
        # Output heads are called outside the wrapped forward (only the weighted rows are projected), which FSDP's
        # sharded parameters do not allow, and GKDTrainer leaves the teacher unsharded (TRL issue 2580).
        raise ValueError(
            "RockOPDTrainer does not support FSDP yet. Supported: a single process (GPU or CPU, LoRA and 4-bit "
            "students included) and DDP (`accelerate launch --multi_gpu`, or torchrun; on CPU-only machines set "
            "use_cpu=True for gloo). DeepSpeed goes through GKDTrainer's teacher preparation but has not been run: "
            "see the README's tested matrix."
        )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and args.world_size == 1:
        raise ValueError(
            f"This process was launched as one of WORLD_SIZE={launched} processes, but the Trainer runs "
            "single-process, so every process would train and save its own model and rock set. On a machine "
            "without GPUs set use_cpu=True (or launch with ACCELERATE_USE_CPU=true) so the processes join a gloo "
            "group; on GPUs check that CUDA is visible to every process."
        )


@dataclass
class _Projection:
    grad: ChunkedDivergence  # rows that carry weight (differentiable unless `loss` is set)
    probe: ChunkedDivergence  # zero-weight rows scored without gradient
    anchor: torch.Tensor  # 0.0 connected to the student's graph, for batches with no weighted row
    loss: torch.Tensor | None = None  # the fused weighted loss, when the weights were known before projecting


class RockOPDTrainer(GKDTrainer):
    """On-policy distillation with a token-weighted divergence and pluggable rock-token policies.

    A drop-in [`~trl.experimental.gkd.GKDTrainer`]: same arguments (a teacher given as a model or a name, `peft_config`
    for LoRA, a 4-bit student), plus `rock_policy`. Each optimizer step the student samples completions; each
    completion position is weighted by the policy according to the token it predicts, and the loss is
    `Σ weight · divergence / normalizer` (see [`RockOPDConfig`]). Hidden states are projected through the output heads
    only for the positions that carry weight, `loss_chunk_size` rows at a time, so frozen tokens cost nothing and the
    full `(batch, length, vocab)` logits never exist.

    Args:
        model, teacher_model, args, data_collator, train_dataset, eval_dataset, processing_class, compute_metrics,
        callbacks, optimizers, preprocess_logits_for_metrics, peft_config, formatting_func:
            As for `GKDTrainer`. `args` is a [`RockOPDConfig`].
        rock_policy ([`~hf_rockopd.policies.TokenPolicy`] or `str`, *optional*):
            A policy object, or a registered name; overrides `args.rock_policy` (and, with a name,
            `args.rock_policy_kwargs` still apply).

    Example:
    ```python
    from datasets import Dataset
    from hf_rockopd import RockOPDConfig, RockOPDTrainer

    prompts = Dataset.from_list([{"messages": [{"role": "user", "content": "What is 2+3?"},
                                               {"role": "assistant", "content": "5"}]}] * 8)
    trainer = RockOPDTrainer(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        teacher_model=teacher,  # a model sharing the student's vocabulary
        args=RockOPDConfig(output_dir="out", rock_policy="rock_online", max_new_tokens=64),
        train_dataset=prompts,
        processing_class=tokenizer,
    )
    trainer.train()
    ```
    """

    _tag_names = ["trl", "gkd", "hf_rockopd", "distillation", "on-policy-distillation", "rock-tokens"]
    _name = "RockOPD"
    _paper = {
        "title": "Cornerstones or Stumbling Blocks? Deciphering the Rock Tokens in On-Policy Distillation",
        "id": "2605.09253",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @misc{rocktokens2026,
                title         = {{Cornerstones or Stumbling Blocks? Deciphering the Rock Tokens in On-Policy Distillation}},
                year          = 2026,
                eprint        = {2605.09253},
                archivePrefix = {arXiv},
            }"""),
    }
    # `compute_loss` normalizes over the whole accumulated batch itself (see `get_batch_samples`).
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model: PreTrainedModel | nn.Module | str | None = None,
        teacher_model: PreTrainedModel | nn.Module | str | None = None,
        args: RockOPDConfig | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        preprocess_logits_for_metrics: Callable | None = None,
        peft_config: Any = None,
        formatting_func: Callable | None = None,
        rock_policy: TokenPolicy | str | None = None,
    ):
        if args is None:
            name = model if isinstance(model, str) else type(model).__name__
            args = RockOPDConfig(output_dir=f"{str(name).split('/')[-1]}-RockOPD")
        elif not isinstance(args, RockOPDConfig):
            raise TypeError(
                f"RockOPDTrainer needs a RockOPDConfig, got {type(args).__name__}. Build one with the same fields: "
                "RockOPDConfig(**your_config.to_dict()) or copy your settings over."
            )
        if teacher_model is None:
            raise ValueError("RockOPDTrainer needs a teacher_model (a model or a model name/path).")
        if train_dataset is not None and hasattr(train_dataset, "__len__") and len(train_dataset) == 0:
            raise ValueError("train_dataset is empty: on-policy distillation needs at least one prompt.")
        _check_supported_setup(args)
        if data_collator is None:
            if processing_class is None:
                raise ValueError(
                    "RockOPDTrainer needs processing_class: the tokenizer that student and teacher share. Pass "
                    "processing_class=AutoTokenizer.from_pretrained(<student>)."
                )
            data_collator = OnPolicyChatMLCollator(tokenizer=processing_class, max_length=args.max_length)
        if isinstance(data_collator, OnPolicyChatMLCollator):
            # Fail before any model is loaded, not at the batch that holds the first over-long prompt.
            for split in (train_dataset, *(eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset])):
                if split is not None:
                    check_prompt_lengths(split, data_collator)

        # Build the policy first, so a bad name or bad kwargs fail before any model is loaded.
        self.rock_policy = self._build_policy(rock_policy, args)

        if isinstance(teacher_model, str):
            # Loaded here rather than by GKDTrainer, which indexes `teacher_model_init_kwargs["dtype"]` and fails
            # with a KeyError when it is not given.
            init_kwargs = dict(args.teacher_model_init_kwargs or {})
            dtype = init_kwargs.get("dtype", "auto")
            if isinstance(dtype, str) and dtype != "auto":
                dtype = getattr(torch, dtype)
            init_kwargs["dtype"] = dtype
            init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
            teacher_model = AutoModelForCausalLM.from_pretrained(teacher_model, **init_kwargs)
        saved_teacher_kwargs, args.teacher_model_init_kwargs = args.teacher_model_init_kwargs, None

        with _without_gkd_migration_warning():
            super().__init__(
                model=model,
                teacher_model=teacher_model,
                args=args,
                data_collator=data_collator,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                compute_metrics=compute_metrics,
                callbacks=callbacks,
                optimizers=optimizers,
                preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                peft_config=peft_config,
                formatting_func=formatting_func,
            )
        args.teacher_model_init_kwargs = saved_teacher_kwargs

        # GKDTrainer turns the KV cache off under gradient checkpointing, which makes generation quadratic; but
        # `unwrap_model_for_generation` disables checkpointing while generating, so the cache is safe to keep.
        self.generation_kwargs["use_cache"] = True
        self.generation_config.use_cache = True

        student = self.accelerator.unwrap_model(self.model)
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        self._vocab_size = check_same_vocabulary(student, teacher)
        self.rock_policy.setup(self._vocab_size)
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        for source in (getattr(self.rock_policy, "source", None), getattr(self.rock_policy, "rock_source", None)):
            if source is not None:
                check_rock_set_tokenizer(source, tokenizer.decode)
        self._warn_on_eos_mismatch(teacher, tokenizer)
        self._forward_redirection = _ForwardRedirection()
        self._micro_step = 0
        self._accumulation_batches: list[dict[str, Any]] = []
        self._accumulation_num_items: torch.Tensor | None = None
        self._has_4bit_layers = any(type(m).__name__ == "Linear4bit" for m in student.modules())

    # ------------------------------------------------------------------------------------------------ set-up ----
    def _warn_on_eos_mismatch(self, teacher: nn.Module, tokenizer: Any) -> None:
        """Completions end at the student's stop ids; a teacher that stops elsewhere scores those ends as unlikely.

        Pad ids need no check: every position is masked by the attention mask, never matched by id.
        """

        def ids(value: Any) -> set[int]:
            return set() if value is None else {int(v) for v in (value if isinstance(value, (list, tuple)) else [value])}

        student_stop = ids(self.generation_config.eos_token_id) or ids(getattr(tokenizer, "eos_token_id", None))
        teacher_generation = getattr(teacher, "generation_config", None)
        teacher_stop = ids(getattr(teacher_generation, "eos_token_id", None)) or ids(
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

    @staticmethod
    def _build_policy(rock_policy: TokenPolicy | str | None, args: RockOPDConfig) -> TokenPolicy:
        if isinstance(rock_policy, TokenPolicy):
            return rock_policy
        if rock_policy is not None and not isinstance(rock_policy, str):
            raise TypeError(f"rock_policy must be a TokenPolicy or a registered name, got {type(rock_policy).__name__}.")
        return get_policy(rock_policy or args.rock_policy, **(args.rock_policy_kwargs or {}))

    # -------------------------------------------------------------------------------------------- generation ----
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Fetch the accumulation step's micro-batches; their completions are generated in `training_step`.

        Transformers counts `num_items_in_batch` here from the dataset labels, which on-policy generation then
        replaces. We count after generation instead (see `training_step`). Generating here would also run before the
        trainer restores the RNG state of a resumed checkpoint, so a resumed run would sample other completions.
        """
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        self._accumulation_batches = batch_samples
        self._accumulation_num_items = None
        return batch_samples, None

    def _generate_completions(self, inputs: dict[str, Any]) -> None:
        # Same coin as GKDTrainer.training_step: on-policy with probability lmbda, else teacher (seq_kd) or dataset.
        if random.random() <= self.lmbda:
            source = self.model_wrapped
            kwargs = {"gradient_checkpointing_kwargs": self.args.gradient_checkpointing_kwargs}
        elif self.seq_kd:
            source, kwargs = self.teacher_model, {}
        else:
            return
        with unwrap_model_for_generation(
            source, self.accelerator, generation_kwargs=self.generation_kwargs, **kwargs
        ) as unwrapped:
            input_ids, attention_mask, labels = self.generate_on_policy_outputs(
                unwrapped, inputs, self.generation_config
            )
        inputs["input_ids"], inputs["attention_mask"], inputs["labels"] = input_ids, attention_mask, labels
        lengths = (labels[:, 1:] != -100).sum(dim=1).float()
        self._metrics["train"]["completions/mean_length"].append(lengths.mean().item())
        eos = self.generation_config.eos_token_id
        if eos is not None:
            # A completion without eos hit max_new_tokens: it is scored as is, but a high share means the student
            # is trained on cut-off answers (raise max_new_tokens), as in TRL's GRPO `clipped_ratio`.
            eos_ids = torch.tensor(eos if isinstance(eos, (list, tuple)) else [eos], device=labels.device)
            ended = (torch.isin(labels, eos_ids) & (labels != -100)).any(dim=1)
            self._metrics["train"]["completions/clipped_ratio"].append((~ended).float().mean().item())

    def _count_completion_tokens(self, batch_samples: list[dict[str, Any]], device) -> torch.Tensor | None:
        if not batch_samples:
            return None
        local = sum((b["labels"][:, 1:] != -100).sum() for b in batch_samples).to(device)
        if self.accelerator.num_processes > 1:
            local = self.accelerator.gather(local.reshape(1)).sum()
        return local

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Generate the completions of every micro-batch of this optimizer step at its first micro-batch, then count
        their tokens over all micro-batches and processes: that count is the `"tokens"` normalizer, so the loss is
        gradient-accumulation-correct for the tokens the loss really sees."""
        if not any(batch is inputs for batch in self._accumulation_batches):
            # Called outside the training loop: the batch is its own accumulation step.
            self._accumulation_batches, self._accumulation_num_items = [inputs], None
        if self._accumulation_num_items is None:
            for batch in self._accumulation_batches:
                self._generate_completions(batch)
            self._accumulation_num_items = self._count_completion_tokens(self._accumulation_batches, self.args.device)
        self._micro_step += 1
        if self._has_4bit_layers:
            unpack_cpu_4bit_weights(model)
        # Skip GKDTrainer.training_step, which would generate again.
        return super(GKDTrainer, self).training_step(model, inputs, self._accumulation_num_items)

    # ------------------------------------------------------------------------------------------------- loss ----
    def _checked_weights(self, batch: TokenBatch) -> torch.Tensor:
        weights = self.rock_policy.weights(batch)
        name = self.rock_policy.name or type(self.rock_policy).__name__
        if not torch.is_tensor(weights) or weights.shape != batch.mask.shape:
            shape = tuple(weights.shape) if torch.is_tensor(weights) else type(weights).__name__
            raise ValueError(f"Policy {name!r} returned weights of shape {shape}; expected {tuple(batch.mask.shape)}.")
        weights = weights.to(device=batch.mask.device, dtype=torch.float32)
        valid_w = weights[batch.mask]
        if not torch.isfinite(valid_w).all() or (valid_w < 0).any():
            raise ValueError(
                f"Policy {name!r} returned negative or non-finite weights at step {batch.step} "
                f"(min {valid_w.min().item() if valid_w.numel() else 0.0}). Weights must be finite and >= 0."
            )
        return weights * batch.mask

    def _probe_rows(self, candidates: torch.Tensor) -> torch.Tensor:
        fraction = self.args.rock_probe_fraction
        if fraction <= 0 or not candidates.any():
            return torch.zeros_like(candidates)
        if fraction >= 1:
            return candidates.clone()
        # Seeded by step and micro-step (and rank), so a resumed run probes the same positions.
        generator = torch.Generator(device="cpu").manual_seed(
            hash((self.args.seed, self.state.global_step, self._micro_step, self.accelerator.process_index))
            % (2**63)
        )
        draw = torch.rand(candidates.shape, generator=generator).to(candidates.device)
        return candidates & (draw < fraction)

    def _project(
        self,
        student: nn.Module,
        inputs: dict[str, torch.Tensor],
        grad_rows: torch.Tensor,
        probe_rows: torch.Tensor,
        row_weights: torch.Tensor | None = None,
        normalizer: torch.Tensor | None = None,
    ) -> _Projection:
        """Backbones of both models, then the heads only on `grad_rows` (with gradient) and `probe_rows` (without).

        With `row_weights` (weights decided before the divergence) the weighted loss and its gradient are fused per
        chunk (`chunked_weighted_loss`, 4 matrix products per chunk); otherwise the per-row divergences stay
        differentiable for weights decided from them (`chunked_divergence`)."""
        model_inputs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "use_cache": False}
        student_hidden = backbone(student)(**model_inputs).last_hidden_state[:, :-1]

        self.teacher_model.eval()
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            teacher_hidden = self._forward_redirection(
                self.teacher_model, teacher, lambda **kw: backbone(teacher)(**kw).last_hidden_state, **model_inputs
            )[:, :-1]

        student_logits, teacher_logits = logits_fn(student), logits_fn(teacher)
        common = {
            "beta": self.beta,
            "temperature": self.args.loss_temperature,
            "chunk_size": self.args.loss_chunk_size,
        }
        loss = None
        if row_weights is None:
            grad = chunked_divergence(
                student_hidden[grad_rows], teacher_hidden[grad_rows], student_logits, teacher_logits, **common
            )
        else:
            loss, grad = chunked_weighted_loss(
                student_hidden[grad_rows],
                teacher_hidden[grad_rows],
                student_logits,
                teacher_logits,
                row_weights,
                normalizer,
                **common,
            )
        with torch.no_grad():
            probe = chunked_divergence(
                student_hidden[probe_rows], teacher_hidden[probe_rows], student_logits, teacher_logits, **common
            )
        if grad_rows.any():
            anchor = student_hidden.new_zeros(())
        else:
            # Nothing carries weight: a zero that still reaches every student parameter, so the backward pass (and
            # DDP's gradient reduction) sees the same graph as on any other batch.
            anchor = 0.0 * student_logits(student_hidden[:1, :1]).float().sum()
        return _Projection(grad=grad, probe=probe, anchor=anchor, loss=loss)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        training = self.model.training
        mode = "train" if training else "eval"
        step = self.state.global_step
        target = inputs["labels"][:, 1:]
        mask = target != -100
        # The weight of loss position t is decided by the token it predicts, labels[t + 1] (see module docstring of
        # `policies`): never by input_ids[t].
        batch = TokenBatch(token_ids=target.masked_fill(~mask, 0), mask=mask, step=step, training=training)
        policy = self.rock_policy
        scores_first = policy.needs_divergence or policy.needs_entropy

        n_valid = mask.sum()
        if scores_first:
            weights, grad_rows = None, mask
            fused = {}
        else:
            weights = self._checked_weights(batch)
            grad_rows = weights > 0
            row_weights = weights[grad_rows]
            fused = {"row_weights": row_weights, "normalizer": self._normalizer(row_weights, n_valid, num_items_in_batch)}
        probe_rows = self._probe_rows(mask & ~grad_rows)

        unwrapped = self.accelerator.unwrap_model(model)
        projection = self._forward_redirection(
            model, unwrapped, self._project, unwrapped, inputs, grad_rows, probe_rows, **fused
        )
        self._check_finite(projection.grad.divergence, projection.probe.divergence, step)

        self._fill_scores(batch, grad_rows, projection.grad, probe_rows, projection.probe)
        if scores_first:
            weights = self._checked_weights(batch)
            row_weights = weights[grad_rows]
            normalizer = self._normalizer(row_weights, n_valid, num_items_in_batch)
            loss = weighted_loss(projection.grad.divergence, row_weights, normalizer) + projection.anchor
        else:
            loss = projection.loss + projection.anchor

        if row_weights.sum() == 0:
            logger.warning(
                f"Step {step}: no completion token carries weight in this micro-batch ({int(n_valid)} valid, all "
                "weights 0); its loss is 0.0."
            )
        if training:
            policy.update(batch, weights)
        self._log_rock_metrics(mode, batch, weights, grad_rows, probe_rows)
        return (loss, None) if return_outputs else loss

    def _normalizer(
        self, row_weights: torch.Tensor, n_valid: torch.Tensor, num_items_in_batch: torch.Tensor | None
    ) -> torch.Tensor:
        """The denominator of the loss for `rock_normalization` (see [`RockOPDConfig`])."""
        training = self.model.training
        # Without a global count (evaluation, or a direct call), each micro-batch is a mean over its own tokens.
        accumulation = getattr(self, "current_gradient_accumulation_steps", 1) if training else 1
        if self.args.rock_normalization == "tokens":
            if training and num_items_in_batch is not None:
                # Global count over processes and accumulation steps; DDP then averages gradients over processes.
                return num_items_in_batch / self.accelerator.num_processes
            return n_valid * accumulation
        return row_weights.sum() * accumulation

    @staticmethod
    def _fill_scores(
        batch: TokenBatch,
        grad_rows: torch.Tensor,
        grad: ChunkedDivergence,
        probe_rows: torch.Tensor,
        probe: ChunkedDivergence,
    ) -> None:
        def scatter(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            full = torch.zeros(batch.mask.shape, dtype=torch.float32, device=batch.mask.device)
            full[grad_rows] = a.detach().float()
            full[probe_rows] = b.float()
            return full

        batch.divergence = scatter(grad.divergence, probe.divergence)
        batch.student_entropy = scatter(grad.student_entropy, probe.student_entropy)
        batch.teacher_entropy = scatter(grad.teacher_entropy, probe.teacher_entropy)
        batch.logit_grad_norm = scatter(grad.logit_grad_norm, probe.logit_grad_norm)
        batch.scored = grad_rows | probe_rows

    @staticmethod
    def _check_finite(divergence: torch.Tensor, probe: torch.Tensor, step: int) -> None:
        for values in (divergence, probe):
            bad = ~torch.isfinite(values.detach())
            if bad.any():
                raise FloatingPointError(
                    f"Non-finite per-token divergence at step {step}: {int(bad.sum())} of {values.numel()} scored "
                    "positions are NaN or inf. Check the teacher's logits (NaN/inf weights or overflow in low "
                    "precision), the loss_temperature, and that student and teacher share one tokenizer."
                )

    def _log_rock_metrics(
        self,
        mode: str,
        batch: TokenBatch,
        weights: torch.Tensor,
        grad_rows: torch.Tensor,
        probe_rows: torch.Tensor,
    ) -> None:
        mask = batch.mask
        down = mask & (weights < 1)
        frozen = mask & (weights == 0)
        other = mask & ~down
        fraction = self.args.rock_probe_fraction
        div, gnorm = batch.divergence, batch.logit_grad_norm
        # Inverse-probability weights: probed positions stand for 1/fraction positions each, so the rocks' share
        # of divergence mass and gradient is estimated without projecting every frozen token.
        inv_p = grad_rows.float() + (probe_rows.float() / fraction if fraction > 0 else 0.0)
        down_scored, other_scored = down & batch.scored, other & batch.scored
        values = torch.stack(
            [
                mask.sum(),
                down.sum(),
                frozen.sum(),
                grad_rows.sum(),
                probe_rows.sum(),
                (frozen & ~probe_rows).sum(),  # frozen and unmeasured: shares are then unknown
                div[down_scored].sum(),
                down_scored.sum(),
                div[other_scored].sum(),
                other_scored.sum(),
                (div * inv_p)[down].sum(),
                (gnorm * inv_p)[down].sum(),
                gnorm[other].sum(),
            ]
        ).double()
        if self.accelerator.num_processes > 1:
            values = self.accelerator.gather(values[None]).sum(0)
        (n_valid, n_down, n_frozen, n_grad, n_probe, n_blind, d_down, n_d_down, d_other, n_d_other,
         mass_down, g_down, g_other) = values.tolist()  # fmt: skip
        metrics = self._metrics[mode]
        if n_valid > 0:
            metrics["rock/down_weighted_fraction"].append(n_down / n_valid)
            metrics["rock/frozen_fraction"].append(n_frozen / n_valid)
            metrics["rock/projected_fraction"].append((n_grad + n_probe) / n_valid)
        if n_d_down > 0:
            metrics["rock/mean_divergence_rock"].append(d_down / n_d_down)
        if n_d_other > 0:
            metrics["rock/mean_divergence_other"].append(d_other / n_d_other)
        if n_valid > 0 and (n_blind == 0 or fraction > 0):
            if mass_down + d_other > 0:
                metrics["rock/divergence_mass_share"].append(mass_down / (mass_down + d_other))
            if g_down + g_other > 0:
                metrics["rock/grad_norm_share"].append(g_down / (g_down + g_other))
        for key, value in self.rock_policy.metrics().items():
            metrics[f"rock/{key}"].append(value)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # Distillation has no logits worth returning (they would be (B, L, V)); evaluation reports the loss only.
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # ----------------------------------------------------------------------------------------- state & files ----
    def train(self, *args, **kwargs):
        output = super().train(*args, **kwargs)
        if self.is_world_process_zero():
            self.write_rock_tokens(self.args.output_dir)
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if self.is_world_process_zero():
            self.write_rock_tokens(output_dir or self.args.output_dir)

    def _save_checkpoint(self, model, trial):
        # The policy state goes in first: a run killed while the model is being written still finds it on resume.
        if self.is_world_process_zero():
            checkpoint = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(checkpoint, exist_ok=True)
            torch.save(
                {"policy": self.rock_policy.name, "state": self.rock_policy.state_dict()},
                os.path.join(checkpoint, POLICY_STATE_NAME),
            )
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self._load_policy_state(checkpoint)

    def _load_policy_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, POLICY_STATE_NAME)
        try:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"the checkpoint has no {POLICY_STATE_NAME}")
            try:
                payload = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as err:  # torch raises several types for truncated or foreign files
                raise ValueError(f"{POLICY_STATE_NAME} is unreadable ({type(err).__name__}: {err})") from err
            if not isinstance(payload, dict) or "state" not in payload:
                raise ValueError(f"{POLICY_STATE_NAME} does not hold a policy state")
            if payload.get("policy") != self.rock_policy.name:
                raise ValueError(
                    f"it was saved by policy {payload.get('policy')!r}, but this run uses {self.rock_policy.name!r}"
                )
            self.rock_policy.load_state_dict(payload["state"])
        except (FileNotFoundError, ValueError, KeyError, TypeError) as err:
            if self.args.rock_policy_reset_on_resume:
                logger.warning(f"Resuming from {checkpoint} with a fresh {self.rock_policy.name!r} policy: {err}.")
                self.rock_policy.setup(self._vocab_size)
                return
            raise ValueError(
                f"Cannot restore the token policy from checkpoint {checkpoint!r}: {err}. Resume from a complete "
                "checkpoint, or set rock_policy_reset_on_resume=True to continue with a fresh policy."
            ) from err

    def write_rock_tokens(self, directory: str) -> str:
        """Write the policy's current rock set, decoded, to `directory/rock_tokens.json`; return the path."""
        os.makedirs(directory, exist_ok=True)
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        rows = self.rock_policy.rock_table()
        for row in rows:
            row["token"] = tokenizer.decode([row["token_id"]]) if tokenizer is not None else None
        path = os.path.join(directory, ROCK_TOKENS_NAME)
        save_rock_set(
            path,
            rows,
            vocab_size=self._vocab_size,
            tokenizer_name=getattr(tokenizer, "name_or_path", None),
            policy=self.rock_policy.name,
            policy_kwargs=json.loads(json.dumps(self.args.rock_policy_kwargs or {}, default=str)),
            step=self.state.global_step,
        )
        return path

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        language: str | None = None,
        license: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """Write this run's card (`hf_rockopd.model_card`) to `output_dir/README.md`, replacing TRL's generic one.

        Called by `push_to_hub` (with transformers' keyword arguments) and at every checkpoint (TRL's, with
        `model_name`). `tasks`, `dataset_tags` and `dataset_args` are accepted for compatibility and unused: the card's
        pipeline tag is always `text-generation`. With a `run_report.json` in the output directory the card holds its
        evaluation table.
        """
        if not self.is_world_process_zero():
            return
        if dataset_name is None and dataset is not None:
            dataset_name = dataset if isinstance(dataset, str) else dataset[0]
        card = model_card_from_trainer(
            self,
            model_name=model_name,
            dataset_name=dataset_name,
            tags=tags,
            license=license,
            language=language,
            finetuned_from=finetuned_from,
        )
        card.save(os.path.join(self.args.output_dir, CARD_NAME))
