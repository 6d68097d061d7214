"""`RockOPDTrainer`: TRL's `GKDTrainer` with a token-weighted, chunked divergence and pluggable token policies."""

from __future__ import annotations

import logging as py_logging
import random
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging
from trl.experimental.gkd import GKDTrainer
from trl.models.utils import unwrap_model_for_generation

from ..console import quiet_training
from ..engine import build_policy, check_supported_setup
from ..engine.sharding import check_fsdp_accelerator
from ..models import unpack_cpu_4bit_weights
from ..policies import TokenPolicy
from ..publishing.model_card import trainer_tags
from ..teachers import connect_teacher_source
from .common import PAPER, RockTrainerMixin, check_trainer_arguments, loss_output, refuse_prediction_hooks
from .config import RockOPDConfig
from .data import OnPolicyChatMLCollator, check_prompt_lengths


logger = logging.get_logger(__name__)

__all__ = ["RockOPDTrainer"]


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


class _ServedTeacherStandIn(nn.Module):
    """What `GKDTrainer.__init__` gets as its teacher when the teacher is served: it requires a model, reads its
    vocabulary size (the student's here; the served one is checked against the student by the engine) and prepares
    it. No parameters; the trainer drops it right after."""

    def __init__(self, student: PreTrainedModel | nn.Module | str):
        super().__init__()
        self.config = student.config if isinstance(student, nn.Module) else AutoConfig.from_pretrained(student)


