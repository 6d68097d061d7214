"""GSM8K evaluation of a student: accuracy, text quality, teacher-forced and on-policy divergence to the teacher.

The student answers held-out problems greedily (`hf_rockopd.evaluation.rollout.generate_completions`: batched, left-padded, chat
template, KV cache). Its own completions are then scored (`rollout.score_completions`) the way training scores them: at every completion position, the full-vocabulary divergence
(`hf_rockopd.losses.per_token_divergence`, TRL's `beta` convention, at the training temperature) between the student's
and the teacher's distributions that predicted the generated token. The results:

- `accuracy`: share of problems whose final answer equals the reference, checked by `math-verify`
  (`verify_answer`, `--verifier math|gsm8k|none`); a completion without a final-answer marker (`\\boxed{}`, `####`,
  "the answer is") has no prediction and is wrong, and `cut_ratio` counts those that hit the token limit;
- `mean_divergence`: mean per-token divergence over all completion tokens (up to and including eos), and
  `mean_divergence_non_rock` over the tokens outside a rock set (the ones training does not freeze);
- `top1_agreement`: share of completion positions where the student's and the teacher's argmax agree.

These three are **on-policy**: measured on text the student wrote. Once a phrase repeats in context the teacher
predicts the repetition too, so a student that loops ("…20 cookies, 20 cookies…") *lowers* them while its answers get
worse. Beside them, measures a degenerate student cannot fool:

- `accuracy_low` / `accuracy_high`: the accuracy's 95 % Wilson interval (`quality.accuracy_interval`);
- `finished_rate`, `loop_rate`, `repeated_ngram_fraction`, `distinct_1`, `distinct_2`: the text itself
  (`hf_rockopd.evaluation.quality`): answers that end, completions containing a loop, repeated 4-grams, corpus distinct-n;
- `teacher_forced_divergence` / `teacher_forced_top1_agreement`: the student scored, with the same divergence, on the
  teacher's own greedy completions of the same problems (`hf_rockopd.evaluation.teacher_reference`), text it did not write;
- `teacher_accuracy` (with its interval): the teacher on the same problems, the ceiling.

Example:
```python
from hf_rockopd.evaluation import evaluate_gsm8k
from hf_rockopd.data import load_problems

problems = load_problems("HuggingFaceH4/MATH-500", split="test", limit=32)  # any dataset in TRL's formats
reference = load_or_build_teacher_reference("run/teacher_reference.json", teacher, tokenizer, problems)
result = evaluate_gsm8k(student, tokenizer, problems, teacher=teacher, teacher_reference=reference,
                        rock_ids="run/rock_tokens.json")
print(result.table())
result.save("eval.json")
```
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

import torch
from transformers.utils import logging

from .answers import check_verifier, grade_completion, reference_answer, verify_answer
from ..data.chat import Problem
from ..models.introspection import check_same_vocabulary, eos_token_ids, vocab_size
from .quality import completion_quality, numeric_token_ids, text_quality
from .table import format_results_table
from ..policies.rock_set import load_rock_set, validate_token_ids
from ..teachers import TopKTeacher
from .journal import GenerationJournal
from .rollout import generate_completions, pad_token_id, score_completions
from .teacher_reference import TeacherReference, build_teacher_reference

logger = logging.get_logger(__name__)

__all__ = ["EvalResult", "evaluate_completions", "evaluate_gsm8k", "format_results_table", "verify_answer"]

# ---------------------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class EvalResult:
    """The evaluation of a student on GSM8K-style problems; `to_dict()` is the JSON the run report stores.

    Parameters:
        accuracy: share of problems whose final answer equals the reference (None with `verifier="none"`).
        num_problems: problems evaluated.
        mean_divergence: the **on-policy** divergence: mean per-token divergence of the student's own greedy
            completions against the teacher over all completion tokens (None without a teacher).
        mean_divergence_non_rock: the same over tokens outside the rock set (None without rock ids or teacher).
        rock_token_share: share of completion tokens that are rock ids (None without rock ids).
        top1_agreement: share of completion positions where student and teacher argmax agree (None without teacher).
        num_tokens: completion tokens scored (up to and including each eos).
        mean_completion_length: mean completion length in tokens.
        clipped_ratio: share of completions that hit `max_new_tokens` without an eos.
        cut_ratio: share of completions that hit `max_new_tokens` without an eos and without a final answer: no
            prediction, counted wrong.
        accuracy_low, accuracy_high: the accuracy's 95 % Wilson interval.
        finished_rate: share of completions that end with a stop id before `max_new_tokens`.
        loop_rate: share of completions containing a loop (`quality.find_loop`).
        repeated_ngram_fraction: mean share of a completion's 4-grams that repeat an earlier one.
        distinct_1, distinct_2: corpus distinct-1 and distinct-2 of the completions.
        teacher_accuracy, teacher_accuracy_low, teacher_accuracy_high: the teacher's accuracy on the same problems
            (its greedy completions, `teacher_reference`) and its interval: the ceiling.
        teacher_forced_divergence: mean per-token divergence of the student on the teacher's own completions, the
            training divergence on text the student did not write (loops cannot lower it).
        teacher_forced_top1_agreement: share of those positions where student and teacher argmax agree.
        settings: how it was measured (max_new_tokens, batch_size, beta, temperature, num_rock_ids, seconds, ...).
        records: per-problem details (gold, prediction, correct, length, finished, loop, divergence on-policy and
            teacher-forced, text); kept out of `to_dict()` unless asked for, so run reports stay small.

    The fields from `accuracy_low` on are optional (None when not measured, and in reports written before them).

    Example:
    ```python
    >>> from hf_rockopd.evaluation import EvalResult
    >>> r = EvalResult(accuracy=0.5, num_problems=2, mean_divergence=0.1, mean_divergence_non_rock=None,
    ...                rock_token_share=None, top1_agreement=0.9, num_tokens=10, mean_completion_length=5.0,
    ...                clipped_ratio=0.0, settings={"max_new_tokens": 8})
    >>> EvalResult.from_dict(r.to_dict()) == r
    True
    ```
    """

    accuracy: float | None
    num_problems: int
    mean_divergence: float | None
    mean_divergence_non_rock: float | None
    rock_token_share: float | None
    top1_agreement: float | None
    num_tokens: int
    mean_completion_length: float
    clipped_ratio: float
    accuracy_low: float | None = None
    accuracy_high: float | None = None
    finished_rate: float | None = None
    loop_rate: float | None = None
    repeated_ngram_fraction: float | None = None
    distinct_1: float | None = None
    distinct_2: float | None = None
    teacher_accuracy: float | None = None
    teacher_accuracy_low: float | None = None
    teacher_accuracy_high: float | None = None
    teacher_forced_divergence: float | None = None
    teacher_forced_top1_agreement: float | None = None
    cut_ratio: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] | None = field(default=None, compare=False, repr=False)
    # Per completion token, in order: the generated id and its divergence; never serialized, kept so that
    # `with_rock_ids` can fill in the rock figures later without scoring again.
    token_ids: torch.Tensor | None = field(default=None, compare=False, repr=False)
    token_divergence: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def to_dict(self, include_records: bool = False) -> dict[str, Any]:
        """The JSON-ready dict (the run report's `eval.before` / `eval.after`); records only if asked for."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("token_ids", "token_divergence")}
        data["settings"] = dict(self.settings)
        if not include_records or self.records is None:
            data.pop("records")
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalResult:
        """Read back a `to_dict()` (or a saved `eval.json`); a missing key is a `ValueError` naming it."""
        if not isinstance(data, Mapping):
            raise ValueError(f"An evaluation result is a JSON object, got {type(data).__name__}.")
        names = [f.name for f in fields(cls)]
        names = [n for n in names if n not in ("token_ids", "token_divergence")]
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [n for n in required if n not in data]
        if missing:
            raise ValueError(f"Not an evaluation result: keys {missing} are missing (got {sorted(data)}).")
        return cls(**{n: data[n] for n in names if n in data})

    def save(self, path: str | os.PathLike, include_records: bool = False) -> str:
        """Write `to_dict()` as JSON to `path`; returns the path."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(include_records=include_records), f, indent=2)
        return os.fspath(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> EvalResult:
        """Read a file written by `save`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def with_rock_ids(self, rock_ids: Sequence[int]) -> EvalResult:
        """A copy with `mean_divergence_non_rock` and `rock_token_share` for `rock_ids`, from the kept per-token scores.

        Before training there is no rock set yet; this fills in the "before" figures once training has found one,
        without generating or scoring again. Only a result made in this process (not one read from JSON) has the
        per-token scores.

        Example:
        ```python
        before = evaluate_gsm8k(student, tokenizer, problems, teacher=teacher)
        trainer.train()
        before = before.with_rock_ids(trainer.rock_policy.rock_ids())
        ```
        """
        if self.token_ids is None:
            raise ValueError(
                "This result has no per-token scores (it was read from JSON); evaluate again with rock_ids= instead."
            )
        ids = torch.as_tensor(list(rock_ids), dtype=torch.long)
        is_rock = torch.isin(self.token_ids, ids)
        non_rock = self.token_divergence is not None and bool((~is_rock).any())
        settings = {**self.settings, "num_rock_ids": len(ids)}
        return replace(
            self,
            rock_token_share=float(is_rock.double().mean()) if len(self.token_ids) else None,
            mean_divergence_non_rock=float(self.token_divergence[~is_rock].mean()) if non_rock else None,
            settings=settings,
        )

    def table(self) -> str:
        """A two-column text table of the metrics."""
        return format_results_table({"value": self})


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------------


def _rock_id_list(rock_ids: Any, vocab_size: int) -> list[int] | None:
    if rock_ids is None:
        return None
    if isinstance(rock_ids, (str, os.PathLike)):
        return load_rock_set(rock_ids, vocab_size=vocab_size)["token_ids"]
    return validate_token_ids(list(rock_ids), vocab_size, source="rock_ids")


def _check_problems(problems: Sequence[Problem], verifier: str = "none") -> None:
    """Every problem a (messages, reference) pair whose reference `verifier` can read: checked before generation."""
    check_verifier(verifier)
    if len(problems) == 0:
        raise ValueError("No problem to evaluate. Give at least one (messages, reference) problem (see load_problems).")
    for index, problem in enumerate(problems):
        pair = isinstance(problem, (tuple, list)) and len(problem) == 2
        # No reference is fine when no accuracy is scored (a prompt-only dataset).
        if not pair or not (isinstance(problem[1], (int, float, str)) or (problem[1] is None and verifier == "none")):
            raise ValueError(
                f"Problem {index} is {problem!r:.80}; a problem is a (messages, reference answer) pair, as "
                "load_problems returns."
            )
        if verifier != "none":
            try:
                reference_answer(problem[1], verifier)
            except ValueError as err:
                raise ValueError(f"Problem {index}: {err}") from None


def _nan_to_none(value: float) -> float | None:
    return None if math.isnan(value) else float(value)  # NaN: undefined (no completion, no 4-gram); JSON has no NaN


def _mean(values: torch.Tensor) -> float | None:
    return float(values.double().mean()) if len(values) else None


def _source_name(teacher: Any) -> str | None:
    if teacher is None:
        return None
    if isinstance(teacher, TopKTeacher):
        return f"{teacher.source}, top-{teacher.top_k} (tail-bin divergence)"
    return "in-process, full vocabulary"


def _score(model, teacher, tokenizer, prompts, completions, what: str, **kwargs) -> tuple[list[dict], torch.Tensor]:
    """`score_completions`, and all completion tokens' divergences in order (checked finite)."""
    scores = score_completions(model, teacher, prompts, completions, pad_token_id=pad_token_id(tokenizer), **kwargs)
    divergence = torch.cat([s["divergence"] for s in scores]).double()
    if not torch.isfinite(divergence).all():
        raise ValueError(
            f"The {what} divergence is not finite on some completion tokens; check both models' weights and dtype "
            "(float16 logits can overflow; use float32)."
        )
    return scores, divergence


def evaluate_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    teacher: torch.nn.Module | TopKTeacher | None = None,
    teacher_reference: TeacherReference | None = None,
    forced_teacher: TopKTeacher | None = None,
    rock_ids: Sequence[int] | str | os.PathLike | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    beta: float = 1.0,
    temperature: float = 1.0,
    show_progress: bool = False,
    verifier: str = "math",
    last_number: bool = False,
) -> EvalResult:
    """Evaluate given completions of `problems` (by the student `model`): accuracy, quality, divergence, agreement.

    `evaluate_gsm8k` calls this on the student's greedy completions; call it directly for completions made elsewhere
    (`rollout.encode_prompts` gives the prompt ids). A completion without eos that has `max_new_tokens` tokens counts as
    clipped. With `teacher_reference` (the teacher's completions of the same problems) the teacher's accuracy is
    reported and, with `teacher` too, the teacher-forced divergence; no reference is built here. See
    `evaluate_gsm8k` for the arguments.

    Example:
    ```python
    prompts = encode_prompts(tokenizer, problems)
    completions = [tokenizer("The answer is 4.<|im_end|>")["input_ids"] for _ in problems]
    result = evaluate_completions(student, tokenizer, problems, prompts, completions, teacher=teacher)
    ```
    """
    _check_problems(problems, verifier)
    if not len(problems) == len(prompt_ids) == len(completion_ids):
        raise ValueError(
            f"Got {len(problems)} problems, {len(prompt_ids)} prompts and {len(completion_ids)} completions; give one "
            "prompt and one completion per problem."
        )
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}.")
    if teacher_reference is not None:
        teacher_reference.check(tokenizer=tokenizer, problems=problems)
    started = time.perf_counter()
    vocab = vocab_size(model)
    rocks = _rock_id_list(rock_ids, vocab)
    eos_ids = eos_token_ids(tokenizer, model)
    numeric = numeric_token_ids(tokenizer)

    records = []
    grading = {"verifier": verifier, "last_number": last_number}
    for (_, gold), completion in zip(problems, completion_ids):
        text = tokenizer.decode(list(completion), skip_special_tokens=True)
        ended = any(int(t) in eos_ids for t in completion)
        clipped = not ended and len(completion) >= max_new_tokens
        prediction, correct = grade_completion(text, gold, cut=clipped, **grading)
        quality = completion_quality(completion, eos_ids, max_new_tokens, numeric=numeric)
        records.append(
            {
                "gold": gold,
                "prediction": prediction,
                "correct": correct,
                "cut": clipped and prediction is None,
                "num_tokens": len(completion),
                "clipped": clipped,
                "finished": bool(quality["finished"]),
                "loop": bool(quality["loop"]),
                "repeated_ngram_fraction": _nan_to_none(quality["repeated_ngram_fraction"]),
                "completion": text,
            }
        )
    scored = verifier != "none"
    quality = text_quality(
        completion_ids, eos_ids, max_new_tokens, correct=[r["correct"] for r in records] if scored else None,
        numeric=numeric,
    )
    lengths = [r["num_tokens"] for r in records]
    num_tokens = sum(lengths)
    token_ids = torch.tensor([int(t) for c in completion_ids for t in c], dtype=torch.long)
    is_rock = torch.isin(token_ids, torch.tensor(rocks, dtype=torch.long)) if rocks is not None else None

    scoring = {"batch_size": batch_size, "beta": beta, "temperature": temperature, "show_progress": show_progress}
    mean_div = mean_div_non_rock = agreement = divergence = None
    if teacher is not None and num_tokens > 0:
        scores, divergence = _score(model, teacher, tokenizer, prompt_ids, completion_ids, "on-policy", **scoring)
        mean_div, agreement = float(divergence.mean()), _mean(torch.cat([s["agree"] for s in scores]))
        for record, score in zip(records, scores):
            record["mean_divergence"] = _mean(score["divergence"])
        if is_rock is not None and (~is_rock).any():
            mean_div_non_rock = float(divergence[~is_rock].mean())
    elif teacher is not None:
        logger.warning("Every completion is empty: no token to score against the teacher.")

    teacher_accuracy = teacher_forced = teacher_agreement = None
    if teacher_reference is not None:
        # Graded here, with this evaluation's verifier, whatever the reference file was graded with.
        teacher_reference = teacher_reference.regrade(tokenizer, problems, **grading)
        teacher_accuracy = teacher_reference.accuracy() if scored else None
        for record, flag in zip(records, teacher_reference.correct):
            record["teacher_correct"] = bool(flag) if scored else None
        forcing = forced_teacher if forced_teacher is not None else teacher
        if forcing is not None:
            # The student on the teacher's own completions: text it did not write, which a loop cannot game.
            forced, forced_divergence = _score(
                model, forcing, tokenizer, teacher_reference.prompt_ids, teacher_reference.completion_ids,
                "teacher-forced", **scoring,
            )
            teacher_forced = _mean(forced_divergence)
            teacher_agreement = _mean(torch.cat([s["agree"] for s in forced]))
            for record, score in zip(records, forced):
                record["teacher_forced_divergence"] = _mean(score["divergence"])
                record["teacher_forced_top1_agreement"] = _mean(score["agree"])

    accuracy = quality.accuracy
    result = EvalResult(
        accuracy=sum(r["correct"] for r in records) / len(records) if scored else None,
        num_problems=len(records),
        mean_divergence=mean_div,
        mean_divergence_non_rock=mean_div_non_rock,
        rock_token_share=float(is_rock.double().mean()) if is_rock is not None and num_tokens else None,
        top1_agreement=agreement,
        num_tokens=num_tokens,
        mean_completion_length=num_tokens / len(records),
        clipped_ratio=sum(r["clipped"] for r in records) / len(records),
        accuracy_low=None if accuracy is None else accuracy.low,
        accuracy_high=None if accuracy is None else accuracy.high,
        cut_ratio=sum(r["cut"] for r in records) / len(records),
        finished_rate=_nan_to_none(quality.finished_rate),
        loop_rate=_nan_to_none(quality.loop_rate),
        repeated_ngram_fraction=_nan_to_none(quality.repeated_ngram_fraction),
        distinct_1=_nan_to_none(quality.distinct_1),
        distinct_2=_nan_to_none(quality.distinct_2),
        teacher_accuracy=None if teacher_accuracy is None else teacher_accuracy.estimate,
        teacher_accuracy_low=None if teacher_accuracy is None else teacher_accuracy.low,
        teacher_accuracy_high=None if teacher_accuracy is None else teacher_accuracy.high,
        teacher_forced_divergence=teacher_forced,
        teacher_forced_top1_agreement=teacher_agreement,
        settings={
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "beta": beta,
            "temperature": temperature,
            "num_rock_ids": len(rocks) if rocks is not None else 0,
            "teacher": teacher is not None,
            # Which teacher each divergence was measured against: a top-k source gives the tail-bin divergence.
            "teacher_source": _source_name(teacher),
            "teacher_forced_source": _source_name(forced_teacher if forced_teacher is not None else teacher),
            "decoding": "greedy",
            "verifier": verifier,
            "last_number_fallback": last_number,
            "teacher_reference": None if teacher_reference is None else teacher_reference.fingerprint(),
            "scoring_seconds": round(time.perf_counter() - started, 3),
        },
        records=records,
        token_ids=token_ids,
        token_divergence=divergence,
    )
    return result


