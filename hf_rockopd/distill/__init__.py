"""The main job, end to end: load teacher and student, build the prompt data, evaluate, distill, evaluate, save.

`hf-rockopd distill` and `examples/distill_gsm8k.py` call [`run_distillation`]. The submodules each do one job: `run`
(the job itself and its defaults), `arguments` ([`DistillArguments`]: models, data, evaluation), `evaluation` (the
evaluations before and after training), `output` (the saved model, the report and the progress line) and
`trainer_choice` (TRL's GKD or Distillation trainer). The student's TRL options ([`StudentModelConfig`]: LoRA, 4-bit)
live in `hf_rockopd.models.student_config`.

Example:
```python
from hf_rockopd import RockOPDConfig
from hf_rockopd.distill import DistillArguments, StudentModelConfig, run_distillation

script = DistillArguments(dataset="openai/gsm8k", num_train_prompts=64)
args = RockOPDConfig(output_dir="runs/smollm2", max_steps=10, max_new_tokens=64)
result = run_distillation(script, args, StudentModelConfig(use_peft=True, lora_r=8))
print(result.output_dir, result.report["eval"]["after"]["mean_divergence"])
```
"""

from ..models.student_config import StudentModelConfig
from .arguments import DistillArguments
from .run import DEFAULT_ROCK_ONLINE_KWARGS, DEFAULT_TRAINING_ARGS, DistillResult, load_distill_data, run_distillation


__all__ = [
    "DEFAULT_ROCK_ONLINE_KWARGS",
    "DEFAULT_TRAINING_ARGS",
    "DistillArguments",
    "DistillResult",
    "StudentModelConfig",
    "load_distill_data",
    "run_distillation",
]
