"""Trainers with rock-token weighting, each thin glue between a TRL trainer base and the shared engine.

`gkd` holds [`RockOPDTrainer`] (TRL's `GKDTrainer`), `config` its [`RockOPDConfig`], `data` the prompt collator that
never truncates a prompt. The loss, metrics and files are `hf_rockopd.engine`'s.

Example:
```python
>>> from hf_rockopd.trainers import RockOPDConfig, RockOPDTrainer
>>> RockOPDTrainer._tag_names[:2], RockOPDConfig(output_dir="out", report_to="none").rock_policy
(['trl', 'gkd'], 'rock_online')
```
"""

from .config import RockOPDConfig
from .data import OnPolicyChatMLCollator, PromptTooLongError, check_prompt_lengths
from .gkd import RockOPDTrainer


__all__ = ["OnPolicyChatMLCollator", "PromptTooLongError", "RockOPDConfig", "RockOPDTrainer", "check_prompt_lengths"]
