"""Model cards of distilled students, rendered through `huggingface_hub.ModelCard` from a run's files or a trainer.

A run directory written by `hf-rockopd distill` holds `run_report.json` (models, data, policy, training settings,
evaluation before and after, `log_history`) and `rock_tokens.json` (the trainer's final rock set). The card is the
Jinja template `hf_rockopd/model_card.md.j2` (package data) filled from them: front matter from `ModelCardData` (never
hand-written YAML), a body with the models, the policy, the rock tokens decoded, the training curves (a PNG written
next to the card), the evaluation table, how to load the model and the citations.

Example:
```python
from hf_rockopd.model_card import write_model_card
write_model_card("runs/smollm2-rockopd")                                       # runs/smollm2-rockopd/README.md
write_model_card("runs/smollm2-rockopd", out="model_cards/examples/smollm2-rockopd.md")
```
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from transformers.utils import logging


logger = logging.get_logger(__name__)

__all__ = [
    "CARD_TAGS",
    "CURVES_NAME",
    "EVAL_FIELDS",
    "RUN_REPORT_NAME",
    "TEMPLATE_PATH",
    "RunReportError",
    "build_model_card",
    "load_rock_tokens",
    "load_run_report",
    "model_card_from_trainer",
    "plot_training_curves",
    "render_model_card",
    "write_model_card",
]

RUN_REPORT_NAME = "run_report.json"
ROCK_TOKENS_NAME = "rock_tokens.json"
CARD_NAME = "README.md"
CURVES_NAME = "training_curves.png"
# Shipped inside the package (pyproject's package-data), so a wheel install finds it too, not only a clone.
TEMPLATE_PATH = Path(__file__).resolve().parent / "model_card.md.j2"
CARD_TAGS = ("hf_rockopd", "trl", "distillation", "on-policy-distillation", "rock-tokens")
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
# The `training` settings shown first, in this order; any others follow sorted.
_TRAINING_ORDER = (
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
    "train_seconds",
)
_REQUIRED = {
    "teacher": ("name",),
    "student": ("name", "base_model", "adapter"),
    "policy": ("name",),
    "eval": ("before", "after"),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_PRODUCE_HINT = (
    "It is written by `hf-rockopd distill` at the end of a run; rerun it, or write the file with the keys listed in "
    "hf_rockopd.model_card.load_run_report."
)


class RunReportError(ValueError):
    """A run directory's `run_report.json` or `rock_tokens.json` is missing, unreadable or incomplete."""


# ------------------------------------------------------------------------------------------------- reading ----
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
    from hf_rockopd.model_card import load_run_report
    report = load_run_report("runs/smollm2-rockopd")
    print(report["eval"]["after"]["accuracy"])
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