class RockOPDTrainer(RockTrainerMixin, GKDTrainer):
    """On-policy distillation with a token-weighted divergence and pluggable rock-token policies.

    A drop-in [`~trl.experimental.gkd.GKDTrainer`]: same arguments (a teacher given as a model or a name, `peft_config`
    for LoRA, a 4-bit student), plus `rock_policy`. Each optimizer step the student samples completions; each
    completion position is weighted by the policy according to the token it predicts, and the loss is
    `Σ weight · divergence / normalizer` (see [`RockOPDConfig`]). Hidden states are projected through the output heads
    only for the positions that carry weight, `loss_chunk_size` rows at a time, so frozen tokens cost nothing and the
    full `(batch, length, vocab)` logits never exist.

    Differences from `GKDTrainer` a user can see (docs/trainers.md's "Differences" table lists them all): `compute_metrics`
    and `preprocess_logits_for_metrics` are refused (evaluation returns no logits), and `compute_loss(...,
    return_outputs=True)` returns a [`~hf_rockopd.trainers.common.RockLossOutput`] (per-position weights and
    divergences) instead of the student's full outputs.

    Args:
        model, teacher_model, args, data_collator, train_dataset, eval_dataset, processing_class, callbacks,
        optimizers, peft_config, formatting_func:
            As for `GKDTrainer`. `args` is a [`RockOPDConfig`]. As in `GKDTrainer`, `args.teacher_model_init_kwargs`
            with a teacher that is already a model is a `ValueError`.
        compute_metrics, preprocess_logits_for_metrics:
            Must be `None` (a `ValueError` otherwise): evaluation reports `eval_loss` and `eval_rock/*` only.
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

    _tag_names = trainer_tags("gkd")
    _name = "RockOPD"
    _paper = PAPER
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
        args = check_trainer_arguments(
            "RockOPDTrainer", RockOPDConfig, model, teacher_model, args, train_dataset, processing_class
        )
        refuse_prediction_hooks("RockOPDTrainer", compute_metrics, preprocess_logits_for_metrics)
        check_supported_setup(args, fsdp2=True, peft=peft_config is not None or hasattr(model, "peft_config"))
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
        policy = build_policy(rock_policy, args)
        # A served teacher is reached and probed before any model loads, too.
        served = connect_teacher_source(args, processing_class)
        if served is not None:
            teacher_model = _ServedTeacherStandIn(model)

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

        # quiet_training: peft's PeftModel reads transformers' renamed `is_gradient_checkpointing` while it wraps.
        with _without_gkd_migration_warning(), quiet_training():
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
        if served is not None:
            self.teacher_model = None  # the stand-in only got GKDTrainer's constructor through
        check_fsdp_accelerator(args, self.accelerator)
        if self.accelerator.is_fsdp2:
            self._prepare_fsdp2()

        # GKDTrainer turns the KV cache off under gradient checkpointing, which makes generation quadratic; but
        # `unwrap_model_for_generation` disables checkpointing while generating, so the cache is safe to keep.
        self.generation_kwargs["use_cache"] = True
        self.generation_config.use_cache = True

        self._attach_rock_engine(args, policy, student_eos=self.generation_config.eos_token_id, served_teacher=served)
        self._accumulation_batches: list[dict[str, Any]] = []
        self._accumulation_num_items: torch.Tensor | None = None

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

    def _generate_completions(self, inputs: dict[str, Any]) -> bool:
        """Replace the batch's completions by sampled ones; `False` when the coin keeps the dataset's."""
        # Same coin as GKDTrainer.training_step: on-policy with probability lmbda, else teacher (seq_kd) or dataset.
        if random.random() <= self.lmbda:
            source = self.model_wrapped
            kwargs = {"gradient_checkpointing_kwargs": self.args.gradient_checkpointing_kwargs}
        elif self.seq_kd:
            source, kwargs = self.teacher_model, {}
        else:
            return False
        with unwrap_model_for_generation(
            source, self.accelerator, generation_kwargs=self.generation_kwargs, **kwargs
        ) as unwrapped:
            input_ids, attention_mask, labels = self.generate_on_policy_outputs(
                unwrapped, inputs, self.generation_config
            )
        inputs["input_ids"], inputs["attention_mask"], inputs["labels"] = input_ids, attention_mask, labels
        return True

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Generate the completions of every micro-batch of this optimizer step at its first micro-batch, then count
        their tokens over all micro-batches and processes: that count is the `"tokens"` normalizer, so the loss is
        gradient-accumulation-correct for the tokens the loss really sees."""
        if not any(batch is inputs for batch in self._accumulation_batches):
            # Called outside the training loop: the batch is its own accumulation step.
            self._accumulation_batches, self._accumulation_num_items = [inputs], None
        if self._accumulation_num_items is None:
            generated = [self._generate_completions(batch) for batch in self._accumulation_batches]
            self._accumulation_num_items = self.rock_engine.count_completions(
                [batch["labels"] for batch in self._accumulation_batches],
                generated,
                eos_ids=self.generation_config.eos_token_id,
                device=self.args.device,
                metrics=self._metrics["train"],
            )
        self.rock_engine.micro_step += 1
        if self.rock_engine.has_4bit_layers:
            unpack_cpu_4bit_weights(model)
        # Skip GKDTrainer.training_step, which would generate again.
        return super(GKDTrainer, self).training_step(model, inputs, self._accumulation_num_items)

    # ------------------------------------------------------------------------------------------------- loss ----
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The weighted divergence of a batch (`input_ids`, `attention_mask`, `labels` with -100 outside completions).

        `num_items_in_batch` divides the `"tokens"` normalization: in training the global count of the accumulation
        step (what `training_step` passes), in evaluation a caller's count used as given; `None` in evaluation is the
        mean over the batch's completion tokens. With `return_outputs=True` the result is `(loss,
        RockLossOutput)`: per-position weights, divergences and mask, not logits.
        """
        training = self.model.training
        loss, plan = self.rock_engine.compute_loss(
            model,
            inputs,
            step=self.state.global_step,
            training=training,
            num_items_in_batch=num_items_in_batch,
            accumulation_steps=getattr(self, "current_gradient_accumulation_steps", 1),
            metrics=self._metrics["train" if training else "eval"],
            return_plan=True,
        )
        return (loss, loss_output(loss, plan)) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # Distillation has no logits worth returning (they would be (B, L, V)); evaluation reports the loss only.
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