def evaluate_gsm8k(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    teacher: torch.nn.Module | TopKTeacher | None = None,
    teacher_reference: TeacherReference | str | os.PathLike | None = None,
    forced_teacher: TopKTeacher | None = None,
    rock_ids: Sequence[int] | str | os.PathLike | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    beta: float = 1.0,
    temperature: float = 1.0,
    show_progress: bool = True,
    verifier: str = "math",
    last_number: bool = False,
    journal: GenerationJournal | None = None,
) -> EvalResult:
    """Evaluate a student on GSM8K-style problems: accuracy, text quality, teacher-forced and on-policy divergence.

    The student answers every problem greedily (batched, left-padded, chat template, KV cache); its completions are
    then scored against the teacher with the training divergence (`beta`, `temperature`: use the training run's):
    the on-policy divergence. The student is also scored on the teacher's own greedy completions of the same problems
    (`teacher_reference`): the teacher-forced divergence, which a looping student cannot lower.

    Args:
        model: the student.
        tokenizer: its tokenizer (shared with the teacher); its chat template formats the questions.
        problems: `(messages, reference)` pairs (`hf_rockopd.data.load_problems`); a reference may be None with
            `verifier="none"`.
        teacher: the teacher; without one only accuracy, text quality and lengths are measured. A model, or a top-k
            source (`hf_rockopd.teachers`: served, cached): the divergences are then the tail-bin ones.
        forced_teacher: scores the teacher-forced divergence instead of `teacher` (an offline cache of the
            reference's completions, `hf-rockopd teacher-cache`); needs `teacher_reference`, which it cannot build.
        teacher_reference: the teacher's completions of `problems` (`teacher_reference.TeacherReference`, or the path
            of its JSON file), made with this tokenizer and `max_new_tokens` (else a `ValueError`). With a teacher and
            none given, one is built here; to compare evaluations (before and after training) build one
            (`load_or_build_teacher_reference`) and give it to each.
        rock_ids: a rock set, as ids or a `rock_tokens.json` / `rock_set.json` path (checked against the student's
            vocabulary), for `mean_divergence_non_rock` and `rock_token_share`.
        max_new_tokens: the longest completion; longer answers are cut and counted in `clipped_ratio`.
        batch_size: problems per generation and scoring batch.
        beta, temperature: the divergence, as in training (TRL's convention: 1 reverse KL, 0 forward KL).
        show_progress: tqdm bars for generation and scoring.
        verifier: how answers are checked (`verify_answer`): `"math"` (final answers, `\\boxed{}`), `"gsm8k"`
            (`#### n` references) or `"none"` (no accuracy; every other measure still).
        last_number: credit the last number of a finished completion that has no final-answer marker (off by
            default; never for a cut completion).
        journal: the student's finished generation batches (`journal.GenerationJournal`), read back and written
            as they finish, so a killed evaluation resumes at its batch.

    Returns:
        `EvalResult`, with per-problem `records`.

    Example:
    ```python
    result = evaluate_gsm8k(student, tokenizer, load_problems("openai/gsm8k", limit=32, tail=True),
                            teacher=teacher, rock_ids="run/rock_tokens.json", max_new_tokens=256)
    print(result.accuracy, result.teacher_forced_divergence, result.loop_rate, result.mean_divergence)
    ```
    """
    _check_problems(problems, verifier)
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}.")
    # Bad rock sets, vocabularies and references fail here, before minutes of generation.
    _rock_id_list(rock_ids, vocab_size(model))
    for source in (teacher, forced_teacher):
        if isinstance(source, TopKTeacher):
            source.check_vocabulary(vocab_size(model), tokenizer)
        elif source is not None:
            check_same_vocabulary(model, source)
    if isinstance(teacher_reference, (str, os.PathLike)):
        teacher_reference = TeacherReference.load(teacher_reference)
    local_teacher = teacher if isinstance(teacher, torch.nn.Module) else None
    if teacher_reference is not None:
        teacher_reference.check(
            tokenizer=tokenizer, problems=problems, max_new_tokens=max_new_tokens, teacher=local_teacher
        )
    elif forced_teacher is not None or (teacher is not None and local_teacher is None):
        raise ValueError(
            "A teacher outside this process (served or cached) cannot generate the teacher's reference completions: "
            "give teacher_reference (made by `hf-rockopd teacher-cache` or an evaluation with the teacher loaded)."
        )
    started = time.perf_counter()
    teacher_seconds = None
    if local_teacher is not None and teacher_reference is None:
        teacher_reference = build_teacher_reference(
            local_teacher, tokenizer, problems, max_new_tokens=max_new_tokens, batch_size=batch_size,
            show_progress=show_progress,
        )
        teacher_seconds = time.perf_counter() - started
    generation_started = time.perf_counter()
    prompts, completions = generate_completions(
        model, tokenizer, problems, max_new_tokens=max_new_tokens, batch_size=batch_size, show_progress=show_progress,
        journal=journal,
    )
    generation_seconds = time.perf_counter() - generation_started
    result = evaluate_completions(
        model, tokenizer, problems, prompts, completions, teacher=teacher, teacher_reference=teacher_reference,
        forced_teacher=forced_teacher, rock_ids=rock_ids, max_new_tokens=max_new_tokens, batch_size=batch_size, beta=beta, temperature=temperature,
        show_progress=show_progress, verifier=verifier, last_number=last_number,
    )
    result.settings["generation_seconds"] = round(generation_seconds, 3)
    if teacher_seconds is not None:
        result.settings["teacher_generation_seconds"] = round(teacher_seconds, 3)
    result.settings["wall_seconds"] = round(time.perf_counter() - started, 3)
    return result
