"""Model cards of distilled students, rendered through `huggingface_hub.ModelCard` from a run's files or a trainer.

A run directory written by `hf-rockopd distill` holds `run_report.json` (models, data, policy, training settings,
evaluation before and after, `log_history`; see `hf_rockopd.publishing.run_report`) and `rock_tokens.json` (the
trainer's final rock set; see `hf_rockopd.policies.rock_set`). The card is the Jinja template
`hf_rockopd/publishing/model_card.md.j2` (package data) filled from them: front matter from `ModelCardData` (never
hand-written YAML), a body with the limitations the evaluation showed, the grouped training settings (models, data,
policy, optimization, generation), the training curves (a PNG written next to the card), the rock tokens ranked by
R(v), the evaluation table, how to load the model, how to reproduce the run and the citations. A card is published:
it shows no local path.

Example:
```python
from hf_rockopd.publishing.model_card import write_model_card
write_model_card("runs/smollm2-rockopd")                                       # runs/smollm2-rockopd/README.md
write_model_card("runs/smollm2-rockopd", out="model_cards/examples/smollm2-rockopd.md")
```
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from transformers.utils import logging

from ..policies.rock_set import decode_rock_rows, load_rock_tokens
from .card_sections import DEFAULT_TRAINER, EVAL_FIELDS, card_sections, default_license
from .card_setup import hub_dataset_id, is_hub_id
from .plots import first_freeze_step, plot_training_curves, smoothing_window
from .run_report import (
    CARD_NAME,
    CURVES_NAME,
    RUN_REPORT_NAME,
    RunReportError,
    load_run_report,
    run_report_from_trainer,
)


logger = logging.get_logger(__name__)

__all__ = [
    "CARD_TAGS",
    "EVAL_FIELDS",
    "TEMPLATE_PATH",
    "build_model_card",
    "model_card_from_trainer",
    "render_model_card",
    "trainer_tags",
    "write_model_card",
]

# Shipped inside the package (pyproject's package-data), so a wheel install finds it too, not only a clone.
TEMPLATE_PATH = Path(__file__).resolve().parent / "model_card.md.j2"
# Every card has these tags; a trainer adds its own (`trainer_tags`).
CARD_TAGS = ("hf_rockopd", "trl", "distillation", "on-policy-distillation", "rock-tokens")
def trainer_tags(base: str) -> list[str]:
    """The Hub tags of a rock-token trainer built on TRL's trainer `base` (its `_tag_names`): the card's and the base's.

    Example:
    ```python
    >>> from hf_rockopd.publishing.model_card import trainer_tags
    >>> trainer_tags("gkd")
    ['trl', 'gkd', 'hf_rockopd', 'distillation', 'on-policy-distillation', 'rock-tokens']
    ```
    """
    return ["trl", base, *(tag for tag in CARD_TAGS if tag != "trl")]


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
        model_id: the Hub id used in the loading snippet (default: `report["hub_model_id"]`, else a placeholder and
            how to fill it in).
        extra_tags: tags added to the required ones (the trainer's `_tag_names`).
        template_path: a Jinja template to use instead of the packaged `hf_rockopd/publishing/model_card.md.j2`.

    Example:
    ```python
    from hf_rockopd.publishing.model_card import build_model_card
    from hf_rockopd.publishing.run_report import load_run_report
    from hf_rockopd.policies.rock_set import load_rock_tokens
    card = build_model_card(load_run_report("run"), load_rock_tokens("run"), curves_path="run/training_curves.png")
    card.save("run/README.md")
    ```
    """
    template = Path(template_path) if template_path is not None else TEMPLATE_PATH
    if not template.is_file():
        raise FileNotFoundError(
            f"Model-card template {template} not found. The default ships inside the package (hf_rockopd/"
            "publishing/model_card.md.j2): reinstall hf_rockopd, or pass template_path= to a Jinja template of your own."
        )
    student = dict(report["student"])
    adapter = bool(student.get("adapter"))
    model_name = str(student["name"])
    model_id = model_id or report.get("hub_model_id")

    tags = list(CARD_TAGS)
    extra = [*extra_tags, *(["peft", "lora"] if adapter else [])]
    extra += ["4-bit", "bitsandbytes"] if student.get("load_in_4bit") else []
    tags += [t for t in dict.fromkeys(extra) if t not in tags]
    base_model = student["base_model"] if is_hub_id(student.get("base_model")) else None
    dataset_id = hub_dataset_id(dict(report.get("dataset") or {}))
    card_data = ModelCardData(
        base_model=base_model,
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        license=default_license(report),
        datasets=[dataset_id] if dataset_id else None,
        tags=tags,
        model_name=model_name,
        language=report.get("language"),
        # The Hub's relation to base_model: a pruned, distilled copy is a fine-tune; a LoRA student an adapter.
        base_model_relation=("adapter" if adapter else "finetune") if base_model else None,
    )

    log_history = report.get("log_history") or []
    curves_image = None
    title = f"{model_name}: training curves (token policy {report['policy']['name']})"
    if curves_path is not None and plot_training_curves(log_history, curves_path, title=title) is not None:
        curves_image = os.path.basename(os.fspath(curves_path))

    return ModelCard.from_template(
        card_data,
        template_path=str(template),
        curves_image=curves_image,
        frozen_at=first_freeze_step(log_history),
        smoothing=smoothing_window(sum(1 for entry in log_history if "loss" in entry)),
        **card_sections(report, rock_tokens, model_id),
    )


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
    from hf_rockopd.publishing.model_card import render_model_card
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
    try:
        rock_tokens = load_rock_tokens(run_dir)
    except (FileNotFoundError, ValueError) as err:
        raise RunReportError(str(err)) from err
    return build_model_card(
        report,
        rock_tokens,
        curves_path=curves_path if curves_path is not None else run_dir / CURVES_NAME,
        model_id=model_id,
        # Reports written before the trainer was recorded come from RockOPDTrainer (TRL's GKD).
        extra_tags=(report.get("trainer") or DEFAULT_TRAINER)["tags"],
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
    from hf_rockopd.publishing.model_card import write_model_card
    write_model_card("runs/smollm2-rockopd", out="model_cards/examples/smollm2-rockopd.md")
    ```
    """
    out = Path(out) if out is not None else Path(run_dir) / CARD_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    card = render_model_card(run_dir, curves_path=_curves_path_for(out), model_id=model_id, template_path=template_path)
    card.save(out)
    return os.fspath(out)


# --------------------------------------------------------------------------------------------- the trainer ----
def _trainer_rock_tokens(trainer: Any) -> dict[str, Any]:
    """The trainer's current rock set as `rock_tokens.json` would hold it."""
    policy = trainer.rock_engine.policy
    rows = decode_rock_rows(policy.rock_table(), trainer.processing_class)
    return {"tokens": rows, "policy": policy.name, "step": trainer.state.global_step}


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
    """The card of a rock-token trainer's run, from what it knows: models, arguments, policy, rock set, log history.

    `trainer` is a [`~hf_rockopd.trainers.RockOPDTrainer`] or any `Trainer` with a `teacher_model` and a
    `rock_engine` (see [`~hf_rockopd.publishing.run_report.run_report_from_trainer`]); its `_tag_names` join the tags.

    When the output directory holds a valid `run_report.json` (written by `hf-rockopd distill`), its evaluation and
    its descriptions of the models and data are used too; an invalid one is skipped with a warning, so a checkpoint
    save never fails on it.

    Example:
    ```python
    from hf_rockopd.publishing.model_card import model_card_from_trainer
    model_card_from_trainer(trainer, model_name="smollm2-rockopd").save("out/README.md")
    ```
    """
    output_dir = Path(trainer.args.output_dir)
    model_name = model_name or output_dir.name
    report = run_report_from_trainer(trainer, model_name, dataset_name)
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
