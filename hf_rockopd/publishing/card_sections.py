"""What each section of a model card says: the template's variables, computed from a run report and a rock set.

Pure functions of the report (`hf_rockopd.publishing.run_report`) and of the `rock_tokens.json` payload; rendering,
front matter and files are `hf_rockopd.publishing.model_card`'s job. The setup table and the config to rerun the run
come from `card_setup`, the limitations from `limitations`.

Example:
```python
>>> from hf_rockopd.publishing.card_sections import card_sections
>>> report = {"teacher": {"name": "HuggingFaceTB/SmolLM2-360M-Instruct"},
...           "student": {"name": "tiny", "base_model": "b", "adapter": False, "num_layers": 2},
...           "policy": {"name": "uniform"}, "training": {"max_steps": 2}}
>>> sections = card_sections(report, {"tokens": [], "policy": "uniform"}, model_id="me/tiny")
>>> print(sections["teacher"]["link"])
[`HuggingFaceTB/SmolLM2-360M-Instruct`](https://huggingface.co/HuggingFaceTB/SmolLM2-360M-Instruct)
>>> sections["trainer"]["name"], sections["settings"][-1]
('RockOPDTrainer', ('optimization', 'max_steps', '`2`'))
```
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import yaml
from transformers.utils import logging

from .._version import __version__
from ..models.sources import GGUF_SOURCES
from ..policies import policy_summary
from .card_setup import format_setting, hub_dataset_id, is_hub_id, reproduce_config, setting_rows
from .limitations import limitations


logger = logging.get_logger(__name__)

__all__ = ["DEFAULT_TRAINER", "EVAL_FIELDS", "card_sections", "default_license", "hub_dataset_id", "is_hub_id"]

# `EvalResult` fields in table order (hf_rockopd.evaluation): outcome, answer shape, then divergences; other scalar
# keys of a result follow them.
EVAL_FIELDS = (
    "accuracy",
    "accuracy_low",
    "accuracy_high",
    "teacher_accuracy",
    "num_problems",
    "finished_rate",
    "clipped_ratio",
    "cut_ratio",
    "loop_rate",
    "repeated_ngram_fraction",
    "distinct_1",
    "distinct_2",
    "mean_completion_length",
    "num_tokens",
    "teacher_forced_divergence",
    "teacher_forced_top1_agreement",
    "mean_divergence",
    "mean_divergence_non_rock",
    "rock_token_share",
    "top1_agreement",
)
# The trainer of reports written before they recorded one: `hf-rockopd distill` trained with RockOPDTrainer.
DEFAULT_TRAINER = {"name": "RockOPDTrainer", "base": "GKDTrainer", "tags": ["trl", "gkd"]}


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
    # Four decimals read well for rates, accuracies and divergences (a change of 0.0080 in a rate); values below
    # 0.001 would lose their digits to 0.000x, so they are written in scientific notation.
    if not math.isfinite(value):
        return str(value)
    if value != 0 and abs(value) < 0.001:
        return f"{value:{sign}.3e}"
    return f"{value:{sign}.4f}"


def _delta(before: Any, after: Any) -> str:
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (before, after))
    if not numeric:
        return "—"
    if isinstance(before, int) and isinstance(after, int):
        return f"{after - before:+d}"
    return _float(after - before, sign="+")


def _token_cell(token: Any) -> str:
    if token is None:
        return "(not decoded)"
    # repr keeps whitespace and newlines visible; double backticks let a token hold a single backtick.
    cell = f"`` {repr(token).replace('|', chr(92) + '|')} ``"
    # Byte-level tokenizers decode a lone piece of a multi-byte character as U+FFFD; several rocks can look alike.
    return f"{cell} (part of a multi-byte character)" if "\ufffd" in token else cell


# Accuracies whose 95 % Wilson bounds (`<name>_low`, `<name>_high`) go in their own cell: `0.3120 [0.2578, 0.3719]`.
_WITH_INTERVAL = ("accuracy", "teacher_accuracy")


def _with_interval(result: Mapping[str, Any], key: str) -> str:
    low, high = result.get(f"{key}_low"), result.get(f"{key}_high")
    cell = _number(result.get(key))
    if key in _WITH_INTERVAL and isinstance(low, float) and isinstance(high, float):
        cell += f" [{_float(low)}, {_float(high)}]"
    return cell


def _eval_rows(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[dict[str, str]]:
    extra = sorted(
        k for k in {*before, *after}
        if k not in EVAL_FIELDS and k != "settings" and not isinstance(before.get(k, after.get(k)), (dict, list))
    )
    bounds = {f"{key}_{end}" for key in _WITH_INTERVAL for end in ("low", "high")}
    rows = []
    for key in [*EVAL_FIELDS, *extra]:
        if (key not in before and key not in after) or key in bounds:
            continue
        b, a = before.get(key), after.get(key)
        if b is None and a is None:
            continue  # measured by neither evaluation (no teacher at evaluation time, no rock set): an empty row
        rows.append({"name": key, "before": _with_interval(before, key), "after": _with_interval(after, key),
                     "delta": _delta(b, a)})
    return rows


# What an evaluation's cache was keyed by (fingerprints of weights and problems): bookkeeping, not a setting to read.
_UNSHOWN_EVAL_SETTINGS = ("cache_key",)


def _eval_settings(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    b, a = before.get("settings") or {}, after.get("settings") or {}
    b, a = ({k: v for k, v in d.items() if k not in _UNSHOWN_EVAL_SETTINGS} for d in (b, a))
    parts = [f"{k}={format_setting(a[k])}" for k in a if k in b and a[k] == b[k]]
    # Some settings differ by design (the rock set exists only after training, timings): show both values.
    parts += [
        f"{k}: {format_setting(b.get(k))} before, {format_setting(a.get(k))} after"
        for k in dict.fromkeys([*b, *a])
        if not (k in a and k in b and a[k] == b[k])
    ]
    return "; ".join(parts)


def _policy_phrase(name: str) -> str | None:
    # The policy's one-line docstring as a phrase inside the card's sentence: "(plain on-policy distillation: ...)".
    summary = policy_summary(name)
    if not summary:
        return None
    summary = summary.rstrip(".")
    return summary[0].lower() + summary[1:] if summary[:2].istitle() else summary


def _load_snippet(model_id: str, student: Mapping[str, Any]) -> str:
    base, kept = student["base_model"], student.get("kept_layers")
    if not is_hub_id(base):  # a local base is no use to a reader (and its path is not published)
        base = f"<Hub id or path of {os.path.basename(os.path.normpath(str(base)))}>"
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


def _score(row: Mapping[str, Any]) -> float:
    value = row.get("rock_score")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else -math.inf


def _rock_rows(rock_tokens: Mapping[str, Any] | None) -> tuple[list[dict[str, Any]], str]:
    if rock_tokens is None:
        return [], "No rock-token file was found for this run."
    rows = []
    # Ranked by the Rock Score R(v), highest first, whatever order the policy stored them in (rows without a score
    # last, in their stored order).
    tokens = sorted(rock_tokens.get("tokens") or [], key=lambda row: -_score(row))
    for rank, row in enumerate(tokens, start=1):
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


# Bases whose model cards on the Hub state Apache-2.0 (the larger Qwen2.5-Coder sizes do not all: 3B is
# qwen-research), matched by name.
_APACHE_BASES = ("SmolLM2", "Qwen2.5-Coder-0.5B", "Qwen2.5-Coder-1.5B")


def default_license(report: Mapping[str, Any]) -> str:
    """The report's `license`, else `apache-2.0` for a SmolLM2 or Qwen2.5-Coder 0.5B/1.5B student, else `other` (with
    a warning, once).

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
    if any(name in base for name in _APACHE_BASES):
        return "apache-2.0"
    # Once per process: a run that saves a checkpoint every N steps renders a card each time.
    logger.warning_once(
        f"No license given for a student of {base!r}; the card says 'other'. Pass license=... (the base model's)."
    )
    return "other"


