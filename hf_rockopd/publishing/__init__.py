"""Publishing a run: its report (`run_report.json`), its model card and the card's training curves.

`run_report` owns the report file (names, reader, writer, the training settings it records); `card_sections` says what
each section of the card holds, with `card_setup` (the grouped settings table, the data line, the config to rerun the
run) and `limitations` (what the evaluation showed, bad news included); `model_card` renders and writes the card (from
a run directory or a live trainer); `plots` draws the training curves. `rock_tokens.json` belongs to `hf_rockopd.policies.rock_set`.

Example:
```python
from hf_rockopd.publishing import write_model_card
write_model_card("runs/smollm2-rockopd")  # runs/smollm2-rockopd/README.md and training_curves.png
```
"""

from .card_sections import EVAL_FIELDS
from .limitations import limitations
from .model_card import (
    CARD_TAGS,
    TEMPLATE_PATH,
    build_model_card,
    model_card_from_trainer,
    render_model_card,
    trainer_tags,
    write_model_card,
)
from .plots import first_freeze_step, plot_training_curves
from .run_report import (
    CARD_NAME,
    CURVES_NAME,
    RUN_REPORT_NAME,
    TRAINING_FIELDS,
    RunReportError,
    load_run_report,
    run_report_from_trainer,
    trainer_description,
    write_run_report,
)


__all__ = [
    "CARD_NAME",
    "CARD_TAGS",
    "CURVES_NAME",
    "EVAL_FIELDS",
    "RUN_REPORT_NAME",
    "TEMPLATE_PATH",
    "TRAINING_FIELDS",
    "RunReportError",
    "build_model_card",
    "first_freeze_step",
    "limitations",
    "load_run_report",
    "model_card_from_trainer",
    "plot_training_curves",
    "render_model_card",
    "run_report_from_trainer",
    "trainer_description",
    "trainer_tags",
    "write_model_card",
    "write_run_report",
]
