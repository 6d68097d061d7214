"""hf_rockopd: rock-token-aware on-policy distillation for Hugging Face TRL.

Example:
```python
from hf_rockopd import RockOPDConfig, RockOPDTrainer

args = RockOPDConfig(output_dir="out", rock_policy="rock_online", rock_policy_kwargs={"top_k": 100})
trainer = RockOPDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=prompts,
                         processing_class=tokenizer)
trainer.train()
```
"""

from .config import RockOPDConfig
from .policies import TokenBatch, TokenPolicy, available_policies, get_policy, register_policy
from .trainer import RockOPDTrainer


__version__ = "0.1.0"

__all__ = [
    "RockOPDConfig",
    "RockOPDTrainer",
    "TokenBatch",
    "TokenPolicy",
    "available_policies",
    "get_policy",
    "register_policy",
]
