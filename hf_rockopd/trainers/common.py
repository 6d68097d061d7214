"""What every rock-token trainer adds to its TRL base besides the loss: the policy's files and card, shared.

[`RockTrainerMixin`] goes first in a trainer's bases (`class T(RockTrainerMixin, TRLTrainer)`) and expects
`self.rock_engine` (a [`~hf_rockopd.engine.RockTokenEngine`]); [`RockLossOutput`] is what `compute_loss(...,
return_outputs=True)` returns with the loss.
"""

from __future__ import annotations

import functools
import os
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint
from transformers.utils import ModelOutput, logging

from ..console import quiet_training
from ..engine import LossPlan, RockTokenEngine
from ..engine.sharding import fsdp_mesh, shard_teacher
from ..models.adapters import adapter_embedding_layers
from ..policies import TokenPolicy
from ..publishing.model_card import model_card_from_trainer
from ..publishing.run_report import CARD_NAME
from ..teachers import ModelTopKTeacher, TopKTeacher


logger = logging.get_logger(__name__)

__all__ = [
    "PAPER",
    "RockLossOutput",
    "RockTrainerMixin",
    "check_trainer_arguments",
    "loss_output",
    "refuse_prediction_hooks",
]

PAPER = {
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


@dataclass
class RockLossOutput(ModelOutput):
    """The per-position view of one micro-batch's loss, returned by `compute_loss(..., return_outputs=True)`.

    Logits are not returned: they would be `(batch, length, vocab)`, which the chunked loss never builds.

    Args:
        loss (`torch.Tensor`): the scalar loss (the one returned beside this object).
        weights (`torch.Tensor`): `(batch, positions)` float32 weight of each loss position (0 outside the mask).
        divergence (`torch.Tensor`): `(batch, positions)` float32 per-position divergence where it was scored
            (weighted and probed rows), 0 elsewhere; detached.
        mask (`torch.Tensor`): `(batch, positions)` bool, the positions that count (completion tokens, not tool output).
        token_ids (`torch.Tensor`): `(batch, positions)` the token each position predicts (0 outside the mask).

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.trainers.common import RockLossOutput
    >>> out = RockLossOutput(loss=torch.tensor(0.5), weights=torch.ones(1, 2))
    >>> sorted(out.keys())
    ['loss', 'weights']
    ```
    """

    loss: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    divergence: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None


def loss_output(loss: torch.Tensor, plan: LossPlan) -> RockLossOutput:
    """The [`RockLossOutput`] of a finished plan.

    Example: `RockOPDTrainer.compute_loss(model, inputs, return_outputs=True)` returns `(loss, loss_output(...))`.
    """
    batch = plan.batch
    divergence = batch.divergence if batch.divergence is not None else torch.zeros_like(plan.weights)
    return RockLossOutput(
        loss=loss, weights=plan.weights, divergence=divergence, mask=batch.mask, token_ids=batch.token_ids
    )


def refuse_prediction_hooks(trainer_name: str, compute_metrics: Any, preprocess_logits_for_metrics: Any) -> None:
    """`ValueError` when either hook is given: the trainers return no logits from evaluation, so Transformers would
    never call them, and a silently ignored metric is worse than an error.

    Example:
    ```python
    >>> from hf_rockopd.trainers.common import refuse_prediction_hooks
    >>> refuse_prediction_hooks("RockOPDTrainer", None, None)  # nothing given: fine
    ```
    """
    given = [
        name
        for name, value in (
            ("compute_metrics", compute_metrics),
            ("preprocess_logits_for_metrics", preprocess_logits_for_metrics),
        )
        if value is not None
    ]
    if given:
        raise ValueError(
            f"{trainer_name} does not support {' and '.join(given)}: its evaluation returns no logits (they would be "
            "(batch, length, vocab), which the chunked loss never builds), so the hook would never be called. "
            "Evaluation reports eval_loss and the eval_rock/* metrics; for task metrics evaluate the saved model "
            "(`hf-rockopd evaluate`, hf_rockopd.evaluation) or use a TrainerCallback's on_evaluate."
        )


def check_trainer_arguments(
    trainer_name: str,
    config_class: type,
    model: Any,
    teacher_model: Any,
    args: Any,
    train_dataset: Any = None,
    processing_class: Any = None,
) -> Any:
    """The constructor checks both rock-token trainers run first, before any model loads; returns the config.

    `args=None` gives a default `config_class` whose `output_dir` is `<model name>-<trainer name without "Trainer">`.
    Everything else that is wrong is a `TypeError` (a value of the wrong kind) or a `ValueError` that names the value
    and the fix: a config of another class, a model or teacher that is neither a model nor a name/path, no teacher,
    `teacher_model_init_kwargs` with a teacher that is already built (TRL would ignore or refuse them only after
    loading the student), a `processing_class` that is not a tokenizer or processor, an empty `train_dataset`.

    Example:
    ```python
    >>> from hf_rockopd.trainers import RockOPDConfig
    >>> from hf_rockopd.trainers.common import check_trainer_arguments
    >>> args = check_trainer_arguments("RockOPDTrainer", RockOPDConfig, "org/student", "org/teacher", None)
    >>> args.output_dir
    'student-RockOPD'
    ```
    """
    if args is None:
        name = model if isinstance(model, str) else type(model).__name__
        suffix = trainer_name.removesuffix("Trainer")
        args = config_class(output_dir=f"{str(name).split('/')[-1]}-{suffix}")
    elif not isinstance(args, config_class):
        raise TypeError(
            f"{trainer_name} needs a {config_class.__name__}, got {type(args).__name__}. Build one with the same "
            f"fields: {config_class.__name__}(**your_config.to_dict()), or copy your settings over."
        )
    if not isinstance(model, (str, nn.Module)):
        raise TypeError(
            f"{trainer_name} needs model=<a model or a model name/path>, got {type(model).__name__}: {model!r}."
        )
    served = getattr(args, "teacher_server_url", None) is not None or getattr(args, "teacher_cache", None) is not None
    if teacher_model is None and not served:
        raise ValueError(
            f"{trainer_name} needs a teacher_model (a model or a model name/path), or teacher_server_url for a "
            "served teacher (or teacher_cache, lmbda=0)."
        )
    if teacher_model is not None and served:
        raise ValueError(
            f"{trainer_name} got both a teacher_model and teacher_server_url={args.teacher_server_url!r} / "
            f"teacher_cache={getattr(args, 'teacher_cache', None)!r}: the teacher is either in this process or outside "
            "it. Pass teacher_model=None to use the server or the cache."
        )
    if teacher_model is not None and not isinstance(teacher_model, (str, nn.Module)):
        raise TypeError(
            f"{trainer_name} needs teacher_model=<a model or a model name/path>, got {type(teacher_model).__name__}: "
            f"{teacher_model!r}."
        )
    if args.teacher_model_init_kwargs is not None and isinstance(teacher_model, nn.Module):
        raise ValueError(
            f"You passed teacher_model_init_kwargs to the {config_class.__name__}, but your teacher_model is already "
            "instantiated: the kwargs would be ignored. Pass the teacher as a name/path, or drop the kwargs."
        )
    if processing_class is not None and not isinstance(processing_class, (PreTrainedTokenizerBase, ProcessorMixin)):
        raise TypeError(
            f"processing_class must be a tokenizer (or a processor), got {type(processing_class).__name__}: "
            f"{processing_class!r}. Load it with AutoTokenizer.from_pretrained(<student name or path>)."
        )
    if train_dataset is not None and hasattr(train_dataset, "__len__") and len(train_dataset) == 0:
        raise ValueError("train_dataset is empty: on-policy distillation needs at least one prompt.")
    return args


class RockTrainerMixin:
    """The policy's checkpoint state, `rock_tokens.json` and model card of a rock-token trainer.

    Needs `self.rock_engine`; the other attributes are the Transformers `Trainer`'s.

    Example:
    ```python
    >>> from hf_rockopd.trainers import RockDistillationTrainer, RockOPDTrainer
    >>> from hf_rockopd.trainers.common import RockTrainerMixin
    >>> RockOPDTrainer.__mro__[1] is RockTrainerMixin is RockDistillationTrainer.__mro__[1]
    True
    ```
    """

    rock_engine: Any

    def _attach_rock_engine(
        self, args: Any, policy: TokenPolicy, student_eos: Any, served_teacher: TopKTeacher | None = None
    ) -> None:
        """Build `self.rock_engine` once TRL's `__init__` has prepared the models: on the unwrapped student, the
        prepared teacher (`served_teacher` instead when given; truncated to `teacher_top_k` when that is set) and the
        trainer's tokenizer; `student_eos` is where each trainer keeps its stop ids."""
        teacher = served_teacher if served_teacher is not None else self.teacher_model
        if served_teacher is None and args.teacher_top_k is not None:
            teacher = ModelTopKTeacher(
                self.teacher_model, args.teacher_top_k, args.loss_temperature, chunk_size=args.loss_chunk_size
            )
        self.rock_engine = RockTokenEngine(
            args,
            policy,
            student=self.accelerator.unwrap_model(self.model),
            teacher=teacher,
            accelerator=self.accelerator,
            tokenizer=self.processing_class,
            student_eos=student_eos,
        )

    def _prepare_fsdp2(self) -> None:
        """Under FSDP2, once TRL's `__init__` has set accelerate up (and `check_fsdp_accelerator` passed): shard the
        teacher like the student, and make every rank generate in step.

        Both TRL bases prepare the teacher with accelerate's `prepare_model(evaluation_mode=True)`, which does not
        shard under FSDP: each rank would keep the full teacher, on the CPU it was loaded on while the student is on
        the GPU (TRL issue 2580, https://github.com/huggingface/trl/issues/2580). The student is sharded later, by
        accelerate at `train()`, on the same default mesh.
        """
        self.teacher_model = shard_teacher(self.teacher_model, fsdp_mesh(self.accelerator))
        # Sharded layers all-gather in every forward, so a rank whose completions all ended must keep stepping until
        # every rank's have: transformers' `generate` does so (`synced_gpus`) for models it marks FSDP-managed, and
        # accelerate's `fully_shard` does not mark them.
        for module in self.model.modules():
            if isinstance(module, PreTrainedModel):
                module._is_fsdp_managed_module = True

    @property
    def rock_policy(self) -> TokenPolicy:
        """The token policy that weights each completion token (the engine's)."""
        return self.rock_engine.policy

    @rock_policy.setter
    def rock_policy(self, policy: TokenPolicy) -> None:
        self.rock_engine.policy = policy

    @property
    def _vocab_size(self) -> int:
        return self.rock_engine.vocab_size

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs) -> TrainOutput:
        finished = self._finished_checkpoint(resume_from_checkpoint)
        if finished is not None:
            output = self._resume_finished(finished)
        else:
            with quiet_training():  # TRL's own deprecated calls inside train(); any other warning still shows
                output = super().train(resume_from_checkpoint, *args, **kwargs)
        if self.is_world_process_zero():
            self.write_rock_tokens(self.args.output_dir)
        return output

    def _finished_checkpoint(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """The checkpoint to resume when it already holds all `max_steps` steps; None when there is training left.

        Raises a `ValueError` for a checkpoint past `max_steps`: resuming it cannot give the run that was asked for.
        """
        if resume_from_checkpoint in (None, False) or self.args.max_steps <= 0:
            return None
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
        state_path = os.path.join(checkpoint, TRAINER_STATE_NAME) if checkpoint else None
        if state_path is None or not os.path.isfile(state_path):
            return None  # transformers' own resume says what is missing
        step = TrainerState.load_from_json(state_path).global_step
        if step > self.args.max_steps:
            raise ValueError(
                f"resume_from_checkpoint {checkpoint!r} is at step {step}, past max_steps={self.args.max_steps}: "
                f"resuming it cannot stop at step {self.args.max_steps}. Resume an earlier checkpoint, or set "
                f"max_steps to at least {step}."
            )
        return checkpoint if step == self.args.max_steps else None

    def _resume_finished(self, checkpoint: str) -> TrainOutput:
        """Load a checkpoint that holds the whole run and train nothing.

        transformers' loop takes an optimizer step before it first compares the step with `max_steps`, so resuming
        the last checkpoint would train step `max_steps + 1`: the real-budget run's `uniform` student, resumed from
        `checkpoint-200` to finish its evaluation, was trained 201 steps (examples/reports/real_budget/).
        """
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                f"{checkpoint!r} already holds all max_steps={self.args.max_steps} steps: there is nothing to train, "
                "and a sharded checkpoint is only loaded inside training. Load its weights without calling train() "
                "(e.g. PeftModel.from_pretrained on the checkpoint folder), or raise max_steps to train on."
            )
        logger.info(f"{checkpoint} holds all {self.args.max_steps} steps: loading it, training nothing.")
        self._load_from_checkpoint(checkpoint)
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME))
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.state.is_world_process_zero = self.is_world_process_zero()
        self.rock_engine.load_policy_state(checkpoint)
        # Callbacks see a run that begins and ends at its last step (a checkpoint evaluation still missing runs now).
        self.control = self.callback_handler.on_train_begin(self.args, self.state, self.control)
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        losses = [entry["loss"] for entry in self.state.log_history if "loss" in entry]
        return TrainOutput(self.state.global_step, sum(losses) / len(losses) if losses else 0.0, {})

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if self.is_world_process_zero():
            self.write_rock_tokens(output_dir or self.args.output_dir)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # Every save of a LoRA student (the final one and checkpoints) ends here. peft's save_pretrained would ask the
        # Hub whether the vocabulary was resized (offline: two warnings and a guess); the base's local config answers.
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        embedding_layers = adapter_embedding_layers(model)
        if embedding_layers is None:
            return super()._save(output_dir, state_dict)
        # Trainer._save calls save_pretrained(output_dir, state_dict=..., is_main_process=...) with no way to pass
        # peft's flag, so this model's method carries it for the one call.
        model.save_pretrained = functools.partial(
            type(model).save_pretrained, model, save_embedding_layers=embedding_layers
        )
        try:
            super()._save(output_dir, state_dict)
        finally:
            del model.save_pretrained

    def _save_checkpoint(self, model, trial):
        # The policy state goes in first: a run killed while the model is being written still finds it on resume.
        if self.is_world_process_zero():
            run_dir = self._get_output_dir(trial=trial)
            self.rock_engine.save_policy_state(
                os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            )
        self._saving_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_checkpoint = False

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.rock_engine.load_policy_state(checkpoint)

    def write_rock_tokens(self, directory: str) -> str:
        """Write the policy's current rock set, decoded, to `directory/rock_tokens.json`; return the path."""
        return self.rock_engine.write_rock_tokens(directory, step=self.state.global_step)

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
        """Write this run's card (`hf_rockopd.publishing`) to `output_dir/README.md`, replacing TRL's generic one.

        Called by `push_to_hub` (with transformers' keyword arguments) and at every checkpoint (TRL's, with
        `model_name`). `tasks`, `dataset_tags` and `dataset_args` are accepted for compatibility and unused: the card's
        pipeline tag is always `text-generation`. With a `run_report.json` in the output directory the card holds its
        evaluation table.
        """
        if not self.is_world_process_zero():
            return
        if dataset_name is None and dataset is not None:
            dataset_name = dataset if isinstance(dataset, str) else dataset[0]
        try:
            card = model_card_from_trainer(
                self,
                model_name=model_name,
                dataset_name=dataset_name,
                tags=tags,
                license=license,
                language=language,
                finetuned_from=finetuned_from,
            )
        except Exception as err:
            if not getattr(self, "_saving_checkpoint", False):
                raise
            # TRL writes the card before the checkpoint's weights: a card that fails to render would abort the save and
            # the run, leaving a checkpoint folder that cannot be resumed. The card describes the run and is not part of
            # its state, so the checkpoint goes on without it. (It happened: the template on disk had been upgraded
            # under a running job whose modules were older.)
            logger.warning(
                f"Step {self.state.global_step}: the model card was not written ({type(err).__name__}: {err}); the "
                f"checkpoint is saved without it. Render it afterwards with `hf-rockopd card {self.args.output_dir}`."
            )
            return
        card.save(os.path.join(self.args.output_dir, CARD_NAME))
