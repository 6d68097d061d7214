"""Compute of an ablation run: step time, loss time and projected rows, measured around the trainer.

`ComputeMeter` is a `TrainerCallback` (step time, and projected rows from the logged `rock/projected_fraction`);
the trainer subclass times `compute_loss` (the loss forward: backbones, projected heads, policy) and counts the
completion tokens it sees. On CUDA each reading synchronizes, so times are the device's, not the launch's.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from transformers import TrainerCallback

# The trainer, from the rest of the package (a reorganization changes this line only).
from ..models import pack_frozen_linears, packing_applies, unpack_linears
from ..trainers import RockOPDTrainer

__all__ = ["ComputeMeter", "train_copy"]


class ComputeMeter(TrainerCallback):
    """Times each optimizer step and counts projected rows from the trainer's `rock/projected_fraction` logs.

    The trainer logs, per logging step, the share of completion tokens projected through the output heads (weighted
    rows plus probes); times the completion tokens of that step (counted in `compute_loss`), that is the number of
    rows projected. Exact with `logging_steps=1` and one micro-batch per step (what ablation runs use), an average
    over micro-batches otherwise.
    """

    def __init__(self):
        self.step_seconds = 0.0
        self.steps = 0
        self.loss_seconds = 0.0
        self.completion_tokens = 0
        self.projected_rows = 0.0
        self._tokens_since_log = 0
        self._step_started: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        _synchronize()
        self._step_started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _synchronize()
        if self._step_started is not None:
            self.step_seconds += time.perf_counter() - self._step_started
            self.steps += 1
        self._step_started = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "rock/projected_fraction" in logs:
            self.projected_rows += float(logs["rock/projected_fraction"]) * self._tokens_since_log
            self._tokens_since_log = 0

    def count(self, tokens: int, seconds: float) -> None:
        self.completion_tokens += tokens
        self._tokens_since_log += tokens
        self.loss_seconds += seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "projected_rows": round(self.projected_rows),
            "completion_tokens": self.completion_tokens,
            "projected_fraction": self.projected_rows / self.completion_tokens if self.completion_tokens else None,
            "loss_seconds": round(self.loss_seconds, 4),
            "step_seconds": round(self.step_seconds / self.steps, 4) if self.steps else None,
            "steps": self.steps,
        }


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _MeteredTrainer(RockOPDTrainer):
    """The trainer with its loss forward timed and its completion tokens counted (training micro-batches only)."""

    meter: ComputeMeter

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        _synchronize()
        started = time.perf_counter()
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        _synchronize()
        self.meter.count(int((inputs["labels"][:, 1:] != -100).sum()), time.perf_counter() - started)
        return out


def train_copy(
    start: torch.nn.Module, teacher, tokenizer, prompts, args, resume: str | None = None, peft_config=None
):
    """Train a fresh copy of `start` with `args` (fresh LoRA adapters on it when `peft_config` is given); returns the
    trainer and its meter."""
    meter = ComputeMeter()
    model = copy.deepcopy(start)
    if "forward" in vars(model):
        # A model that went through a TRL trainer carries an instance `forward` (its fused-head patch) closing over
        # the *original* object: the copy would compute with the original's weights. Drop it; the new trainer
        # patches the copy itself.
        del model.forward
    trainer = _MeteredTrainer(
        model=model,
        teacher_model=teacher,
        args=args,
        train_dataset=prompts,
        processing_class=tokenizer,
        callbacks=[meter],
        # peft writes the resolved module names into the config it is given ("all-linear" becomes a list): a copy
        # keeps the caller's config as given, for the next run and for the record.
        peft_config=copy.deepcopy(peft_config),
    )
    trainer.meter = meter
    if packing_applies(args):
        # The LoRA base layers' rollouts through oneDNN (benchmarks/decode.py); dense again before anyone merges or
        # saves them.
        pack_frozen_linears(trainer.model)
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        unpack_linears(trainer.model)
    return trainer, meter
