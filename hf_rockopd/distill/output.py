"""What `hf-rockopd distill` leaves behind besides the trained weights: its run report, a clean saved config, and the
compact training progress it prints.

`hf_rockopd.distill` runs the job; this module shapes its outputs, so the run report's schema
(`hf_rockopd.publishing.run_report`) is filled in one place.

Example:
```python
from hf_rockopd.distill.output import clean_saved_config, compact_progress
compact_progress(trainer)          # one short line per logged step
trainer.train()
clean_saved_config(trainer.model)  # use_cache on, no GGUF display name
trainer.save_model("out")
```
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._version import __version__
from ..models import describe_model_source
from ..publishing.card_setup import hub_dataset_id
from ..publishing.run_report import TRAINING_FIELDS, trainer_description


__all__ = ["clean_saved_config", "compact_progress", "distill_report", "lora_settings"]


def compact_progress(trainer: Any) -> None:
    """Print one short line per logged step under the progress bar instead of transformers' dict of every metric
    (those stay in `trainer.state.log_history` and the run report).

    Example:
    ```python
    from hf_rockopd.distill.output import compact_progress
    compact_progress(trainer)
    ```
    """
    from transformers.trainer_callback import ProgressCallback

    from ..trainers.progress import CompactProgressCallback

    if any(isinstance(callback, ProgressCallback) for callback in trainer.callback_handler.callbacks):
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(CompactProgressCallback())


def clean_saved_config(model: Any) -> None:
    """Make the `config.json` that `save_pretrained` will write say what a user of the student needs.

    Drops the GGUF display name transformers keeps (`_model_name_or_path: "Smollm2 135M 8k Lc100K Mix1 Ep2"`, which
    names neither the Hub id nor this student) and turns the KV cache back on (training turned it off).

    Example:
    ```python
    >>> from hf_rockopd.distill.output import clean_saved_config
    >>> from hf_rockopd.models import build_tiny_causal_lm
    >>> model = build_tiny_causal_lm()
    >>> model.config.use_cache, model.config._model_name_or_path = False, "Tiny GGUF"
    >>> clean_saved_config(model)
    >>> model.config.use_cache, hasattr(model.config, "_model_name_or_path")
    (True, False)
    ```
    """
    config = getattr(model, "config", None)
    if config is None:
        return
    config.__dict__.pop("_model_name_or_path", None)
    config.use_cache = True


def lora_settings(model_args: Any) -> dict[str, Any] | None:
    """The student's LoRA settings as the run report records them (`None` for a full fine-tune).

    Example:
    ```python
    >>> from hf_rockopd.distill import StudentModelConfig
    >>> from hf_rockopd.distill.output import lora_settings
    >>> lora_settings(StudentModelConfig(use_peft=True, lora_r=8))["r"]
    8
    ```
    """
    if not model_args.use_peft:
        return None
    return {
        "r": model_args.lora_r,
        "alpha": model_args.lora_alpha,
        "dropout": model_args.lora_dropout,
        "target_modules": model_args.lora_target_modules,
        "load_in_4bit": model_args.load_in_4bit,
    }


def distill_report(
    script: Any,
    args: Any,
    model_args: Any,
    *,
    trainer: Any,
    teacher_source: str,
    student_info: dict[str, Any],
    num_train: int,
    num_eval: int,
    train_seconds: float,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    command: str | None,
    resumed_from_step: int = 0,
    clock: Any = None,
) -> dict[str, Any]:
    """The run report of a distill run (schema: `hf_rockopd.publishing.run_report`), without `total_seconds`.

    `script`, `args` and `model_args` are the run's `DistillArguments`, trainer config and `StudentModelConfig`;
    `before` and `after` the evaluations' dicts (or None); `resumed_from_step` the checkpoint step this sitting resumed
    from (0: trained from the start), `train_seconds` this sitting's training time, `clock` the run's
    [`~hf_rockopd.trainers.clock.TrainingClock`] (its time inside optimizer steps over every sitting; None: not timed).

    Example:
    ```python
    report = distill_report(script, args, model_args, trainer=trainer, teacher_source="gguf-cache",
                            student_info=info, num_train=256, num_eval=16, train_seconds=300.0,
                            before=None, after=None, command="hf-rockopd distill")
    ```
    """
    return {
        "hf_rockopd_version": __version__,
        "trainer": trainer_description(trainer),
        "teacher": {
            "name": script.teacher,
            "source": teacher_source,
            # What was really loaded (a GGUF is a quantized copy, dequantized): the model card says it.
            "weights": describe_model_source(script.teacher, teacher_source),
        },
        "student": student_info,
        "dataset": {
            "name": script.dataset,
            "hub_id": hub_dataset_id({"name": script.dataset}),
            "config": script.dataset_config,
            # The training prompts' split; without eval_dataset the held-out problems are drawn from it too.
            "split": script.dataset_split,
            "eval_dataset": script.eval_dataset,
            "prompt_column": script.prompt_column,
            "answer_column": script.answer_column,
            "verifier": script.verifier,
            "num_train": num_train,
            "num_eval": num_eval,
            "system_prompt": script.system_prompt,
        },
        "policy": {"name": args.rock_policy, "kwargs": dict(args.rock_policy_kwargs or {})},
        "training": {
            **{name: getattr(args, name) for name in TRAINING_FIELDS if hasattr(args, name)},
            # This sitting's training time: a resumed run's earlier sittings are not in it, so its time per step is
            # train_seconds / (global_step - resumed_from_step).
            "train_seconds": round(train_seconds, 1),
            # The time inside optimizer steps over every sitting, and how many steps it covers (fewer than
            # global_step when a sitting ran before the clock existed). Saves and evaluations between steps are not in it.
            **({"step_seconds": round(clock.seconds, 1), "timed_steps": clock.steps} if clock is not None else {}),
            # The optimizer steps really taken (a resumed run counts its earlier sittings' steps too).
            "global_step": trainer.state.global_step,
            "resumed_from_step": resumed_from_step,
            "lora": lora_settings(model_args),
        },
        "eval": {"before": before, "after": after},
        "log_history": trainer.state.log_history,
        "command": command or "run_distillation(...)",
        "distill_args": dataclasses.asdict(script),
        "hub_model_id": args.hub_model_id,
        "license": "apache-2.0",
    }
