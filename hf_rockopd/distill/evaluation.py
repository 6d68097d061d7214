"""The main job's evaluation helpers: the teacher's reference answers, where the evaluation's teacher lives, and the
before/after evaluation of the student (`hf_rockopd.distill.run_distillation` calls them in that order).

Example:
```python
>>> from hf_rockopd import RockOPDConfig
>>> from hf_rockopd.distill.arguments import DistillArguments
>>> from hf_rockopd.distill.evaluation import outside_teacher
>>> args = RockOPDConfig(output_dir="out", teacher_cache=None, report_to="none")
>>> outside_teacher(DistillArguments(), args, reference=None) is None  # the teacher runs in this process
True
```
"""

from __future__ import annotations

import os
from typing import Any

from .arguments import DistillArguments
from ..evaluation.teacher_reference import TEACHER_REFERENCE_NAME
from ..trainers.config import RockOPDConfig

__all__ = ["distill_teacher_reference", "evaluate_student", "evaluation_teachers", "outside_teacher"]


def distill_teacher_reference(teacher, tokenizer, problems, script: DistillArguments, args: RockOPDConfig):
    """The teacher's completions of the held-out problems, made once (and cached in the output directory) so that the
    "before" and "after" evaluations score the student on the same text; a rerun with the same settings reuses it."""
    from ..evaluation.teacher_reference import load_or_build_teacher_reference

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


def outside_teacher(script: DistillArguments, args: RockOPDConfig, reference: str | None) -> str | None:
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


def evaluation_teachers(teacher, args: RockOPDConfig, tokenizer) -> tuple[Any, Any]:
    """(on-policy teacher, teacher-forced source) of the evaluations: the in-process model for both; else the served
    teacher (through the cache, when one is given) for both, or with a cache alone no on-policy divergence."""
    if teacher is not None:
        return teacher, None
    from ..teachers import connect_teacher_source

    source = connect_teacher_source(args, tokenizer)
    if args.teacher_server_url is None:
        return None, source  # a cache holds the reference's sequences, not the student's new ones
    return source, None


def evaluate_student(model, teacher, tokenizer, problems, reference, script: DistillArguments, args: RockOPDConfig):
    from ..evaluation.evaluate import evaluate_gsm8k

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
