"""What a model card says about the run's setup: the grouped settings table, the data line and the config to rerun it.

Pure functions of the run report (`hf_rockopd.publishing.run_report`). A card is published, so nothing here shows a
local path: models and datasets appear by Hub id, or as "a local ..." with the file name only.

Example:
```python
>>> from hf_rockopd.publishing.card_setup import dataset_line, is_hub_id
>>> dataset_line({"name": "../shared/data/gsm8k/train.jsonl", "num_train": 256, "num_eval": 16})
'`openai/gsm8k` (config `main`, split `train`): 256 training prompts and 16 held-out problems, disjoint'
>>> is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct"), is_hub_id("../data/train.jsonl")
(True, False)
```
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..data.resolve import DEFAULT_CONFIGS
from ..models.sources import GGUF_SOURCES, describe_model_source


__all__ = [
    "DROPPED_SETTINGS",
    "SETTING_GROUPS",
    "dataset_line",
    "format_setting",
    "hub_dataset_id",
    "is_hub_id",
    "public_name",
    "reproduce_config",
    "setting_rows",
]

# The groups of the card's training table, in order, with the `training` keys each shows (the run report's
# TRAINING_FIELDS); models and data come from their own report sections.
SETTING_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("policy", ("rock_normalization", "rock_probe_fraction")),
    ("optimization", ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
                      "lr_scheduler_type", "warmup_steps", "num_train_epochs", "beta", "loss_temperature", "seed")),
    ("generation", ("lmbda", "max_new_tokens", "temperature")),
    ("run", ("global_step", "resumed_from_step", "step_seconds", "train_seconds", "total_seconds")),
)
# Settings that change nothing a reader needs: memory chunking. Epochs and warm-up are dropped when they cannot act
# (see `setting_rows`).
DROPPED_SETTINGS = ("loss_chunk_size",)
# Names with these endings are files, even when the file is not on this machine (a report rendered elsewhere).
_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt", ".gguf", ".safetensors", ".bin")


def format_setting(value: Any) -> str:
    """A setting as one Markdown table cell: strings as is, other values as JSON; pipes and backticks escaped.

    Example:
    ```python
    >>> from hf_rockopd.publishing.card_setup import format_setting
    >>> format_setting({"top_k": 50}), format_setting("a|b")
    ('{"top_k": 50}', 'a\\\\|b')
    ```
    """
    text = json.dumps(value, ensure_ascii=False, default=str) if not isinstance(value, str) else value
    return text.replace("|", "\\|").replace("`", "'")


def is_hub_id(name: str | None) -> bool:
    """Whether `name` is a `namespace/name` Hub id (`huggingface_hub.utils.validate_repo_id`) and not a local path.

    Bare names (`gpt2`, `train.jsonl`) are not linked: in a run report they are local files far more often than
    legacy namespace-less Hub ids.

    Example:
    ```python
    >>> from hf_rockopd.publishing.card_setup import is_hub_id
    >>> is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct"), is_hub_id("data/train.jsonl"), is_hub_id("gpt2")
    (True, False, False)
    ```
    """
    if not name or "/" not in name or os.path.exists(name) or name.startswith((".", "~")):
        return False
    if name.lower().endswith(_FILE_SUFFIXES):  # what distill reads as a file (hf_rockopd.data), run elsewhere
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def public_name(name: str | None, what: str = "model") -> str:
    """`name` as a card may show it: a Hub id as is, a local path as "a local <what> (`<last part>`)".

    Example:
    ```python
    >>> from hf_rockopd.publishing.card_setup import public_name
    >>> public_name("Qwen/Qwen2.5-Coder-0.5B-Instruct"), public_name("/home/me/models/student-3L")
    ('`Qwen/Qwen2.5-Coder-0.5B-Instruct`', 'a local model (`student-3L`)')
    ```
    """
    if is_hub_id(name) or name in GGUF_SOURCES:
        return f"`{name}`"
    return f"a local {what} (`{os.path.basename(os.path.normpath(str(name)))}`)" if name else f"an unnamed {what}"


def hub_dataset_id(dataset: Mapping[str, Any]) -> str | None:
    """The Hub id for the card's `datasets`; local GSM8K copies are the Hub's `openai/gsm8k`.

    Example:
    ```python
    >>> from hf_rockopd.publishing.card_setup import hub_dataset_id
    >>> hub_dataset_id({"name": "../shared/data/gsm8k/train.jsonl"}), hub_dataset_id({"name": "my_data.jsonl"})
    ('openai/gsm8k', None)
    ```
    """
    if dataset.get("hub_id"):
        return str(dataset["hub_id"])
    name = str(dataset.get("name") or "")
    if is_hub_id(name):
        return name
    if "gsm8k" in name.lower():
        return "openai/gsm8k"
    return None


def dataset_line(dataset: Mapping[str, Any]) -> str | None:
    """The data the student was trained and evaluated on: Hub id, config, split and sizes (never a local path).

    `distill` draws the held-out problems and the training prompts from the dataset's `train` split, disjoint.

    Example:
    ```python
    >>> from hf_rockopd.publishing.card_setup import dataset_line
    >>> dataset_line({"name": "data/mine.jsonl", "num_train": 64})
    'a local JSONL file (`mine.jsonl`): 64 training prompts'
    ```
    """
    if not dataset.get("name") and not dataset.get("hub_id"):
        return None
    hub_id = hub_dataset_id(dataset)
    if hub_id:
        # A Hub dataset's config as run: given, else the one distill supplies (`main` for GSM8K), else its default.
        config = dataset.get("config") or DEFAULT_CONFIGS.get(hub_id)
        shown = f"config `{config}`, " if config else ""
        where = f"`{hub_id}` ({shown}split `{dataset.get('split') or 'train'}`)"
    else:
        name = os.path.basename(os.path.normpath(str(dataset["name"])))
        kind = {".jsonl": "JSONL file", ".json": "JSON file", ".parquet": "Parquet file", ".csv": "CSV file"}.get(
            os.path.splitext(name)[1].lower(), "dataset"
        )
        where = f"a local {kind} (`{name}`)"
    sizes = []
    if dataset.get("num_train") is not None:
        sizes.append(f"{dataset['num_train']} training prompts")
    if dataset.get("num_eval"):
        sizes.append(f"{dataset['num_eval']} held-out problems")
    disjoint = ", disjoint" if len(sizes) == 2 else ""
    return f"{where}: {' and '.join(sizes)}{disjoint}" if sizes else where


def _model_rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    teacher, student = dict(report["teacher"]), dict(report["student"])
    words = teacher.get("weights") or describe_model_source(str(teacher["name"]), teacher.get("source"))
    rows = [("teacher", public_name(teacher["name"]) + (f": {words}" if words else ""))]
    base = student["base_model"]
    if base == teacher["name"] and student.get("kept_layers"):
        rows.append(("student", "a layer-pruned copy of the teacher"))
    else:
        student_words = student.get("weights") or describe_model_source(str(base), student.get("source"))
        rows.append(("student base", public_name(base) + (f": {student_words}" if student_words else "")))
    kept, num = student.get("kept_layers"), student.get("num_layers")
    if kept:
        total = student.get("base_num_layers")
        rows.append(("student layers", f"{len(kept)}{f' of {total}' if total else ''}, kept: {list(kept)}"))
    elif num is not None:
        rows.append(("student layers", f"{num} (all of the base model's)"))
    return rows


def _trained_weights(student: Mapping[str, Any], lora: Mapping[str, Any] | None) -> str:
    if not student.get("adapter"):
        return "all weights (full fine-tuning); this repository holds the full model"
    base = "a 4-bit nf4 (bitsandbytes) base, QLoRA" if student.get("load_in_4bit") else "a frozen base"
    settings = ", ".join(f"{k}={format_setting(v)}" for k, v in (lora or {}).items() if k != "load_in_4bit")
    return f"a LoRA adapter on {base}{f' ({settings})' if settings else ''}; this repository holds the adapter only"


def setting_rows(report: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """The card's training table: (group, setting, value) rows for models, data, policy, optimization, generation
    and the run's time; settings that cannot act in this run are left out.

    `num_train_epochs` is dropped when `max_steps` sets the length, `warmup_steps` and `resumed_from_step` when they
    are 0, and the loss's memory chunk size always.

    Example:
    ```python
    >>> from hf_rockopd.publishing.card_setup import setting_rows
    >>> report = {"teacher": {"name": "t"}, "student": {"base_model": "t", "kept_layers": [0, 2]},
    ...           "policy": {"name": "uniform"}, "training": {"max_steps": 2, "num_train_epochs": 3.0}}
    >>> [row for row in setting_rows(report) if row[0] != "models"]
    [('policy', 'rock_policy', '`uniform`'), ('optimization', 'max_steps', '`2`')]
    ```
    """
    training = dict(report.get("training") or {})
    if isinstance(training.get("max_steps"), int) and training["max_steps"] > 0:
        training.pop("num_train_epochs", None)
    if not training.get("warmup_steps"):
        training.pop("warmup_steps", None)
    if not training.get("resumed_from_step"):
        training.pop("resumed_from_step", None)  # trained in one sitting
    rows = [("models", name, value) for name, value in _model_rows(report)]
    rows.append(("models", "trained weights", _trained_weights(report["student"], training.pop("lora", None))))
    data = dataset_line(report.get("dataset") or {})
    if data:
        rows.append(("data", "dataset", data))
    policy = dict(report["policy"])
    rows.append(("policy", "rock_policy", f"`{policy['name']}`"))
    # Named as the command-line flags are (`--policy.top_k`), apart from the trainer settings of the same name.
    kwargs = (policy.get("kwargs") or {}).items()
    rows += [("policy", f"policy.{key}", f"`{format_setting(value)}`") for key, value in kwargs]
    listed = {key for _, keys in SETTING_GROUPS for key in keys}
    for group, keys in SETTING_GROUPS:
        rows += [(group, key, f"`{format_setting(training[key])}`") for key in keys if key in training]
    resumed = training.get("resumed_from_step")
    if resumed:
        # A resumed run's report times its last sitting only; one that resumed its last checkpoint trained nothing
        # (it was run again to evaluate), so its train_seconds are the checkpoint's loading, not training.
        finished = resumed >= (training.get("global_step") or 0)
        sitting = {
            "train_seconds": "the last sitting only: it resumed the finished run to evaluate it and trained nothing"
            if finished else f"the last sitting only, after step {resumed}",
            "total_seconds": "the last sitting only",
        }
        rows = [(g, k, f"{v} ({sitting[k]})" if k in sitting else v) for g, k, v in rows]
    timed = training.pop("timed_steps", None)
    if timed and "step_seconds" in training:
        # The time inside optimizer steps over every sitting (hf_rockopd.trainers.clock): say which steps it covers.
        at = next(i for i, row in enumerate(rows) if row[1] == "step_seconds")
        steps = training.get("global_step") or timed
        covered = f"all {timed} steps" if timed >= steps else f"the last {timed} of {steps} steps"
        rows[at] = (*rows[at][:2], f"{rows[at][2]} over {covered}, {training['step_seconds'] / timed:.1f} s a step")
    rows += [
        ("other", key, f"`{format_setting(value)}`")
        for key, value in sorted(training.items())
        if key not in listed and key not in DROPPED_SETTINGS
    ]
    return rows


def reproduce_config(report: Mapping[str, Any]) -> dict[str, Any]:
    """The `hf-rockopd distill --config` file that reruns this run, as a dict (models and data by Hub id).

    A dataset read from a local copy of a Hub dataset is named by its Hub id; another local file stays a placeholder
    to fill in. Recorded `distill_args` (runs from this version on) win over what older reports let us infer.

    Example:
    ```python
    >>> from hf_rockopd.publishing.card_setup import reproduce_config
    >>> report = {"teacher": {"name": "t/t"}, "student": {"base_model": "t/t", "kept_layers": [0, 2]},
    ...           "dataset": {"name": "x/gsm8k.jsonl", "num_train": 8, "num_eval": 2},
    ...           "policy": {"name": "uniform", "kwargs": {}}, "training": {"max_steps": 2}}
    >>> config = reproduce_config(report)
    >>> config["teacher"], config["student_layers"], config["dataset"], config["num_train_prompts"]
    ('t/t', [0, 2], 'openai/gsm8k', 8)
    ```
    """
    teacher, student = report["teacher"], report["student"]
    dataset, training = dict(report.get("dataset") or {}), dict(report.get("training") or {})
    config: dict[str, Any] = {"teacher": teacher["name"]}
    if student["base_model"] != teacher["name"]:
        config["student"] = student["base_model"] if is_hub_id(student["base_model"]) else "<your student model>"
    if student.get("kept_layers"):
        config["student_layers"] = list(student["kept_layers"])
    config["dataset"] = hub_dataset_id(dataset) or "<your dataset: a Hub id or a JSONL/Parquet/CSV file>"
    if dataset.get("config") not in (None, DEFAULT_CONFIGS.get(config["dataset"])):
        config["dataset_config"] = dataset["config"]
    for key, option in (("num_train", "num_train_prompts"), ("num_eval", "num_eval_problems")):
        if dataset.get(key) is not None:
            config[option] = dataset[key]
    evaluation = report.get("eval") or {}
    settings = (evaluation.get("after") or evaluation.get("before") or {}).get("settings") or {}
    for key, option in (("max_new_tokens", "eval_max_new_tokens"), ("batch_size", "eval_batch_size")):
        if key in settings:
            config[option] = settings[key]
    if report.get("eval") is not None and not evaluation.get("before") and not evaluation.get("after"):
        config["skip_eval"] = True
    recorded = dict(report.get("distill_args") or {})
    for key in ("student_num_layers", "student_layers", "dataset_config", "num_train_prompts", "num_eval_problems",
                "system_prompt", "eval_max_new_tokens", "eval_batch_size", "skip_eval"):
        if recorded.get(key) not in (None, False) and not (key == "dataset_config" and recorded[key] == "main"):
            config[key] = recorded[key]
    if "student_layers" in config and "student_num_layers" in config:
        del config["student_num_layers"]  # the exact layers say it all
    lora = training.pop("lora", None)
    if lora or student.get("adapter"):
        config["use_peft"] = True
        config.update({f"lora_{k}" if k != "load_in_4bit" else k: v for k, v in (lora or {}).items()})
        if student.get("load_in_4bit"):
            config["load_in_4bit"] = True
    config["rock_policy"] = report["policy"]["name"]
    if report["policy"].get("kwargs"):
        config["rock_policy_kwargs"] = dict(report["policy"]["kwargs"])
    skipped = {"num_train_epochs", "train_seconds", "total_seconds", "global_step", "resumed_from_step"}
    config.update({k: v for k, v in training.items() if k not in skipped and v is not None})
    # A live trainer's settings hold enums (SchedulerType): plain JSON values, as a YAML file has them.
    return json.loads(json.dumps(config, default=str))
