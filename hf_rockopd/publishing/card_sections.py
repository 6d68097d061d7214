"""What each section of a model card says: the template's variables, computed from a run report and a rock set.

Pure functions of the report (`hf_rockopd.publishing.run_report`) and of the `rock_tokens.json` payload; rendering,
front matter and files are `hf_rockopd.publishing.model_card`'s job.

Example:
```python
>>> from hf_rockopd.publishing.card_sections import card_sections
>>> report = {"teacher": {"name": "HuggingFaceTB/SmolLM2-360M-Instruct"},
...           "student": {"name": "tiny", "base_model": "b", "adapter": False, "num_layers": 2},
...           "policy": {"name": "uniform"}, "training": {"max_steps": 2}}
>>> sections = card_sections(report, {"tokens": [], "policy": "uniform"}, model_id="me/tiny")
>>> print(sections["teacher"]["link"])
[`HuggingFaceTB/SmolLM2-360M-Instruct`](https://huggingface.co/HuggingFaceTB/SmolLM2-360M-Instruct)
>>> sections["training"], sections["student"]["layers"]
([('max_steps', '2')], "2 decoder layers (all of the base model's)")
```
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers.utils import logging

from .._version import __version__
from .run_report import TRAINING_FIELDS


logger = logging.get_logger(__name__)

__all__ = ["EVAL_FIELDS", "card_sections", "default_license", "hub_dataset_id", "is_hub_id"]

# `EvalResult` fields in table order (hf_rockopd.evaluation); other scalar keys of a result follow them.
EVAL_FIELDS = (
    "accuracy",
    "num_problems",
    "mean_divergence",
    "mean_divergence_non_rock",
    "rock_token_share",
    "top1_agreement",
    "num_tokens",
    "mean_completion_length",
    "clipped_ratio",
)


def _number(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    return str(value)


def _float(value: float, sign: str = "") -> str:
    # Four decimals read well for accuracies and divergences near 1; tiny values would all print as 0.0000.
    if not math.isfinite(value):
        return str(value)
    if value != 0 and abs(value) < 0.01:
        return f"{value:{sign}.3e}"
    return f"{value:{sign}.4f}"


def _delta(before: Any, after: Any) -> str:
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (before, after))
    if not numeric:
        return "—"
    if isinstance(before, int) and isinstance(after, int):
        return f"{after - before:+d}"
    return _float(after - before, sign="+")


def _setting(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str) if not isinstance(value, str) else value
    return text.replace("|", "\\|").replace("`", "'")


def _token_cell(token: Any) -> str:
    if token is None:
        return "(not decoded)"
    # repr keeps whitespace and newlines visible; double backticks let a token hold a single backtick.
    cell = f"`` {repr(token).replace('|', chr(92) + '|')} ``"
    # Byte-level tokenizers decode a lone piece of a multi-byte character as U+FFFD; several rocks can look alike.
    return f"{cell} (part of a multi-byte character)" if "\ufffd" in token else cell


def is_hub_id(name: str | None) -> bool:
    """Whether `name` is a `namespace/name` Hub id (`huggingface_hub.utils.validate_repo_id`) and not a local path.

    Bare names (`gpt2`, `train.jsonl`) are not linked: in a run report they are local files far more often than
    legacy namespace-less Hub ids.

    Example:
    ```python
    >>> from hf_rockopd.publishing.card_sections import is_hub_id
    >>> is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct"), is_hub_id("../data/train.jsonl"), is_hub_id("gpt2")
    (True, False, False)
    ```
    """
    if not name or "/" not in name or os.path.exists(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_dataset_id(dataset: Mapping[str, Any]) -> str | None:
    """The Hub id for the card's `datasets`; local GSM8K copies are the Hub's `openai/gsm8k`.

    Example:
    ```python
    >>> from hf_rockopd.publishing.card_sections import hub_dataset_id
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


def _eval_rows(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[dict[str, str]]:
    extra = sorted(
        k for k in {*before, *after}
        if k not in EVAL_FIELDS and k != "settings" and not isinstance(before.get(k, after.get(k)), (dict, list))
    )
    rows = []
    for key in [*EVAL_FIELDS, *extra]:
        if key not in before and key not in after:
            continue
        b, a = before.get(key), after.get(key)
        rows.append({"name": key, "before": _number(b), "after": _number(a), "delta": _delta(b, a)})
    return rows


def _eval_settings(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    b, a = before.get("settings") or {}, after.get("settings") or {}
    parts = [f"{k}={_setting(a[k])}" for k in a if k in b and a[k] == b[k]]
    # Some settings differ by design (the rock set exists only after training, timings): show both values.
    parts += [
        f"{k}: {_setting(b.get(k))} before, {_setting(a.get(k))} after"
        for k in dict.fromkeys([*b, *a])
        if not (k in a and k in b and a[k] == b[k])
    ]
    return "; ".join(parts)


def _load_snippet(model_id: str, student: Mapping[str, Any]) -> str:
    base, kept = student["base_model"], student.get("kept_layers")
    if not student.get("adapter"):
        return (
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{model_id}")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{model_id}")'
        )
    quant = ""
    if student.get("load_in_4bit"):
        quant = (
            "# Trained on a 4-bit nf4 base (bitsandbytes); the adapter also loads onto a full-precision base.\n"
            "from transformers import BitsAndBytesConfig\n"
            'quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")\n\n'
        )
    quant_arg = ", quantization_config=quantization" if quant else ""
    if kept:
        # The adapter was trained on a layer-pruned copy of the base, which is not on the Hub: rebuild it first.
        return (
            "from peft import PeftModel\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "from hf_rockopd.models import prune_decoder_layers\n\n"
            f"# The adapter belongs to {base} with only decoder layers {list(kept)} kept.\n"
            f'base = AutoModelForCausalLM.from_pretrained("{base}")\n'
            f"base = prune_decoder_layers(base, keep={list(kept)})\n"
            f'model = PeftModel.from_pretrained(base, "{model_id}")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{model_id}")'
        )
    return (
        quant
        + "from peft import AutoPeftModelForCausalLM\n"
        + "from transformers import AutoTokenizer\n\n"
        + f'model = AutoPeftModelForCausalLM.from_pretrained("{model_id}"{quant_arg})  # base: {base}\n'
        + f'tokenizer = AutoTokenizer.from_pretrained("{model_id}")\n'
        + "# or: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), model_id); "
        + "model.merge_and_unload() gives a plain model"
    )


def _student_layers(student: Mapping[str, Any]) -> str:
    kept, num = student.get("kept_layers"), student.get("num_layers")
    if kept:
        return f"{len(kept)} decoder layers, kept from the base model: {list(kept)}"
    return f"{num} decoder layers (all of the base model's)" if num is not None else "as in the base model"


def _student_weights(student: Mapping[str, Any]) -> str:
    if not student.get("adapter"):
        return "all weights (full fine-tuning); this repository holds the full model"
    base = "a 4-bit nf4 (bitsandbytes) base, QLoRA" if student.get("load_in_4bit") else "a frozen base"
    return f"a LoRA adapter on {base}; this repository holds the adapter only"


def _rock_rows(rock_tokens: Mapping[str, Any] | None) -> tuple[list[dict[str, Any]], str]:
    if rock_tokens is None:
        return [], "No rock-token file was found for this run."
    rows = []
    for rank, row in enumerate(rock_tokens.get("tokens") or [], start=1):
        rows.append(
            {
                "rank": rank,
                "token": _token_cell(row.get("token")),
                "token_id": row.get("token_id"),
                "count": _number(row.get("count")),
                "mean_divergence": _number(row.get("mean_divergence")),
                "rock_score": _number(row.get("rock_score")),
            }
        )
    empty = (
        f"The policy `{rock_tokens.get('policy') or 'unknown'}` ended training with no rock token: no token was "
        "down-weighted (a `uniform` run, or an online policy that had not refreshed its set yet)."
    )
    return rows, empty


def default_license(report: Mapping[str, Any]) -> str:
    """The report's `license`, else `apache-2.0` for a SmolLM2 student, else `other` (with a warning).

    Example:
    ```python
    >>> from hf_rockopd.publishing.card_sections import default_license
    >>> default_license({"student": {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct"}})
    'apache-2.0'
    ```
    """
    if report.get("license"):
        return str(report["license"])
    base = str(report["student"].get("base_model") or "")
    if "SmolLM2" in base:
        return "apache-2.0"
    logger.warning(
        f"No license given for a student of {base!r}; the card says 'other'. Pass license=... (the base model's)."
    )
    return "other"


# ------------------------------------------------------------------------------------------------ sections ----
def card_sections(report: Mapping[str, Any], rock_tokens: Mapping[str, Any] | None, model_id: str) -> dict[str, Any]:
    """The template's variables for the card body (everything but the front matter and the curves image).

    `report` follows the `run_report.json` schema (`eval` may be `None`); `rock_tokens` is the `rock_tokens.json`
    payload or `None`; `model_id` is the Hub id shown in the loading snippet.

    Example:
    ```python
    >>> from hf_rockopd.publishing.card_sections import card_sections
    >>> report = {"teacher": {"name": "t"}, "student": {"name": "s", "base_model": "b", "adapter": True},
    ...           "policy": {"name": "rock_freeze", "kwargs": {"weight": 0.0}}}
    >>> card_sections(report, None, model_id="me/s")["policy"]
    {'name': 'rock_freeze', 'kwargs': [('weight', '0.0')]}
    ```
    """
    teacher, student = dict(report["teacher"]), dict(report["student"])
    dataset = dict(report.get("dataset") or {})
    policy = dict(report["policy"])
    evaluation = None
    if report.get("eval") and (report["eval"].get("before") or report["eval"].get("after")):
        before, after = report["eval"].get("before") or {}, report["eval"].get("after") or {}
        rows = _eval_rows(before, after)
        missing = any("—" in (row["before"], row["after"]) for row in rows)
        evaluation = {"rows": rows, "settings": _eval_settings(before, after), "missing": missing}

    sizes = ", ".join(f"{dataset[k]} {k[4:]}" for k in ("num_train", "num_eval") if dataset.get(k) is not None)
    training = dict(report.get("training") or {})
    training_rows = [(k, _setting(training[k])) for k in TRAINING_FIELDS if k in training]
    training_rows += [(k, _setting(v)) for k, v in sorted(training.items()) if k not in TRAINING_FIELDS]
    rows, empty_reason = _rock_rows(rock_tokens)
    name = str(teacher["name"])
    return {
        "model_name": str(student["name"]),
        "hf_rockopd_version": report.get("hf_rockopd_version") or __version__,
        "teacher": {
            "name": name,
            "source": teacher.get("source"),
            "link": f"[`{name}`](https://huggingface.co/{name})" if is_hub_id(name) else f"`{name}`",
        },
        "student": {
            "base_model": student["base_model"],
            "layers": _student_layers(student),
            "weights": _student_weights(student),
        },
        "dataset": {"name": dataset.get("name"), "sizes": sizes},
        "policy": {"name": policy["name"], "kwargs": [(k, _setting(v)) for k, v in (policy.get("kwargs") or {}).items()]},
        "rock_tokens": {"rows": rows, "step": (rock_tokens or {}).get("step"), "empty_reason": empty_reason},
        "training": training_rows,
        "evaluation": evaluation,
        "load_snippet": _load_snippet(model_id, student),
        "command": report.get("command"),
    }
