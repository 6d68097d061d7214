"""`RockDistillationTrainer`: TRL's stable `DistillationTrainer` with a token-weighted, chunked divergence.

Everything but the loss is `DistillationTrainer`'s: vLLM generation (colocate or server), tool calling, vision-language
inputs, the generation-batch buffering, the logging. `compute_loss` is replaced: the loss positions are weighted by the
rock-token policy (tool-result tokens are masked out first, so they are never weighted), only the rows with weight are
projected through the heads, and the loss, metrics and files go through the shared engine.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from transformers import PreTrainedModel
from transformers.utils import logging
from trl import DistillationTrainer
from trl.import_utils import is_vllm_available

from ..console import quiet_training
from ..engine import LossPlan, Projection, build_policy, check_supported_setup
from ..engine.sharding import check_fsdp_accelerator, fsdp_requested
from ..models import unpack_cpu_4bit_weights
from ..policies import TokenPolicy
from ..publishing.model_card import trainer_tags
from ..teachers import connect_teacher_source
from .common import PAPER, RockTrainerMixin, check_trainer_arguments, loss_output
from .distillation_config import RockDistillationConfig


logger = logging.get_logger(__name__)

__all__ = [
    "VLLM_INSTALL",
    "RockDistillationTrainer",
    "check_prompt_columns",
    "check_vllm_available",
    "check_vllm_sharding",
]

VLLM_INSTALL = 'pip install "trl[vllm]"'

# The multimodal inputs `DistillationTrainer` passes to both backbones (from its generation batch).
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def check_vllm_available(use_vllm: bool) -> None:
    """`ImportError` naming the install command when vLLM generation is asked for and vLLM is not installed.

    Called before any model loads (TRL checks only after loading the student and the teacher).

    Example:
    ```python
    >>> from hf_rockopd.trainers.distillation import check_vllm_available
    >>> check_vllm_available(False)  # HF generation: nothing to check
    ```
    """
    if use_vllm and not is_vllm_available():
        raise ImportError(
            "use_vllm=True needs vLLM, which is not installed here. Install it with "
            f"`{VLLM_INSTALL}` (Linux with a CUDA GPU), or leave use_vllm off to generate with transformers."
        )


def check_vllm_sharding(args: Any) -> None:
    """`ValueError` for vLLM generation under FSDP2, before any model loads: that combination has not been run.

    The generation and the weight sync would be TRL's, unchanged (`VLLMGeneration.sync_weights` gathers each FSDP2
    parameter with `full_tensor` before loading it into vLLM), but vLLM needs a CUDA GPU and this project's FSDP2 runs
    are on CPU, so it is refused rather than claimed.

    Example:
    ```python
    >>> from types import SimpleNamespace
    >>> from hf_rockopd.trainers.distillation import check_vllm_sharding
    >>> check_vllm_sharding(SimpleNamespace(use_vllm=True, vllm_mode="colocate", fsdp=""))  # vLLM without FSDP: fine
    ```
    """
    if args.use_vllm and fsdp_requested(args):
        raise ValueError(
            f"RockDistillationTrainer has not been run with vLLM generation (vllm_mode={args.vllm_mode!r}) under "
            "FSDP2: TRL's weight sync from the sharded student to vLLM needs CUDA GPUs, and this project's FSDP2 runs are on "
            "CPU. Generate with vLLM on one process or with DDP (drop fsdp/fsdp_config), or under FSDP2 with "
            "transformers' generation (use_vllm=False)."
        )


def check_prompt_columns(train_dataset: Any, eval_dataset: Any = None) -> None:
    """`ValueError` naming the split and its columns when a dataset has no `"prompt"` column.

    `DistillationTrainer` keeps only the `prompt` (and image) columns and reads `x["prompt"]` at the first generation,
    so a dataset without one would pass construction and fail as a `KeyError` in `train()`. Datasets that do not
    list their columns (an `IterableDataset` before its first example, a plain list) are not checked.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> from hf_rockopd.trainers.distillation import check_prompt_columns
    >>> check_prompt_columns(Dataset.from_list([{"prompt": "2+3?"}]))  # has a prompt column: fine
    ```
    """
    splits = {"train_dataset": train_dataset}
    if isinstance(eval_dataset, dict):
        splits.update({f"eval_dataset[{name!r}]": split for name, split in eval_dataset.items()})
    else:
        splits["eval_dataset"] = eval_dataset
    for name, split in splits.items():
        columns = getattr(split, "column_names", None)
        if not isinstance(columns, list) or "prompt" in columns:
            continue
        hint = (
            " 'messages' is RockOPDTrainer's format: use RockOPDTrainer, or make prompts of the turns before the "
            "first assistant turn with hf_rockopd.distill.trainer_choice.prompts_only(dataset)."
            if "messages" in columns
            else " Add one: the chat messages up to the assistant's turn, or the prompt text."
        )
        raise ValueError(f"RockDistillationTrainer's {name} has no 'prompt' column; it has {sorted(columns)}.{hint}")


class RockDistillationTrainer(RockTrainerMixin, DistillationTrainer):
    """On-policy distillation on TRL's stable `DistillationTrainer`, with a token-weighted divergence.

    A drop-in [`~trl.DistillationTrainer`]: same arguments (a teacher as a model or a name, `peft_config`,
    `quantization_config`, `tools`), same generation (transformers, or vLLM with `use_vllm=True` in `"colocate"` or
    `"server"` mode), plus `rock_policy`. Each completion position is weighted by the policy from the token it predicts;
    positions of tool results (`tool_mask == 0`) are never weighted. The loss is `Σ weight · divergence / normalizer`
    (see [`RockDistillationConfig`]); hidden states are projected through the heads only where the weight is > 0,
    `loss_chunk_size` rows at a time. With `rock_policy="uniform"` the loss and its gradients are
    `DistillationTrainer`'s. Under FSDP2 (`fsdp_config={"version": 2}`) the teacher is sharded like the student, as in
    `RockOPDTrainer` (`hf_rockopd.engine.sharding`); vLLM generation under FSDP2 is refused (not run).

    Args:
        model, teacher_model, train_dataset, eval_dataset, processing_class, callbacks, optimizers, quantization_config,
        peft_config, tools:
            As for `DistillationTrainer` (datasets with a `"prompt"` column). `teacher_model` is required, and so is
            `processing_class` for a model built in code (TRL loads the tokenizer by the model's name). The checks of
            [`~hf_rockopd.trainers.common.check_trainer_arguments`] and a dataset without a `"prompt"` column fail
            before any model loads.
        args ([`RockDistillationConfig`], *optional*):
            The configuration; a default one when `None`.
        rock_policy ([`~hf_rockopd.policies.TokenPolicy`] or `str`, *optional*):
            A policy object, or a registered name; overrides `args.rock_policy`.

    Example:
    ```python
    from datasets import Dataset
    from hf_rockopd import RockDistillationConfig, RockDistillationTrainer

    prompts = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 2+3?"}]}] * 8)
    trainer = RockDistillationTrainer(
        model="Qwen/Qwen3-1.7B",
        teacher_model="Qwen/Qwen3-8B",
        args=RockDistillationConfig(output_dir="out", rock_policy="rock_online", use_vllm=True, vllm_mode="colocate"),
        train_dataset=prompts,
    )
    trainer.train()
    ```
    """

    # TRL's tag of the base is also one of the card's tags: listed once.
    _tag_names = list(dict.fromkeys(trainer_tags("distillation")))
    _name = "RockDistillation"
    _paper = PAPER

    def __init__(
        self,
        model: str | PreTrainedModel | nn.Module,
        teacher_model: str | PreTrainedModel | nn.Module | None = None,
        args: RockDistillationConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list | None = None,
        rock_policy: TokenPolicy | str | None = None,
    ):
        args = check_trainer_arguments(
            "RockDistillationTrainer", RockDistillationConfig, model, teacher_model, args, train_dataset,
            processing_class,
        )
        check_vllm_available(args.use_vllm)
        check_supported_setup(
            args, "RockDistillationTrainer", fsdp2=True, peft=peft_config is not None or hasattr(model, "peft_config")
        )
        check_vllm_sharding(args)
        model_name = getattr(getattr(model, "config", None), "_name_or_path", "")
        if processing_class is None and not isinstance(model, str) and not model_name:
            # TRL would load the tokenizer from the model's name, which a model built in code does not have.
            raise ValueError(
                "RockDistillationTrainer needs processing_class when the model has no name or path to load its "
                "tokenizer from: pass processing_class=AutoTokenizer.from_pretrained(<student>), or the model as a "
                "name/path."
            )
        check_prompt_columns(train_dataset, eval_dataset)
        # Built before any model loads, so a bad name or option fails in seconds; a served teacher is probed too.
        policy = build_policy(rock_policy, args)
        if isinstance(args.teacher_server_url, dict):
            # DistillationTrainer's generation batch keeps the prompt columns only, so a `teacher` column would not
            # reach the loss.
            raise ValueError(
                "Several served teachers (teacher_server_url as a dict) are supported by RockOPDTrainer only: "
                "DistillationTrainer's batches keep the prompt columns only. Use RockOPDTrainer, or one teacher URL."
            )
        served = connect_teacher_source(args, processing_class)
        # quiet_training: peft's PeftModel reads transformers' renamed `is_gradient_checkpointing` while it wraps.
        with quiet_training():
            super().__init__(
                model=model,
                teacher_model=teacher_model,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                callbacks=callbacks,
                optimizers=optimizers,
                quantization_config=quantization_config,
                peft_config=peft_config,
                tools=tools,
            )
        check_fsdp_accelerator(args, self.accelerator, "RockDistillationTrainer")
        if self.accelerator.is_fsdp2:
            self._prepare_fsdp2()
        self._attach_rock_engine(args, policy, student_eos=self.eos_token_ids, served_teacher=served)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.rock_engine.micro_step += 1
        if self.rock_engine.has_4bit_layers:
            unpack_cpu_4bit_weights(model)
        return super().training_step(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------------------------------------- loss ----
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The weighted divergence of one micro-batch of `DistillationTrainer`'s generation batch.

        The loss mask is `completion_mask * tool_mask`, as in `DistillationTrainer`. Normalization (`"tokens"`): in
        training, the completion tokens of the whole generation batch over all processes (the batch's
        `num_items_in_batch`, counted after generation); otherwise a caller's `num_items_in_batch` as given, else the
        micro-batch's own count. With `return_outputs=True` the result is `(loss, RockLossOutput)`.
        """
        training = self.model.training
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            # A tool's output is not the student's to learn: masked before weighting, so no policy can weight it.
            mask = mask & inputs["tool_mask"].bool()
        count = None
        if training and inputs.get("num_items_in_batch") is not None:
            count = inputs["num_items_in_batch"].clamp(min=1)
        elif num_items_in_batch is not None:
            # The engine divides a training count by the process count (for DDP's gradient averaging); a caller's
            # count is the divisor itself, as in DistillationTrainer, so undo that division.
            count = torch.as_tensor(num_items_in_batch) * (self.accelerator.num_processes if training else 1)
        plan = self.rock_engine.plan(
            inputs["completion_ids"],
            mask,
            step=self.state.global_step,
            training=training,
            num_items_in_batch=count,
            accumulation_steps=getattr(self, "current_gradient_accumulation_steps", 1) if training else 1,
        )
        # Backbones and heads inside the student wrapper's forward (DDP's hooks fire); the policy update and the
        # metric gathers (collectives) outside it, in `finish`.
        student = self.accelerator.unwrap_model(model)
        projection = self._forward_redirection(model, student, self._project_plan, student, inputs, plan)
        mode = "train" if training else "eval"
        loss = self.rock_engine.finish(plan, projection, self._metrics[mode])
        self._log_entropy(projection, mode)
        return (loss, loss_output(loss, plan)) if return_outputs else loss

    def _project_plan(self, student: nn.Module, inputs: dict[str, Any], plan: LossPlan) -> Projection:
        """Both backbones on prompt + completion (through `DistillationTrainer._get_last_hidden_state`, which handles
        PEFT and vision-language models), then the heads on the plan's rows only."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        multimodal = {key: inputs[key] for key in _MULTIMODAL_KEYS if key in inputs}
        keep = inputs["completion_ids"].size(1)
        student_hidden = self._get_last_hidden_state(student, input_ids, attention_mask, keep, **multimodal)
        if self.rock_engine.topk_teacher is not None:
            # Row i of the targets is token i's distribution: the completion tokens are the last `keep`.
            needed = torch.zeros_like(attention_mask, dtype=torch.bool)
            needed[:, -keep:] = plan.grad_rows | plan.probe_rows
            targets = self.rock_engine.topk_targets(input_ids, attention_mask, needed, plan.batch.step)
            return self.rock_engine.project_hidden(plan, student_hidden, targets[:, -keep:], student)
        self.teacher_model.eval()
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            # Through the teacher's own wrapper, so DeepSpeed/FSDP gather its parameters for the forward.
            teacher_hidden = self._forward_redirection(
                self.teacher_model,
                teacher,
                self._get_last_hidden_state,
                teacher,
                input_ids,
                attention_mask,
                keep,
                **multimodal,
            )
        # With a model split over devices (`device_map`), the last layer may sit elsewhere than the head.
        student_device = student.get_output_embeddings().weight.device
        teacher_device = teacher.get_output_embeddings().weight.device
        return self.rock_engine.project_hidden(
            plan, student_hidden.to(student_device), teacher_hidden.to(teacher_device), student
        )

    def _log_entropy(self, projection: Projection, mode: str) -> None:
        """`DistillationTrainer`'s `entropy` metric (mean student entropy, nats) over the projected weighted rows."""
        entropy = projection.grad.student_entropy
        sums = torch.stack([entropy.sum().float(), torch.tensor(float(entropy.numel()), device=entropy.device)])
        total, rows = self.accelerator.gather(sums[None]).sum(0).tolist()
        self._metrics[mode]["entropy"].append(total / rows if rows > 0 else 0.0)