def load_rock_tokens(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Read `run_dir/rock_tokens.json` as the trainer wrote it (an empty `tokens` list when nothing was frozen).

    Example:
    ```python
    from hf_rockopd.model_card import load_rock_tokens
    print([row["token"] for row in load_rock_tokens("runs/smollm2-rockopd")["tokens"]])
    ```
    """
    path = Path(run_dir) / ROCK_TOKENS_NAME
    data = _read_json(
        path, "RockOPDTrainer writes it to its output directory at the end of train() (write_rock_tokens)."
    )
    if not isinstance(data, dict) or not isinstance(data.get("tokens", data.get("token_ids")), list):
        raise RunReportError(
            f"{path} is not a rock-set file: expected a JSON object with a 'tokens' list, as written by "
            "RockOPDTrainer.write_rock_tokens."
        )
    if "tokens" not in data:
        data["tokens"] = [{"token_id": int(i)} for i in data["token_ids"]]
    return data


# ------------------------------------------------------------------------------------------------ figures ----
def _curve_keys(log_history: Sequence[Mapping[str, Any]]) -> list[str]:
    keys: dict[str, None] = {}
    for entry in log_history:
        if "step" not in entry:
            continue
        for key, value in entry.items():
            plotted = key in ("loss", "eval_loss") or key.startswith(("rock/", "eval_rock/", "completions/"))
            if plotted and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                keys[key] = None
    return sorted(keys, key=lambda k: (k not in ("loss", "eval_loss"), k))


def plot_training_curves(log_history: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> str | None:
    """Plot loss and the `rock/` (and `completions/`) metrics of `log_history` against the step, one panel each.

    Writes a PNG to `path` and returns it, or returns `None` (and writes nothing) when no such metric was logged.

    Example:
    ```python
    from hf_rockopd.model_card import plot_training_curves
    plot_training_curves(trainer.state.log_history, "training_curves.png")
    ```
    """
    keys = _curve_keys(log_history)
    if not keys:
        return None
    # The object-oriented API leaves pyplot's global state (and the user's backend) alone.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    figure = Figure(figsize=(4.2 * ncols, 2.8 * nrows), layout="constrained")
    axes = figure.subplots(nrows, ncols, squeeze=False).ravel()
    # One step range for every panel, so a metric logged only late in training is placed where it happened.
    all_steps = [e["step"] for e in log_history if "step" in e]
    pad = max(0.5, 0.03 * (max(all_steps) - min(all_steps)))
    for ax, key in zip(axes, keys):
        points = [(e["step"], e[key]) for e in log_history if "step" in e and isinstance(e.get(key), (int, float))]
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_xlim(min(all_steps) - pad, max(all_steps) + pad)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


# ------------------------------------------------------------------------------------------------- values ----
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


def _is_hub_id(name: str | None) -> bool:
    return bool(name) and bool(_HUB_ID.match(name)) and not os.path.exists(name)


def _hub_dataset_id(dataset: Mapping[str, Any]) -> str | None:
    """The Hub id for the card's `datasets`; local GSM8K copies are the Hub's `openai/gsm8k`."""
    if dataset.get("hub_id"):
        return str(dataset["hub_id"])
    name = str(dataset.get("name") or "")
    if _is_hub_id(name):
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


def _default_license(report: Mapping[str, Any]) -> str:
    if report.get("license"):
        return str(report["license"])
    base = str(report["student"].get("base_model") or "")
    if "SmolLM2" in base:
        return "apache-2.0"
    logger.warning(
        f"No license given for a student of {base!r}; the card says 'other'. Pass license=... (the base model's)."
    )
    return "other"


# ------------------------------------------------------------------------------------------------ rendering ----
def build_model_card(
    report: Mapping[str, Any],
    rock_tokens: Mapping[str, Any] | None,
    *,
    curves_path: str | os.PathLike | None = None,
    model_id: str | None = None,
    extra_tags: Iterable[str] = (),
    template_path: str | os.PathLike | None = None,
) -> ModelCard:
    """Render the card of a run from its report (the `run_report.json` schema; `eval` may be `None`) and rock set.

    Args:
        report: the run report (see [`load_run_report`]).
        rock_tokens: the `rock_tokens.json` payload, or `None` when there is none.
        curves_path: where to write the training-curves PNG; the card references it by file name, so put it next to
            the card. `None` renders no image.
        model_id: the Hub id used in the loading snippet (default: `report["hub_model_id"]`, else a placeholder).
        extra_tags: tags added to the required ones (the trainer's `_tag_names`).
        template_path: a Jinja template to use instead of the packaged `hf_rockopd/model_card.md.j2`.

    Example:
    ```python
    from hf_rockopd.model_card import build_model_card, load_rock_tokens, load_run_report
    card = build_model_card(load_run_report("run"), load_rock_tokens("run"), curves_path="run/training_curves.png")
    card.save("run/README.md")
    ```
    """
    template = Path(template_path) if template_path is not None else TEMPLATE_PATH
    if not template.is_file():
        raise FileNotFoundError(
            f"Model-card template {template} not found. The default ships inside the package (hf_rockopd/"
            "model_card.md.j2): reinstall hf_rockopd, or pass template_path= to a Jinja template of your own."
        )
    teacher, student = dict(report["teacher"]), dict(report["student"])
    dataset = dict(report.get("dataset") or {})
    policy = dict(report["policy"])
    adapter = bool(student.get("adapter"))
    model_name = str(student["name"])
    model_id = model_id or report.get("hub_model_id") or f"your-namespace/{model_name.split('/')[-1]}"

    tags = list(CARD_TAGS)
    extra = [*extra_tags, *(["peft", "lora"] if adapter else [])]
    extra += ["4-bit", "bitsandbytes"] if student.get("load_in_4bit") else []
    tags += [t for t in dict.fromkeys(extra) if t not in tags]
    base_model = student["base_model"] if _is_hub_id(student.get("base_model")) else None
    dataset_id = _hub_dataset_id(dataset)
    card_data = ModelCardData(
        base_model=base_model,
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        license=_default_license(report),
        datasets=[dataset_id] if dataset_id else None,
        tags=tags,
        model_name=model_name,
        language=report.get("language"),
        # The Hub's relation to base_model: a pruned, distilled copy is a fine-tune; a LoRA student an adapter.
        base_model_relation=("adapter" if adapter else "finetune") if base_model else None,
    )

    log_history = report.get("log_history") or []
    curves_image = None
    if curves_path is not None and plot_training_curves(log_history, curves_path) is not None:
        curves_image = os.path.basename(os.fspath(curves_path))

    evaluation = None
    if report.get("eval") and (report["eval"].get("before") or report["eval"].get("after")):
        before, after = report["eval"].get("before") or {}, report["eval"].get("after") or {}
        rows = _eval_rows(before, after)
        missing = any("—" in (row["before"], row["after"]) for row in rows)
        evaluation = {"rows": rows, "settings": _eval_settings(before, after), "missing": missing}

    sizes = ", ".join(f"{dataset[k]} {k[4:]}" for k in ("num_train", "num_eval") if dataset.get(k) is not None)
    training = dict(report.get("training") or {})
    training_rows = [(k, _setting(training[k])) for k in _TRAINING_ORDER if k in training]
    training_rows += [(k, _setting(v)) for k, v in sorted(training.items()) if k not in _TRAINING_ORDER]
    rows, empty_reason = _rock_rows(rock_tokens)
    name = str(teacher["name"])
    return ModelCard.from_template(
        card_data,
        template_path=str(template),
        model_name=model_name,
        hf_rockopd_version=report.get("hf_rockopd_version") or _version(),
        teacher={
            "name": name,
            "source": teacher.get("source"),
            "link": f"[`{name}`](https://huggingface.co/{name})" if _is_hub_id(name) else f"`{name}`",
        },
        student={
            "base_model": student["base_model"],
            "layers": _student_layers(student),
            "weights": _student_weights(student),
        },
        dataset={"name": dataset.get("name"), "sizes": sizes},
        policy={"name": policy["name"], "kwargs": [(k, _setting(v)) for k, v in (policy.get("kwargs") or {}).items()]},
        rock_tokens={"rows": rows, "step": (rock_tokens or {}).get("step"), "empty_reason": empty_reason},
        training=training_rows,
        curves_image=curves_image,
        evaluation=evaluation,
        load_snippet=_load_snippet(model_id, student),
        command=report.get("command"),
    )


def _version() -> str:
    from . import __version__

    return __version__


def _check_model_files(run_dir: Path, report: Mapping[str, Any]) -> None:
    """A card whose `library_name` contradicts the saved weights would load the wrong way: refuse it."""
    has_adapter = (run_dir / "adapter_config.json").is_file()
    has_full = (run_dir / "config.json").is_file() and not has_adapter
    adapter = bool(report["student"]["adapter"])
    if adapter and has_full:
        raise RunReportError(
            f"{run_dir / RUN_REPORT_NAME} says the student is a LoRA adapter (student.adapter=true), but {run_dir} "
            "holds a full model (config.json, no adapter_config.json). Fix student.adapter or the saved files."
        )
    if not adapter and has_adapter:
        raise RunReportError(
            f"{run_dir / RUN_REPORT_NAME} says the student is a full model (student.adapter=false), but {run_dir} "
            "holds a LoRA adapter (adapter_config.json). Fix student.adapter or the saved files."
        )


def render_model_card(
    run_dir: str | os.PathLike,
    *,
    curves_path: str | os.PathLike | None = None,
    model_id: str | None = None,
    template_path: str | os.PathLike | None = None,
) -> ModelCard:
    """The card of a saved run, from `run_dir/run_report.json` and `run_dir/rock_tokens.json`.

    The training curves are written to `curves_path` (default `run_dir/training_curves.png`), which must end up next
    to the card. Raises [`RunReportError`] naming the file when either file is missing, malformed or incomplete.

    Example:
    ```python
    from hf_rockopd.model_card import render_model_card
    card = render_model_card("runs/smollm2-rockopd", model_id="me/smollm2-rockopd")
    print(card.data.tags)
    ```
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunReportError(
            f"Run directory {run_dir} does not exist. Give the output directory of `hf-rockopd distill`."
        )
    report = load_run_report(run_dir)
    _check_model_files(run_dir, report)
    rock_tokens = load_rock_tokens(run_dir)
    from .trainer import RockOPDTrainer

    return build_model_card(
        report,
        rock_tokens,
        curves_path=curves_path if curves_path is not None else run_dir / CURVES_NAME,
        model_id=model_id,
        extra_tags=RockOPDTrainer._tag_names,
        template_path=template_path,
    )


def _curves_path_for(card_path: Path) -> Path:
    # Several example cards share model_cards/examples/, so a card not named README.md gets its own image name.
    name = CURVES_NAME if card_path.name == CARD_NAME else f"{card_path.stem}_{CURVES_NAME}"
    return card_path.parent / name


def write_model_card(
    run_dir: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    model_id: str | None = None,
    template_path: str | os.PathLike | None = None,
) -> str:
    """Render the card of a saved run and write it to `out` (default `run_dir/README.md`); return its path.

    The training curves go next to it: `training_curves.png` for a `README.md`, else `<card stem>_training_curves.png`.

    Example:
    ```python
    from hf_rockopd.model_card import write_model_card
    write_model_card("runs/smollm2-rockopd", out="model_cards/examples/smollm2-rockopd.md")
    ```
    """
    out = Path(out) if out is not None else Path(run_dir) / CARD_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    card = render_model_card(run_dir, curves_path=_curves_path_for(out), model_id=model_id, template_path=template_path)
    card.save(out)
    return os.fspath(out)


# --------------------------------------------------------------------------------------------- the trainer ----
def _config_name(model: Any) -> str | None:
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    return str(name) if name else None


def _trainer_report(trainer: Any, model_name: str, dataset_name: str | None) -> dict[str, Any]:
    """What a trainer knows about its run, in the `run_report.json` schema (without an evaluation)."""
    from accelerate.utils import is_peft_model

    from . import __version__

    args = trainer.args
    student = trainer.accelerator.unwrap_model(trainer.model)
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    adapter = is_peft_model(student)
    base = student.get_base_model() if adapter else student
    base_name = _config_name(base)
    if adapter:
        peft_config = student.peft_config.get(getattr(student, "active_adapter", "default"))
        base_name = getattr(peft_config, "base_model_name_or_path", None) or base_name
    teacher_name = _config_name(teacher)
    training = {
        key: getattr(args, key)
        for key in (
            "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
            "max_new_tokens", "beta", "lmbda", "temperature", "loss_temperature", "seed", "rock_normalization",
            "rock_probe_fraction",
        )
        if hasattr(args, key)
    }
    training["global_step"] = trainer.state.global_step
    train_dataset = getattr(trainer, "train_dataset", None)
    return {
        "hf_rockopd_version": __version__,
        "teacher": {
            "name": teacher_name or f"{type(teacher).__name__} (in memory)",
            "source": "path" if teacher_name and os.path.isdir(teacher_name) else None,
        },
        "student": {
            "name": model_name,
            "base_model": base_name or f"{type(base).__name__} (in memory)",
            "kept_layers": None,
            "num_layers": base.config.get_text_config().num_hidden_layers,
            "adapter": adapter,
            "load_in_4bit": bool(getattr(trainer, "_has_4bit_layers", False)),
        },
        "dataset": {
            "name": dataset_name,
            "num_train": len(train_dataset) if hasattr(train_dataset, "__len__") else None,
        },
        "policy": {"name": trainer.rock_policy.name, "kwargs": dict(args.rock_policy_kwargs or {})},
        "training": training,
        "eval": None,
        "log_history": list(trainer.state.log_history),
        "hub_model_id": trainer.hub_model_id or args.hub_model_id,
    }


def _trainer_rock_tokens(trainer: Any) -> dict[str, Any]:
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    rows = trainer.rock_policy.rock_table()
    for row in rows:
        row["token"] = tokenizer.decode([row["token_id"]]) if tokenizer is not None else None
    return {"tokens": rows, "policy": trainer.rock_policy.name, "step": trainer.state.global_step}


def model_card_from_trainer(
    trainer: Any,
    model_name: str | None = None,
    dataset_name: str | None = None,
    tags: str | Sequence[str] | None = None,
    license: str | None = None,
    language: str | None = None,
    finetuned_from: str | None = None,
    curves_path: str | os.PathLike | None = None,
) -> ModelCard:
    """The card of a `RockOPDTrainer`'s run, from what it knows: models, arguments, policy, rock set, log history.

    When the output directory holds a valid `run_report.json` (written by `hf-rockopd distill`), its evaluation and
    its descriptions of the models and data are used too; an invalid one is skipped with a warning, so a checkpoint
    save never fails on it.

    Example:
    ```python
    from hf_rockopd.model_card import model_card_from_trainer
    model_card_from_trainer(trainer, model_name="smollm2-rockopd").save("out/README.md")
    ```
    """
    output_dir = Path(trainer.args.output_dir)
    model_name = model_name or output_dir.name
    report = _trainer_report(trainer, model_name, dataset_name)
    if (output_dir / RUN_REPORT_NAME).is_file():
        try:
            saved = load_run_report(output_dir)
        except RunReportError as err:
            logger.warning(f"The model card is rendered without the run report: {err}")
        else:
            # The saved report knows what the trainer cannot (teacher source, kept layers, data sizes, evaluation);
            # the trainer knows the current policy state and log history.
            for key in ("teacher", "student", "dataset", "training"):
                report[key] = {**report[key], **{k: v for k, v in (saved.get(key) or {}).items() if v is not None}}
            report["student"]["name"] = model_name
            for key in ("eval", "command", "license", "language", "hf_rockopd_version"):
                if saved.get(key) is not None:
                    report[key] = saved[key]
    if license is not None:
        report["license"] = license
    if language is not None:
        report["language"] = language
    if finetuned_from is not None:
        report["student"]["base_model"] = finetuned_from
    extra = [tags] if isinstance(tags, str) else list(tags or [])
    return build_model_card(
        report,
        _trainer_rock_tokens(trainer),
        curves_path=curves_path if curves_path is not None else output_dir / CURVES_NAME,
        extra_tags=[*extra, *trainer._tag_names],
    )
