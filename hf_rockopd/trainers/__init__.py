"""Trainers with rock-token weighting, each thin glue between a TRL trainer base and the shared engine.

`gkd` holds [`RockOPDTrainer`] (TRL's `GKDTrainer`), `config` its [`RockOPDConfig`], `data` the prompt collator that
never truncates a prompt; `distillation` holds [`RockDistillationTrainer`] (TRL's stable `DistillationTrainer`: vLLM
generation, tools), `distillation_config` its [`RockDistillationConfig`]. `fields` holds the rock-token config fields
both configs share, `common` what both trainers add besides the loss. The loss, metrics and files are
`hf_rockopd.engine`'s.

Example:
```python
>>> from hf_rockopd.trainers import RockOPDConfig, RockOPDTrainer
>>> RockOPDTrainer._tag_names[:2], RockOPDConfig(output_dir="out", report_to="none").rock_policy
(['trl', 'gkd'], 'uniform')
```
"""

from .common import RockLossOutput
from .config import RockOPDConfig
from .data import OnPolicyChatMLCollator, PromptTooLongError, check_prompt_lengths
from .distillation import RockDistillationTrainer
from .distillation_config import RockDistillationConfig
from .gkd import RockOPDTrainer


__all__ = [
    "OnPolicyChatMLCollator",
    "PromptTooLongError",
    "RockDistillationConfig",
    "RockDistillationTrainer",
    "RockLossOutput",
    "RockOPDConfig",
    "RockOPDTrainer",
    "check_prompt_lengths",
]
