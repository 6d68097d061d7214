"""`run_report.json`: what a distillation run did and measured, the one source of its model card.

This module owns the file: its name and the names of the files published beside it (the card and its training-curves
image), the training settings it records, its reader (with the checks a card needs) and its writer. `hf-rockopd
distill` writes it at the end of a run; [`run_report_from_trainer`] builds the same schema from a live trainer.

Schema (`*` required): `hf_rockopd_version`, `trainer.{name, base, tags}`, `teacher.{name*, source, weights}`,
`student.{name*, base_model*, adapter*, kept_layers, num_layers, base_num_layers, load_in_4bit, source, weights}`,
`dataset.{name, hub_id, config, split, num_train, num_eval}`, `policy.{name*, kwargs}`, `training` (the
[`TRAINING_FIELDS`], timings, `lora`), `distill_args` (the distill options), `eval.{before*, after*}` (each an
`EvalResult` dict or null), `log_history`, `command`, `license`, `language`, `hub_model_id`.

Example:
```python
>>> import tempfile
>>> from hf_rockopd.publishing.run_report import load_run_report, write_run_report
>>> run = tempfile.mkdtemp()
>>> report = {"teacher": {"name": "t"}, "student": {"name": "s", "base_model": "b", "adapter": False},
...           "policy": {"name": "uniform"}, "eval": {"before": None, "after": None}}
>>> path = write_run_report(run, report)
>>> load_run_report(run)["policy"]
{'name': 'uniform'}
```
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging

from .._version import __version__


logger = logging.get_logger(__name__)

__all__ = [
    "CARD_NAME",
    "CURVES_NAME",
    "RUN_REPORT_NAME",
    "TRAINING_FIELDS",
    "RunReportError",
    "load_run_report",
    "run_report_from_trainer",
    "trainer_description",
    "write_run_report",
]

RUN_REPORT_NAME = "run_report.json"
CARD_NAME = "README.md"
CURVES_NAME = "training_curves.png"
# The training settings a run report records (those its config has), in the order the model card shows them; any
# other `training` entries (timings, LoRA settings, the step) follow them, sorted.
TRAINING_FIELDS = (
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "max_new_tokens",
    "beta",
    "lmbda",
    "temperature",
    "loss_temperature",
    "seed",
    "loss_chunk_size",
    "lr_scheduler_type",
    "num_train_epochs",
    "rock_normalization",
    "rock_probe_fraction",
    "warmup_steps",
)
_REQUIRED = {
    "teacher": ("name",),
    "student": ("name", "base_model", "adapter"),
    "policy": ("name",),
    "eval": ("before", "after"),
}
_PRODUCE_HINT = (
    "It is written by `hf-rockopd distill` at the end of a run; rerun it, or write the file with the keys listed in "
    "hf_rockopd.publishing.run_report.load_run_report."
)


class RunReportError(ValueError):
    """A run directory's `run_report.json` or `rock_tokens.json` is missing, unreadable or incomplete."""


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise RunReportError(f"{path} does not exist: {what}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunReportError(f"{path} is not valid JSON ({err}). {what}") from err


def load_run_report(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and check `run_dir/run_report.json`.

    Required: `teacher.name`, `student.name`, `student.base_model`, `student.adapter`, `policy.name`, `eval.before`
    and `eval.after` (each an `EvalResult` dict, or null for a skipped evaluation). Optional: `hf_rockopd_version`,
    `teacher.source`, `student.kept_layers`, `student.num_layers`, `student.load_in_4bit`, `dataset`,
    `policy.kwargs`, `training`, `log_history`, `command`, `license` (default `"apache-2.0"` for SmolLM2 students,
    else `"other"`).

    Raises:
        RunReportError: the file is missing, is not JSON, or lacks required keys (all of them are named).

    Example:
    ```python
    >>> import tempfile
    >>> from hf_rockopd.publishing.run_report import RunReportError, load_run_report
    >>> try:
    ...     load_run_report(tempfile.mkdtemp())
    ... except RunReportError as err:
    ...     print("run_report.json does not exist" in str(err))
    True
    ```
    """
    path = Path(run_dir) / RUN_REPORT_NAME
    report = _read_json(path, _PRODUCE_HINT)
    if not isinstance(report, dict):
        raise RunReportError(f"{path} must hold a JSON object, got {type(report).__name__}. {_PRODUCE_HINT}")
    missing = []
    for section, keys in _REQUIRED.items():
        value = report.get(section)
        if not isinstance(value, dict):
            missing.append(section)
            continue
        missing += [f"{section}.{key}" for key in keys if key not in value]
    if missing:
        raise RunReportError(f"{path} lacks required keys: {', '.join(missing)}. {_PRODUCE_HINT}")
    for stage in ("before", "after"):
        # null: the run skipped that evaluation (`--skip_eval`).
        if report["eval"][stage] is not None and not isinstance(report["eval"][stage], dict):
            raise RunReportError(
                f"{path}: eval.{stage} must be an EvalResult dict (EvalResult.to_dict()) or null, got "
                f"{type(report['eval'][stage]).__name__}."
            )
    if not isinstance(report.get("log_history", []), list):
        raise RunReportError(f"{path}: log_history must be a list (trainer.state.log_history).")
    return report


def _json_default(value: Any) -> Any:
    # log_history and policy kwargs may hold tensors or other objects json cannot write; keep them readable.
    return value.tolist() if isinstance(value, torch.Tensor) else str(value)


def write_run_report(output_dir: str | os.PathLike, report: Mapping[str, Any]) -> str:
    """Write `report` to `output_dir/run_report.json` and return the path; tensors become lists, other objects strings.

    Example:
    ```python
    >>> import json, tempfile, torch
    >>> from hf_rockopd.publishing.run_report import write_run_report
    >>> path = write_run_report(tempfile.mkdtemp(), {"log_history": [{"loss": torch.tensor(0.5)}]})
    >>> json.load(open(path))["log_history"]
    [{'loss': 0.5}]
    ```
    """
    path = os.path.join(os.fspath(output_dir), RUN_REPORT_NAME)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=_json_default)
    return path


def _config_name(model: Any) -> str | None:
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    return str(name) if name else None


def trainer_description(trainer: Any) -> dict[str, Any]:
    """What the card says about the trainer: its class, the TRL trainer it builds on and its Hub tags (`_tag_names`).

    Example:
    ```python
    >>> from hf_rockopd.publishing.run_report import trainer_description
    >>> from trl import SFTTrainer
    >>> class MyTrainer(SFTTrainer):
    ...     _tag_names = ["trl", "sft"]
    >>> trainer_description(MyTrainer.__new__(MyTrainer))
    {'name': 'MyTrainer', 'base': 'SFTTrainer', 'tags': ['trl', 'sft']}
    ```
    """
    cls = type(trainer)
    # The nearest TRL class in the MRO names what the card calls "a subclass of TRL's ...".
    base = next((c.__name__ for c in cls.__mro__[1:] if c.__module__.startswith("trl.")), None)
    return {"name": cls.__name__, "base": base, "tags": list(getattr(trainer, "_tag_names", None) or [])}


def run_report_from_trainer(trainer: Any, model_name: str, dataset_name: str | None = None) -> dict[str, Any]:
    """What a rock-token trainer knows about its run, in the `run_report.json` schema (`eval` is `None`).

    `trainer` is a transformers `Trainer` with a `teacher_model` and a `rock_engine` ([`~hf_rockopd.engine.RockTokenEngine`]),
    such as [`~hf_rockopd.trainers.RockOPDTrainer`].

    Example:
    ```python
    from hf_rockopd.publishing.run_report import run_report_from_trainer
    report = run_report_from_trainer(trainer, model_name="smollm2-rockopd")
    print(report["policy"], report["training"]["global_step"])
    ```
    """
    from accelerate.utils import is_peft_model

    args = trainer.args
    engine = trainer.rock_engine
    student = trainer.accelerator.unwrap_model(trainer.model)
    served = engine.topk_teacher is not None and trainer.teacher_model is None
    teacher = None if served else trainer.accelerator.unwrap_model(trainer.teacher_model)
    adapter = is_peft_model(student)
    base = student.get_base_model() if adapter else student
    base_name = _config_name(base)
    if adapter:
        peft_config = student.peft_config.get(getattr(student, "active_adapter", "default"))
        base_name = getattr(peft_config, "base_model_name_or_path", None) or base_name
    if served:
        # The served model's own name, as its /v1/models lists it (a Hub id when served by one).
        teacher_name = engine.topk_teacher.client.model
        teacher_entry = {"name": teacher_name, "source": None}
    else:
        teacher_name = _config_name(teacher)
        teacher_entry = {
            "name": teacher_name or f"{type(teacher).__name__} (in memory)",
            "source": "path" if teacher_name and os.path.isdir(teacher_name) else None,
        }
    # What the divergence was measured against: full vocabulary, or a top-k teacher (k, where from).
    teacher_entry["divergence"] = engine.teacher_description
    training = {key: getattr(args, key) for key in TRAINING_FIELDS if hasattr(args, key)}
    training["global_step"] = trainer.state.global_step
    train_dataset = getattr(trainer, "train_dataset", None)
    return {
        "hf_rockopd_version": __version__,
        "trainer": trainer_description(trainer),
        "teacher": teacher_entry,
        "student": {
            "name": model_name,
            "base_model": base_name or f"{type(base).__name__} (in memory)",
            "kept_layers": None,
            "num_layers": base.config.get_text_config().num_hidden_layers,
            "adapter": adapter,
            "load_in_4bit": engine.has_4bit_layers,
        },
        "dataset": {
            "name": dataset_name,
            "num_train": len(train_dataset) if hasattr(train_dataset, "__len__") else None,
        },
        "policy": {"name": engine.policy.name, "kwargs": dict(args.rock_policy_kwargs or {})},
        "training": training,
        "eval": None,
        "log_history": list(trainer.state.log_history),
        "hub_model_id": trainer.hub_model_id or args.hub_model_id,
    }
