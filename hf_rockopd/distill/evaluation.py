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

# The base student's evaluation, cached in `evaluation_dir` for every run on the same problems (with its per-token
# scores beside it, `<name>.tokens.pt`), and the generation journals that let a killed evaluation resume.
BEFORE_CACHE_NAME = "eval_before.cache.json"
BEFORE_JOURNAL_NAME = "eval_before.generate.jsonl"
AFTER_JOURNAL_NAME = "eval_after.generate.jsonl"
STEP0_CACHE_NAME = "checkpoint_eval_step0.json"

__all__ = [
    "AFTER_JOURNAL_NAME", "BEFORE_CACHE_NAME", "cached_before_evaluation", "checkpoint_evaluation",
    "distill_teacher_reference", "evaluate_student", "evaluation_dir", "evaluation_key", "evaluation_teachers",
    "evaluation_beta", "load_cached_evaluation", "outside_teacher", "save_cached_evaluation",
]


def evaluation_dir(script: DistillArguments, args: RockOPDConfig) -> str:
    """Where the teacher's reference and the base student's evaluation are kept: `eval_cache_dir` (shared by the runs
    of one comparison, so each is computed once) or the output directory."""
    return script.eval_cache_dir or args.output_dir


def distill_teacher_reference(teacher, tokenizer, problems, script: DistillArguments, args: RockOPDConfig):
    """The teacher's completions of the held-out problems, made once (and cached in `evaluation_dir`) so that the
    "before" and "after" evaluations score the student on the same text; a rerun with the same settings reuses it,
    and a build that was killed resumes at its generation batch."""
    from ..evaluation.teacher_reference import load_or_build_teacher_reference

    return load_or_build_teacher_reference(
        os.path.join(evaluation_dir(script, args), TEACHER_REFERENCE_NAME),
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


def evaluation_teachers(teacher, args: RockOPDConfig, tokenizer, script: DistillArguments | None = None,
                        reference=None) -> tuple[Any, Any]:
    """(on-policy teacher, teacher-forced source) of the evaluations: the in-process model for both; else the served
    teacher (through the cache, when one is given) for both, or with a cache alone no on-policy divergence.

    With an in-process teacher and `script.eval_teacher_top_k`, the teacher-forced source is a top-k cache of the
    teacher on its own `reference` (`teacher_forced_cache`), and with `script.eval_on_policy_divergence` off there is
    no on-policy teacher: an evaluation then runs no teacher forward at all."""
    if teacher is not None:
        if script is None or not script.eval_teacher_top_k or reference is None:
            return teacher, None
        on_policy = teacher if script.eval_on_policy_divergence else None
        return on_policy, teacher_forced_cache(teacher, reference, script, args)
    from ..teachers import connect_teacher_source

    source = connect_teacher_source(args, tokenizer)
    if args.teacher_server_url is None:
        return None, source  # a cache holds the reference's sequences, not the student's new ones
    return source, None


def teacher_forced_cache(teacher, reference, script: DistillArguments, args: RockOPDConfig):
    """The teacher's top-`eval_teacher_top_k` log-probabilities on its own reference completions, scored once and kept
    in `evaluation_dir` (`hf_rockopd.teachers.TeacherCache`; rebuilt when made with other settings or weights), as a
    teacher source: every evaluation's teacher-forced divergence then needs only the student's forward (the tail-bin
    divergence, `hf_rockopd.losses.sparse_divergence`; 1-2 % below the full one at k = 64, docs/teacher.md)."""
    from ..evaluation.teacher_reference import model_fingerprint
    from ..models.introspection import vocab_size
    from ..teachers import CacheSettings, CachedTeacher, ModelTopKTeacher, TeacherCache

    k = script.eval_teacher_top_k
    path = os.path.join(evaluation_dir(script, args), f"teacher_reference.top{k}.{reference.fingerprint()}.parquet")
    settings = CacheSettings(teacher=script.teacher, top_k=k, vocab_size=vocab_size(teacher),
                             temperature=float(args.loss_temperature), teacher_fingerprint=model_fingerprint(teacher))
    expected = {name: getattr(settings, name) for name in ("teacher", "top_k", "vocab_size", "temperature",
                                                           "teacher_fingerprint")}
    cache = None
    if os.path.isfile(path):
        try:
            cache = TeacherCache.load(path, **expected)
        except ValueError:
            cache = None
    sequences = [list(p) + list(c) for p, c in zip(reference.prompt_ids, reference.completion_ids)]
    if cache is None or any(cache.lookup(s) is None for s in sequences if len(s) > 1):
        source = ModelTopKTeacher(teacher, k, temperature=float(args.loss_temperature))
        cache = TeacherCache.build(source, sequences, settings, path, batch_size=script.eval_batch_size,
                                   show_progress=True)
    return CachedTeacher(cache)


def evaluation_beta(script: DistillArguments, args: RockOPDConfig) -> float:
    """The divergence the evaluations report: `eval_beta`, or the training's `beta` when it is unset."""
    return float(args.beta if script.eval_beta is None else script.eval_beta)


def evaluation_key(model, problems, reference, script: DistillArguments, args: RockOPDConfig) -> dict[str, Any]:
    """What an evaluation of `model` depends on: its weights, the problems, the teacher's reference and the
    evaluation's settings. A cached evaluation or a generation journal with another key is not reused."""
    from ..evaluation.teacher_reference import model_fingerprint, problems_fingerprint

    return {
        "model_fingerprint": model_fingerprint(model),
        "problems_fingerprint": problems_fingerprint(problems),
        "reference_fingerprint": reference.fingerprint() if reference is not None else None,
        "max_new_tokens": script.eval_max_new_tokens,
        "batch_size": script.eval_batch_size,
        "beta": evaluation_beta(script, args),
        "temperature": args.loss_temperature,
        "verifier": script.verifier,
        "last_number": script.last_number,
    }


def load_cached_evaluation(path: str, key: dict[str, Any]):
    """The evaluation saved at `path` by `save_cached_evaluation` with this `key`, or None (missing, or another key).
    Its per-token scores come back too, so the rock figures can still be filled in (`EvalResult.with_rock_ids`)."""
    import json

    import torch

    from ..evaluation.evaluate import EvalResult

    tokens = path + ".tokens.pt"
    if not (os.path.isfile(path) and os.path.isfile(tokens)):
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("settings", {}).get("cache_key") != json.loads(json.dumps(key)):
        return None
    scores = torch.load(tokens)
    result = EvalResult.from_dict(data)
    result.token_ids, result.token_divergence = scores["token_ids"], scores["token_divergence"]
    return result


def save_cached_evaluation(result, path: str, key: dict[str, Any]) -> None:
    """Write `result` (records and per-token scores) under `key`, for `load_cached_evaluation`."""
    import dataclasses

    import torch

    torch.save({"token_ids": result.token_ids, "token_divergence": result.token_divergence}, path + ".tokens.pt")
    keyed = dataclasses.replace(result, settings={**result.settings, "cache_key": key})
    keyed.save(path + ".tmp", include_records=True)
    os.replace(path + ".tmp", path)


def evaluate_student(
    model, teacher, tokenizer, problems, reference, script: DistillArguments, args: RockOPDConfig, *,
    journal_path: str | None = None, key: dict[str, Any] | None = None,
):
    """Evaluate `model` on `problems` (`evaluate_gsm8k` with the run's settings). With `journal_path`, its generation
    batches are journaled there under `key` (`evaluation_key`), and a killed evaluation resumes at its batch."""
    from ..evaluation.evaluate import evaluate_gsm8k
    from ..evaluation.journal import GenerationJournal

    on_policy, forced = teacher
    journal = None
    if journal_path is not None:
        journal = GenerationJournal(journal_path, key or evaluation_key(model, problems, reference, script, args))
    return evaluate_gsm8k(
        model,
        tokenizer,
        problems,
        teacher=on_policy,
        forced_teacher=forced,
        teacher_reference=reference,
        max_new_tokens=script.eval_max_new_tokens,
        batch_size=script.eval_batch_size,
        beta=evaluation_beta(script, args),
        temperature=args.loss_temperature,
        verifier=script.verifier,
        last_number=script.last_number,
        journal=journal,
    )


def cached_before_evaluation(model, teacher, tokenizer, problems, reference, script: DistillArguments,
                             args: RockOPDConfig, key: dict[str, Any]):
    """Evaluate the base student (its generation journaled, so a kill resumes at the batch) and cache the result in
    `evaluation_dir` under `key`, for every later run on the same problems (`load_cached_evaluation`)."""
    folder = evaluation_dir(script, args)
    journal = os.path.join(folder, BEFORE_JOURNAL_NAME)
    result = evaluate_student(model, teacher, tokenizer, problems, reference, script, args, journal_path=journal,
                              key=key)
    save_cached_evaluation(result, os.path.join(folder, BEFORE_CACHE_NAME), key)
    os.remove(journal)
    return result


def checkpoint_evaluation(teacher, tokenizer, problems, reference, script: DistillArguments, args: RockOPDConfig,
                          base_key: dict[str, Any], on_line=None):
    """The [`~hf_rockopd.distill.checkpoints.CheckpointEvaluation`] callback of a run: the first
    `checkpoint_eval_problems` problems at step 0 and at each save (each `checkpoint_eval_steps`-th step's); None
    when the run saves no checkpoint or asks for none. Its step-0 line is cached in `evaluation_dir` under the base
    student's `base_key`."""
    from .checkpoints import CHECKPOINT_EVALS_NAME, CheckpointEvaluation, step0_key

    n = script.checkpoint_eval_problems
    if n < 1 or str(getattr(args.save_strategy, "value", args.save_strategy)) == "no":
        return None
    head, head_reference = list(problems[:n]), reference.head(problems[:n]) if reference is not None else None

    def evaluate(model):
        return evaluate_student(model, teacher, tokenizer, head, head_reference, script, args)

    return CheckpointEvaluation(
        os.path.join(args.output_dir, CHECKPOINT_EVALS_NAME), evaluate,
        step0_cache=os.path.join(evaluation_dir(script, args), STEP0_CACHE_NAME), key=step0_key(base_key, n),
        on_line=(lambda text: on_line("checkpoint evaluation", text)) if on_line is not None else None,
        every=script.checkpoint_eval_steps,
    )