# ------------------------------------------------------------------------------------------------ sections ----
class _ConfigDumper(yaml.SafeDumper):
    """Block-style mappings with one-line lists, as in examples/configs (`student_layers: [0, 1, ...]`)."""


_ConfigDumper.add_representer(
    list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)


def _trainer(report: Mapping[str, Any]) -> dict[str, Any]:
    trainer = {**DEFAULT_TRAINER, **(report.get("trainer") or {})}
    base = trainer.get("base")
    trainer["phrase"] = f"a subclass of TRL's `{base}`" if base else "a transformers `Trainer`"
    return trainer


def _how_to_fill(model_id: str | None, name: str) -> tuple[str, str | None]:
    """The loading snippet's model id, and how to fill it in when the run names no Hub repository."""
    if model_id:
        return model_id, None
    placeholder = f"your-namespace/{name.split('/')[-1]}"
    return placeholder, (
        f"This run was not pushed to the Hub, so `{placeholder}` is a placeholder: upload the output directory "
        f"(`hf upload {placeholder} <output_dir>`) and use your repository's id, or rerun with "
        f"`--push_to_hub --hub_model_id {placeholder}` and render the card again "
        f"(`hf-rockopd card <output_dir> --model_id {placeholder}`)."
    )


def _install_command(report: Mapping[str, Any], version: str) -> str:
    lines = [f'pip install "hf_rockopd=={version}"']
    teacher, student = report["teacher"], report["student"]
    inherited = teacher.get("source") if student.get("base_model") == teacher.get("name") else None
    for model, kind in ((teacher.get("name"), teacher.get("source")),
                        (student.get("base_model"), student.get("source") or inherited)):
        source = GGUF_SOURCES.get(model)
        if source is not None and str(kind or "").startswith("gguf"):
            # Without it the resolver would fall back to the full-precision Hub model: not what the run used.
            lines.append(f"{source.install_command}  # the run's {model}: its offline GGUF")
    return "\n".join(dict.fromkeys(lines))


def _interval(row: Mapping[str, Any]) -> str:
    return f"{row['estimate']:.3f} [{row['low']:.3f}, {row['high']:.3f}]"


