"""Resuming the main job: the same command, run again in the same output directory, goes on where it stopped.

A real-budget run on a CPU takes hours and outlives a session, so every phase of `hf-rockopd distill` keeps its state
on disk: the teacher's reference and the student's evaluations journal their generation batch by batch
(`hf_rockopd.evaluation.journal`), the evaluation before training is cached (`distill.evaluation`), and training
saves checkpoints (`save_strategy="steps"`) from which transformers' Trainer resumes optimizer, scheduler, RNG and the
token policy's state (`hf_rockopd.engine.state`). This module decides whether a run resumes, and refuses to resume
one started with other settings, before any model loads: an optimizer state from another learning rate would be
resumed silently otherwise.

Example:
```python
>>> import tempfile
>>> from hf_rockopd.distill.resume import check_resume, record_run_settings
>>> out = tempfile.mkdtemp()
>>> check_resume(out, {"learning_rate": 1e-4}) is None  # nothing to resume: a fresh run
True
>>> record_run_settings(out, {"learning_rate": 1e-4})  # once training starts
>>> check_resume(out, {"learning_rate": 3e-4})
Traceback (most recent call last):
...
ValueError: The output directory ... was started with other settings (learning_rate: 0.0001 -> 0.0003): resuming ...
```
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from transformers.trainer_utils import get_last_checkpoint

from ..publishing.run_report import RUN_REPORT_NAME

__all__ = ["RUN_SETTINGS_NAME", "check_resume", "finished_run", "record_run_settings", "resume_settings"]

RUN_SETTINGS_NAME = "run_settings.json"

# Settings that may change between a run and its resumption without changing what it computes: where and how it
# reports, how often it logs, saves and evaluates checkpoints, and resumption itself.
_FREE = {
    "output_dir", "logging_dir", "logging_steps", "report_to", "run_name", "resume_from_checkpoint", "push_to_hub",
    "hub_model_id", "hub_token", "disable_tqdm", "log_level", "log_level_replica", "save_total_limit",
    "dataloader_num_workers", "eval_cache_dir", "checkpoint_eval_problems", "checkpoint_eval_steps", "save_steps",
}


def _plain(value: Any) -> Any:
    """JSON-comparable form of a setting (enums, paths and other objects by their text)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    return str(getattr(value, "value", value))


def resume_settings(*configs: Any) -> dict[str, Any]:
    """The settings of a run that a resumption must share: every field of `configs` (dataclasses: the script's
    arguments, the trainer config, the student's model config) except those in `_FREE`.

    Example:
    ```python
    >>> from hf_rockopd.distill import DistillArguments
    >>> settings = resume_settings(DistillArguments(num_train_prompts=64))
    >>> settings["num_train_prompts"], "eval_cache_dir" in settings
    (64, False)
    ```
    """
    settings: dict[str, Any] = {}
    for config in configs:
        if config is None:
            continue
        for name, value in vars(config).items():
            if name.startswith("_") or name in _FREE:
                continue
            settings[name] = _plain(value)
    return settings


def _as_json(settings: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(settings), sort_keys=True, default=str))


def check_resume(output_dir: str, settings: Mapping[str, Any], resume_from_checkpoint: str | bool | None = None
                 ) -> str | None:
    """The checkpoint a run in `output_dir` resumes from (None: it starts from step 0), checked against `settings`
    before any model loads; nothing is written.

    A directory whose `run_settings.json` (`record_run_settings`) holds other settings is refused with a `ValueError`
    naming each difference. `resume_from_checkpoint` (TrainingArguments' field) names a checkpoint explicitly;
    `False` or the text `"false"` starts afresh even where checkpoints exist; unset, the last checkpoint is used.
    """
    path = os.path.join(output_dir, RUN_SETTINGS_NAME)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
        wanted = _as_json(settings)
        changed = [
            f"{name}: {stored.get(name)!r} -> {wanted.get(name)!r}"
            for name in sorted(set(stored) | set(wanted))
            if stored.get(name) != wanted.get(name)
        ]
        if changed:
            raise ValueError(
                f"The output directory {output_dir!r} was started with other settings ({'; '.join(changed)}): "
                "resuming it would mix two runs. Run again with its settings, or give another --output_dir "
                f"(or delete {path} and its checkpoint-* folders to start it afresh)."
            )
    if resume_from_checkpoint is False or str(resume_from_checkpoint).lower() == "false":
        return None
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() != "true":
        if not os.path.isdir(resume_from_checkpoint):
            raise ValueError(
                f"resume_from_checkpoint {resume_from_checkpoint!r} is not a checkpoint folder; give one of the "
                f"checkpoint-N folders of {output_dir!r}, or leave it unset to resume from the last one."
            )
        return resume_from_checkpoint
    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


def finished_run(output_dir: str, resume_from_checkpoint: str | bool | None = None) -> str | None:
    """The run report of the run that finished in `output_dir`, or None when there is something left to do.

    Call it after `check_resume` has compared the settings: a directory holding `run_settings.json` (training began
    with these settings) and `run_report.json` (written last, after the final evaluation and save) is finished, and
    its command run again does nothing. `make distill-long` runs the first policy's command again whenever the second
    run is resumed; without this it would reload both models and evaluate the finished student once more.
    `resume_from_checkpoint=False` (or `"false"`) still starts afresh.

    Example:
    ```python
    >>> import tempfile
    >>> from hf_rockopd.distill.resume import finished_run
    >>> finished_run(tempfile.mkdtemp()) is None  # nothing there yet
    True
    ```
    """
    if resume_from_checkpoint is False or str(resume_from_checkpoint).lower() == "false":
        return None
    report = os.path.join(output_dir, RUN_REPORT_NAME)
    if os.path.isfile(os.path.join(output_dir, RUN_SETTINGS_NAME)) and os.path.isfile(report):
        return report
    return None


def record_run_settings(output_dir: str, settings: Mapping[str, Any]) -> None:
    """Write `run_settings.json` into `output_dir` (kept if it is there: `check_resume` compared it already)."""
    path = os.path.join(output_dir, RUN_SETTINGS_NAME)
    if os.path.isfile(path):
        return
    os.makedirs(output_dir, exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(_as_json(settings), f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
