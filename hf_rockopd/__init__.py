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

from ._version import __version__
from .console import quiet_library_imports


# The first import of TRL and transformers happens here, whichever submodule a user imports: their notices that are
# about our own choices (TRL's GKD lives in trl.experimental) are filtered for these imports only.
with quiet_library_imports():
    from .policies import TokenBatch, TokenPolicy, available_policies, get_policy, register_policy
    from .trainers import RockDistillationConfig, RockDistillationTrainer, RockOPDConfig, RockOPDTrainer


__all__ = [
    "RockDistillationConfig",
    "RockDistillationTrainer",
    "RockOPDConfig",
    "RockOPDTrainer",
    "TokenBatch",
    "TokenPolicy",
    "__version__",
    "available_policies",
    "get_policy",
    "register_policy",
]