def _teacher_cell(accuracy: float | None, interval: Mapping[str, Any] | None) -> str:
    """The teacher's accuracy, with its Wilson interval when the verdict kept it (verdicts before it did: without)."""
    if accuracy is None:
        return "—"
    low, high = (interval or {}).get("low"), (interval or {}).get("high")
    if low is None or high is None:
        return f"{accuracy:.3f}"
    return _interval({"estimate": accuracy, "low": low, "high": high})


def _share(value: Any, n: int) -> str:
    """A rate of the verdict's `n` answers as a percentage and a count: 0.028 of 250 -> '2.8 % (7 of 250)'."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "—"
    return f"{100 * value:.1f} % ({round(value * n)} of {n})"


def _verdict(verdict: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The held-out verdict written by `hf-rockopd verdict` (None: the run was not judged that way)."""
    if not verdict:
        return None
    teacher = verdict.get("teacher_accuracy")
    gap = verdict.get("gap_closed")
    rocks = verdict.get("p_value_rocks_vs_uniform")
    return {
        "num_problems": verdict["num_eval_problems"],
        "steps": verdict["steps"],
        "policy": verdict["policy"],
        "before": _interval(verdict["before"]),
        "after": _interval(verdict["after"]),
        "teacher": _teacher_cell(teacher, verdict.get("teacher")),
        "p_value": f"{verdict['p_value_vs_before']:.2g}",
        "gained": verdict["vs_before"]["only_first"],
        "lost": verdict["vs_before"]["only_second"],
        "gap_closed": f"{100 * gap:.0f} %" if gap is not None else None,
        "tf_before": _number(verdict.get("tf_divergence_before")),
        "tf_after": _number(verdict.get("tf_divergence_after")),
        "cut": _share(verdict.get("cut_after"), verdict["num_eval_problems"]),
        "loops": _share(verdict.get("loops_after"), verdict["num_eval_problems"]),
        "rocks_vs_uniform": f"{rocks:.2g}" if rocks is not None else None,
        "versus": _versus(verdict.get("versus")),
    }


def _versus(versus: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The other policy of the same budget, as the template states it (None: no such comparison recorded)."""
    if not versus:
        return None
    return {"policy": versus["policy"], "accuracy": f"{versus['accuracy']:.3f}", "only_this": versus["only_this"],
            "only_other": versus["only_other"], "p_value": f"{versus['p_value']:.2g}"}


def card_sections(
    report: Mapping[str, Any], rock_tokens: Mapping[str, Any] | None, model_id: str | None
) -> dict[str, Any]:
    """The template's variables for the card body (everything but the front matter and the curves image).

    `report` follows the `run_report.json` schema (`eval` may be `None`); `rock_tokens` is the `rock_tokens.json`
    payload or `None`; `model_id` is the Hub id shown in the loading snippet (`None`: a placeholder, with how to fill
    it in).

    Example:
    ```python
    >>> from hf_rockopd.publishing.card_sections import card_sections
    >>> report = {"teacher": {"name": "t"}, "student": {"name": "s", "base_model": "b", "adapter": True},
    ...           "policy": {"name": "rock_freeze", "kwargs": {"weight": 0.0}}}
    >>> sections = card_sections(report, None, model_id=None)
    >>> [row for row in sections["settings"] if row[0] == "policy"]
    [('policy', 'rock_policy', '`rock_freeze`'), ('policy', 'policy.weight', '`0.0`')]
    >>> sections["load_hint"][:36]
    'This run was not pushed to the Hub, '

    ```
    """
    teacher, student = dict(report["teacher"]), dict(report["student"])
    evaluation = None
    if report.get("eval") and (report["eval"].get("before") or report["eval"].get("after")):
        before, after = report["eval"].get("before") or {}, report["eval"].get("after") or {}
        rows = _eval_rows(before, after)
        missing = any("—" in (row["before"], row["after"]) for row in rows)
        evaluation = {"rows": rows, "settings": _eval_settings(before, after), "missing": missing}
    rows, empty_reason = _rock_rows(rock_tokens)
    name, policy = str(teacher["name"]), str(report["policy"]["name"])
    verdict = _verdict(report.get("verdict"))
    version = report.get("hf_rockopd_version") or __version__
    model_id, load_hint = _how_to_fill(model_id, str(student["name"]))
    return {
        "model_name": str(student["name"]),
        "hf_rockopd_version": version,
        "trainer": _trainer(report),
        "policy": {"name": policy, "summary": _policy_phrase(policy)},
        "teacher": {
            "name": name,
            "link": f"[`{name}`](https://huggingface.co/{name})" if is_hub_id(name) else f"`{name}`",
        },
        "limitations": limitations(report),
        "settings": setting_rows(report),
        "rock_tokens": {"rows": rows, "step": (rock_tokens or {}).get("step"), "empty_reason": empty_reason},
        "evaluation": evaluation,
        "verdict": verdict,
        "load_snippet": _load_snippet(model_id, student),
        "load_hint": load_hint,
        "install": _install_command(report, version),
        "config_yaml": yaml.dump(reproduce_config(report), Dumper=_ConfigDumper, sort_keys=False, width=100),
    }
