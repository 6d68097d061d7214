"""The main job's own options (`hf-rockopd distill`): models, data and evaluation. Training options are the fields
of [`~hf_rockopd.RockOPDConfig`], LoRA and 4-bit those of [`~hf_rockopd.distill.StudentModelConfig`].

Example:
```python
>>> from hf_rockopd.distill.arguments import DistillArguments
>>> DistillArguments(dataset="openai/gsm8k", num_train_prompts=64).verifier
'math'
```
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..utils.checks import check_at_least
from ..data.arguments import DatasetArguments
from .trainer_choice import TRAINER_CHOICES, VLLM_MODES
from ..evaluation.answers import VERIFIERS, check_verifier
from ..models.arguments import ModelPairArguments
from ..trainers.distillation import check_vllm_available


__all__ = ["DistillArguments"]


@dataclass
class DistillArguments(ModelPairArguments, DatasetArguments):
    r"""
    Arguments of `hf-rockopd distill` besides the training ones ([`~hf_rockopd.RockOPDConfig`]'s) and the student's
    LoRA and 4-bit ones ([`StudentModelConfig`], TRL's `ModelConfig`).

    Parameters:
        > Models

        teacher, student, student_num_layers:
            The teacher and the student: see [`~hf_rockopd.models.arguments.ModelPairArguments`].
        student_layers (`list[int]` or `None`, *optional*, defaults to `None`):
            Exact decoder-layer indices to keep (overrides `student_num_layers`).

        > Data

        dataset, dataset_config, dataset_split, prompt_column, answer_column, eval_dataset, eval_dataset_config,
        eval_dataset_split, system_prompt:
            Where the prompts and held-out problems come from: see [`~hf_rockopd.data.arguments.DatasetArguments`].
        num_train_prompts (`int`, *optional*, defaults to `256`):
            Training prompts drawn from the non-held-out rows.
        num_eval_problems (`int`, *optional*, defaults to `16`):
            Held-out problems, never trained on, used for evaluation before and after training.
        num_validation_problems (`int`, *optional*, defaults to `0`):
            Problems drawn right after the held-out ones, never trained on either: the slice to choose settings on.
        eval_on (`str`, *optional*, defaults to `"heldout"`):
            `"heldout"` evaluates on the held-out problems; `"validation"` on the validation slice, leaving the
            held-out ones untouched (the training prompts are the same either way).

        > Evaluation

        eval_max_new_tokens (`int`, *optional*, defaults to `192`):
            Greedy new tokens per held-out problem.
        eval_batch_size (`int`, *optional*, defaults to `16`):
            Problems generated at once.
        verifier (`str`, *optional*, defaults to `"math"`):
            How answers are checked (`hf_rockopd.evaluation.verify_answer`, math-verify): `"math"`, `"gsm8k"`
            (`#### n` references) or `"none"` (no accuracy; every other measure still).
        last_number (`bool`, *optional*, defaults to `False`):
            Credit the last number of a finished answer that has no final-answer marker (never a cut one).
        skip_eval (`bool`, *optional*, defaults to `False`):
            Train and save without the before/after evaluation.
        eval_cache_dir (`str` or `None`, *optional*, defaults to `None`):
            Folder for the teacher's reference answers and the base student's evaluation, reused when made with the
            same settings: runs that compare policies on the same problems share it and compute each once. `None`:
            the output directory.
        eval_teacher_top_k (`int` or `None`, *optional*, defaults to `None`):
            Score the teacher-forced divergence against the teacher's top-k log-probabilities on its reference,
            computed once and cached in `eval_cache_dir` (the tail-bin divergence, 1-2 % below the full one at
            k = 64): later evaluations run only the student. `None`: the full divergence, the teacher run each time.
        eval_beta (`float` or `None`, *optional*, defaults to `None`):
            The divergence the evaluations report (1 reverse KL, 0 forward KL, between: TRL's generalized JSD).
            `None`: the training's `beta`. Set it to compare runs trained with different `beta`s on one measure.
        eval_on_policy_divergence (`bool`, *optional*, defaults to `True`):
            Also score the student's own completions against the teacher (a teacher forward per evaluation); off for
            long evaluations whose verdict is accuracy and the teacher-forced divergence.
        checkpoint_eval_problems (`int`, *optional*, defaults to `0`):
            At step 0 and at each saved checkpoint, evaluate the first N evaluation problems
            (`checkpoint_evals.jsonl`, the curves of a long run); 0: no checkpoint evaluation.
        checkpoint_eval_steps (`int`, *optional*, defaults to `0`):
            Evaluate only the checkpoints whose step is a multiple of N (a multiple of `save_steps`); 0: every
            checkpoint. A long run saves often, so that a stop loses few steps, and draws its curves from fewer points.

        > Trainer

        trainer (`str`, *optional*, defaults to `"gkd"`):
            `"gkd"`: [`~hf_rockopd.RockOPDTrainer`] (TRL's `GKDTrainer`; every published number of docs/distill.md).
            `"distillation"`: [`~hf_rockopd.RockDistillationTrainer`] (TRL's stable `DistillationTrainer`: vLLM
            generation, tool calling); the training options are carried over (`max_new_tokens` becomes
            `max_completion_length`), and `lmbda`/`seq_kd` must keep their on-policy defaults.
        use_vllm (`bool`, *optional*, defaults to `False`):
            Generate with vLLM (`--trainer distillation` only); checked before any model loads.
        vllm_mode (`str`, *optional*, defaults to `"colocate"`):
            `"colocate"` (vLLM in the training process, one GPU) or `"server"` (a `trl vllm-serve` process).
    """

    student_layers: list[int] | None = field(
        default=None, metadata={"help": "Exact decoder-layer indices kept (overrides student_num_layers)."}
    )
    num_train_prompts: int = field(default=256, metadata={"help": "Training prompts (non-held-out rows)."})
    num_eval_problems: int = field(default=16, metadata={"help": "Held-out evaluation problems."})
    num_validation_problems: int = field(
        default=0, metadata={"help": "Problems set aside after the held-out ones to choose settings on."}
    )
    eval_on: str = field(
        default="heldout",
        metadata={"help": "Evaluate on the held-out problems or on the validation slice.",
                  "choices": ["heldout", "validation"]},
    )
    eval_max_new_tokens: int = field(default=192, metadata={"help": "Greedy new tokens per evaluation problem."})
    eval_batch_size: int = field(default=16, metadata={"help": "Evaluation problems generated at once."})
    skip_eval: bool = field(default=False, metadata={"help": "Skip the before/after evaluation."})
    eval_cache_dir: str | None = field(
        default=None,
        metadata={"help": "Folder for the teacher's reference and the base student's evaluation, shared by runs on "
                  "the same problems (default: the output directory)."},
    )
    eval_teacher_top_k: int | None = field(
        default=None,
        metadata={"help": "Teacher-forced divergence against a top-k cache of the teacher on its reference, made once "
                  "(default: the full divergence, the teacher run at each evaluation)."},
    )
    eval_beta: float | None = field(
        default=None,
        metadata={"help": "The evaluations' divergence: 1 reverse KL, 0 forward KL (default: the training's beta). "
                  "Set it to compare runs trained with different betas on one measure."},
    )
    eval_on_policy_divergence: bool = field(
        default=True, metadata={"help": "Also score the student's own completions against the teacher."}
    )
    checkpoint_eval_problems: int = field(
        default=0, metadata={"help": "Evaluate the first N problems at step 0 and each saved checkpoint (0: never)."}
    )
    checkpoint_eval_steps: int = field(
        default=0,
        metadata={"help": "Evaluate only the checkpoints whose step is a multiple of N, a multiple of save_steps "
                  "(0: every checkpoint)."},
    )
    verifier: str = field(
        default="math",
        metadata={"help": "How answers are checked (math-verify): math, gsm8k ('#### n' references) or none.",
                  "choices": list(VERIFIERS)},
    )
    last_number: bool = field(
        default=False,
        metadata={"help": "Credit the last number of a finished answer without a final-answer marker (never a cut "
                  "one)."},
    )
    trainer: str = field(
        default="gkd",
        metadata={
            "help": "gkd: RockOPDTrainer (TRL's GKDTrainer); distillation: RockDistillationTrainer (TRL's "
            "DistillationTrainer, with vLLM generation).",
            "choices": list(TRAINER_CHOICES),
        },
    )
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM (--trainer distillation only)."})
    vllm_mode: str = field(
        default="colocate",
        metadata={"help": "vLLM mode: colocate (one GPU) or server (trl vllm-serve).", "choices": list(VLLM_MODES)},
    )

    def __post_init__(self):
        check_at_least(self, "num_train_prompts", "eval_max_new_tokens", "eval_batch_size")
        if isinstance(self.num_eval_problems, bool) or not isinstance(self.num_eval_problems, int):
            raise ValueError(f"num_eval_problems must be an integer >= 0, got {self.num_eval_problems!r}.")
        if self.num_eval_problems < (0 if self.skip_eval else 1):
            raise ValueError(
                f"num_eval_problems must be >= 1 unless skip_eval is set, got {self.num_eval_problems}."
            )
        check_at_least(self, "eval_teacher_top_k")
        if self.eval_beta is not None and not 0.0 <= self.eval_beta <= 1.0:
            raise ValueError(f"eval_beta must be in [0, 1] (1 reverse KL, 0 forward KL) or None, got {self.eval_beta}.")
        for name in ("num_validation_problems", "checkpoint_eval_problems", "checkpoint_eval_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")
        if self.eval_on not in ("heldout", "validation"):
            raise ValueError(f"eval_on must be 'heldout' or 'validation', got {self.eval_on!r}.")
        if self.eval_on == "validation" and self.num_validation_problems < 1 and not self.skip_eval:
            raise ValueError(
                "eval_on='validation' needs a validation slice: set num_validation_problems (e.g. 64)."
            )
        evaluated = self.num_validation_problems if self.eval_on == "validation" else self.num_eval_problems
        if self.checkpoint_eval_problems > evaluated and not self.skip_eval:
            raise ValueError(
                f"checkpoint_eval_problems = {self.checkpoint_eval_problems} but the evaluation has {evaluated} "
                f"problems ({self.eval_on}); ask for at most that many."
            )
        super().__post_init__()
        check_verifier(self.verifier)
        if self.student_num_layers is not None and self.student_num_layers < 1:
            raise ValueError(f"student_num_layers must be >= 1, got {self.student_num_layers}.")
        if self.student_layers is not None and len(self.student_layers) == 0:
            raise ValueError("student_layers is empty: list the decoder-layer indices to keep, e.g. [0, 5, 11].")
        if self.trainer not in TRAINER_CHOICES:
            raise ValueError(f"trainer must be one of {', '.join(TRAINER_CHOICES)}, got {self.trainer!r}.")
        if self.vllm_mode not in VLLM_MODES:
            raise ValueError(f"vllm_mode must be one of {', '.join(VLLM_MODES)}, got {self.vllm_mode!r}.")
        if self.use_vllm and self.trainer != "distillation":
            raise ValueError(
                "use_vllm needs --trainer distillation: RockOPDTrainer (TRL's GKDTrainer) generates with "
                "transformers only."
            )
        check_vllm_available(self.use_vllm)  # before any model loads
