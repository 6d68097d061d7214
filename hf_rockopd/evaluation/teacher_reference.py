"""The teacher's reference answers: its greedy completions of a problem set, generated once and cached as JSON.

The evaluation scores the student on these completions (teacher-forced divergence: text the student did not write,
which a looping student cannot game) and reports the teacher's accuracy on them as the ceiling. They cost a teacher
generation, the slowest part of an evaluation, so they are made once per problem set and reused: the distill job
builds one for both its "before" and "after" evaluations, and `hf-rockopd eval --teacher_reference PATH` keeps one
across checkpoints.

This module is the one owner of the file format (`TEACHER_REFERENCE_NAME`, format version `FORMAT_VERSION`). A file
records what the completions depend on: the teacher (name and a fingerprint of its weights), the tokenizer
(fingerprint), the problems (fingerprint), `max_new_tokens` and the stop ids. `load_or_build_teacher_reference`
reuses a file only when all of these match, and otherwise regenerates it (or refuses, with `on_mismatch="error"`),
naming what differs: a cache made with other settings is never silently reused.

Example:
```python
from hf_rockopd.evaluation.teacher_reference import load_or_build_teacher_reference

reference = load_or_build_teacher_reference("run/teacher_reference.json", teacher, tokenizer, problems,
                                            teacher_name="Qwen/Qwen2.5-Coder-1.5B-Instruct", max_new_tokens=256)
print(reference.accuracy().format())  # the ceiling, e.g. '0.750 [0.409, 0.929]'
```
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch
from transformers.utils import logging

from .answers import grade_completion
from ..data.chat import Problem
from .journal import GenerationJournal
from ..models.introspection import eos_token_ids
from .quality import Proportion, accuracy_interval
from .rollout import as_chat, generate_completions


logger = logging.get_logger(__name__)

__all__ = [
    "FORMAT_VERSION",
    "TEACHER_REFERENCE_NAME",
    "TeacherReference",
    "build_teacher_reference",
    "load_or_build_teacher_reference",
    "model_fingerprint",
    "problems_fingerprint",
    "tokenizer_fingerprint",
]

TEACHER_REFERENCE_NAME = "teacher_reference.json"
FORMAT_VERSION = 1
# The settings a file must match to be reused, in the order a mismatch names them.
_KEY_FIELDS = (
    "format_version",
    "teacher",
    "teacher_fingerprint",
    "tokenizer_fingerprint",
    "problems_fingerprint",
    "max_new_tokens",
    "stop_ids",
)
# Values sampled per parameter tensor for the weights fingerprint: enough to tell checkpoints apart, cheap for 1.5B.
_SAMPLES_PER_TENSOR = 64


def _sha256(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def problems_fingerprint(problems: Sequence[Problem]) -> str:
    """sha256 of the problems (their chat messages and reference answers, in order).

    Example:
    ```python
    >>> from hf_rockopd.evaluation.teacher_reference import problems_fingerprint
    >>> a = [([{"role": "user", "content": "1 + 1?"}], 2.0)]
    >>> problems_fingerprint(a) == problems_fingerprint(list(a)), problems_fingerprint(a) == problems_fingerprint(a * 2)
    (True, False)
    ```
    """
    # A number keeps the float form older files were keyed with; a text reference (MATH, chat data) is kept as text.
    return _sha256([[as_chat(p), p[1] if p[1] is None or isinstance(p[1], str) else float(p[1])] for p in problems])


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what turns a problem into prompt ids: the vocabulary, the special tokens and the chat template.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_tokenizer
    >>> from hf_rockopd.evaluation.teacher_reference import tokenizer_fingerprint
    >>> len(tokenizer_fingerprint(build_tiny_tokenizer()))
    64
    ```
    """
    return _sha256(
        {
            "vocab": sorted(tokenizer.get_vocab().items()),
            "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
            "chat_template": getattr(tokenizer, "chat_template", None),
        }
    )


@torch.no_grad()
def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of the model's parameter names, shapes, dtypes and a strided sample of each tensor's values.

    Two checkpoints of one model differ in it (training changes every tensor) while hashing a 1.5B model's weights
    whole would take seconds; the sample is exact values, so it does not depend on the device.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm
    >>> from hf_rockopd.evaluation.teacher_reference import model_fingerprint
    >>> model_fingerprint(build_tiny_causal_lm(seed=0)) == model_fingerprint(build_tiny_causal_lm(seed=1))
    False
    ```
    """
    from ..models.packing import dense_named_parameters

    digest = hashlib.sha256()
    # A teacher packed for CPU inference (`pack_for_inference`) has the same fingerprint as before packing.
    for name, parameter in dense_named_parameters(model):
        flat = parameter.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLES_PER_TENSOR)][:_SAMPLES_PER_TENSOR]
        digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype};".encode())
        digest.update(sample.float().cpu().numpy().tobytes())
    return digest.hexdigest()


def _model_name(model: torch.nn.Module) -> str:
    return str(getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", ""))


@dataclass
class TeacherReference:
    """The teacher's greedy completions of a problem set, with the settings they were made with.

    Parameters:
        teacher: the teacher's name (Hub id or path; informational, and checked when both sides have one).
        teacher_fingerprint, tokenizer_fingerprint, problems_fingerprint: see the functions of those names.
        max_new_tokens: the generation limit.
        stop_ids: the ids that ended a completion (`modeling.eos_token_ids` of the teacher).
        prompt_ids, completion_ids: per problem, as `rollout.generate_completions` returns them.
        predictions, correct: the teacher's extracted answer (None: none found) and whether it equals the reference;
            `regrade` grades them again with another verifier.
        format_version: `FORMAT_VERSION` of the file.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.teacher_reference import TeacherReference
    >>> r = TeacherReference(teacher="t", teacher_fingerprint="a", tokenizer_fingerprint="b", problems_fingerprint="c",
    ...                      max_new_tokens=8, stop_ids=[2], prompt_ids=[[1]], completion_ids=[[5, 2]],
    ...                      predictions=[4.0], correct=[True])
    >>> TeacherReference.from_dict(r.to_dict()) == r, r.accuracy().format()
    (True, '1.000 [0.207, 1.000]')
    ```
    """

    teacher: str
    teacher_fingerprint: str
    tokenizer_fingerprint: str
    problems_fingerprint: str
    max_new_tokens: int
    stop_ids: list[int]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    predictions: list[str | float | None]
    correct: list[bool]
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        n = len(self.prompt_ids)
        if not len(self.completion_ids) == len(self.predictions) == len(self.correct) == n:
            raise ValueError(
                f"A teacher reference needs one completion, prediction and flag per prompt; got {n} prompts, "
                f"{len(self.completion_ids)} completions, {len(self.predictions)} predictions, "
                f"{len(self.correct)} flags."
            )

    def accuracy(self, confidence: float = 0.95) -> Proportion:
        """The teacher's accuracy with its Wilson interval: the ceiling of a student on these problems."""
        return accuracy_interval(self.correct, confidence=confidence)

    def regrade(
        self, tokenizer: Any, problems: Sequence[Problem], verifier: str = "math", last_number: bool = False
    ) -> TeacherReference:
        """A copy whose predictions and flags are graded by `verifier` (`answers.grade_completion`), as the
        evaluation grades the student: a file built with one verifier serves an evaluation with another."""
        predictions, correct = _grade(self.completion_ids, tokenizer, problems, self.stop_ids, self.max_new_tokens,
                                      verifier, last_number)
        return replace(self, predictions=predictions, correct=[bool(c) for c in correct])

    def head(self, problems: Sequence[Problem]) -> TeacherReference:
        """The reference of the first `len(problems)` problems, which must be the first problems of this reference's
        own set (a slice evaluated at each checkpoint of a run).

        Example:
        ```python
        slice_reference = reference.head(problems[:32])
        ```
        """
        n = len(problems)
        if not 0 < n <= len(self.prompt_ids):
            raise ValueError(f"A head of this reference has 1 to {len(self.prompt_ids)} problems, got {n}.")
        return replace(
            self, problems_fingerprint=problems_fingerprint(problems), prompt_ids=self.prompt_ids[:n],
            completion_ids=self.completion_ids[:n], predictions=self.predictions[:n], correct=self.correct[:n],
        )

    def key(self) -> dict[str, Any]:
        """The settings a cached file must match to be reused."""
        return {name: getattr(self, name) for name in _KEY_FIELDS}

    def fingerprint(self) -> str:
        """A short id of `key()`: two evaluations showing the same one used the same reference."""
        return _sha256(self.key())[:12]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict (the file's content)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TeacherReference:
        """Read back a `to_dict()`; a missing key or an unknown format version is a `ValueError`."""
        names = [f for f in cls.__dataclass_fields__ if f not in ("extra", "format_version")]
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"Not a teacher reference: keys {missing} are missing.")
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"Teacher reference format {data.get('format_version')!r}, this version reads {FORMAT_VERSION}."
            )
        return cls(**{n: data[n] for n in names}, extra=dict(data.get("extra") or {}))

    def save(self, path: str | os.PathLike) -> str:
        """Write the JSON file (atomically: a crash never leaves half a cache); returns the path."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f)
        os.replace(path + ".tmp", path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> TeacherReference:
        """Read a file written by `save`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def mismatches(self, expected: Mapping[str, Any]) -> list[str]:
        """The settings in `expected` (a `key()`) this reference differs in, as `name: cached != expected` lines.

        An empty teacher name on either side is not a mismatch (a model built in code has none).
        """
        found = []
        for name in _KEY_FIELDS:
            if name not in expected:
                continue
            cached, wanted = getattr(self, name), expected[name]
            if name == "teacher" and (not cached or not wanted):
                continue
            if cached != wanted:
                found.append(f"{name}: {_short(cached)} != {_short(wanted)}")
        return found

    def check(
        self, *, tokenizer: Any = None, problems: Sequence[Problem] | None = None, max_new_tokens: int | None = None,
        teacher: torch.nn.Module | None = None,
    ) -> None:
        """`ValueError` naming every setting given here that this reference was not made with.

        Example:
        ```python
        reference.check(tokenizer=tokenizer, problems=problems, max_new_tokens=256, teacher=teacher)
        ```
        """
        expected: dict[str, Any] = {}
        if tokenizer is not None:
            expected["tokenizer_fingerprint"] = tokenizer_fingerprint(tokenizer)
        if problems is not None:
            expected["problems_fingerprint"] = problems_fingerprint(problems)
        if max_new_tokens is not None:
            expected["max_new_tokens"] = max_new_tokens
        if teacher is not None:
            expected["teacher_fingerprint"] = model_fingerprint(teacher)
        differences = self.mismatches(expected)
        if differences:
            raise ValueError(
                "The teacher reference was made with other settings (" + "; ".join(differences) + "); build one "
                "for these problems (build_teacher_reference) or give the matching file."
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text[:15] + "…" if isinstance(value, str) and len(value) > 16 else text


def _expected_key(
    teacher: torch.nn.Module, tokenizer: Any, problems: Sequence[Problem], teacher_name: str | None,
    max_new_tokens: int,
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "teacher": teacher_name if teacher_name is not None else _model_name(teacher),
        "teacher_fingerprint": model_fingerprint(teacher),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "problems_fingerprint": problems_fingerprint(problems),
        "max_new_tokens": int(max_new_tokens),
        "stop_ids": eos_token_ids(tokenizer, teacher),
    }


def _grade(completions, tokenizer, problems, stop_ids, max_new_tokens, verifier, last_number):
    stops = {int(t) for t in stop_ids}
    graded = [
        grade_completion(
            tokenizer.decode(c, skip_special_tokens=True), reference, verifier, last_number=last_number,
            cut=len(c) >= max_new_tokens and not any(int(t) in stops for t in c),
        )
        for c, (_, reference) in zip(completions, problems)
    ]
    return [p for p, _ in graded], [bool(c) for _, c in graded]


def build_teacher_reference(
    teacher: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    teacher_name: str | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    show_progress: bool = False,
    verifier: str = "math",
    last_number: bool = False,
    journal_path: str | os.PathLike | None = None,
) -> TeacherReference:
    """The teacher's greedy completions of `problems` (`rollout.generate_completions`) and their correctness
    (`answers.grade_completion` with `verifier` and `last_number`). With `journal_path`, each finished batch is
    written there (`journal.GenerationJournal`), and a build killed midway resumes at its batch.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer
    >>> from hf_rockopd.evaluation.teacher_reference import build_teacher_reference
    >>> tokenizer = build_tiny_tokenizer()
    >>> reference = build_teacher_reference(build_tiny_causal_lm(tokenizer), tokenizer,
    ...                                     [([{"role": "user", "content": "1 + 1?"}], 2.0)], max_new_tokens=4)
    >>> len(reference.completion_ids[0]) <= 4, reference.max_new_tokens
    (True, 4)
    ```
    """
    key = _expected_key(teacher, tokenizer, problems, teacher_name, max_new_tokens)
    journal = None
    if journal_path is not None:
        journal = GenerationJournal(journal_path, {**key, "batch_size": int(batch_size)})
    prompts, completions = generate_completions(
        teacher, tokenizer, problems, max_new_tokens=max_new_tokens, batch_size=batch_size,
        show_progress=show_progress, journal=journal,
    )
    predictions, correct = _grade(completions, tokenizer, problems, key["stop_ids"], max_new_tokens, verifier,
                                  last_number)
    return TeacherReference(
        **{k: v for k, v in key.items() if k != "format_version"},
        prompt_ids=prompts,
        completion_ids=completions,
        predictions=predictions,
        correct=correct,
    )


def load_or_build_teacher_reference(
    path: str | os.PathLike | None,
    teacher: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    teacher_name: str | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    on_mismatch: Literal["regenerate", "error"] = "regenerate",
    show_progress: bool = False,
    verifier: str = "math",
) -> TeacherReference:
    """The cached reference at `path` when it was made with these settings, else a new one (written to `path`).

    A file made with other settings (teacher, its weights, tokenizer, problems, `max_new_tokens`, stop ids) is
    regenerated and overwritten with a warning naming what differs, or refused (`ValueError`) with
    `on_mismatch="error"`. `path=None` builds one in memory without caching it. While a new one is generated, its
    finished batches are journaled beside `path` (`<path>.generate.jsonl`), so a killed build resumes at its batch.

    Example:
    ```python
    >>> import tempfile, os
    >>> from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer
    >>> from hf_rockopd.evaluation.teacher_reference import load_or_build_teacher_reference
    >>> tokenizer, teacher = build_tiny_tokenizer(), build_tiny_causal_lm()
    >>> problems = [([{"role": "user", "content": "1 + 1?"}], 2.0)]
    >>> path = os.path.join(tempfile.mkdtemp(), "teacher_reference.json")
    >>> first = load_or_build_teacher_reference(path, teacher, tokenizer, problems, max_new_tokens=4)
    >>> load_or_build_teacher_reference(path, teacher, tokenizer, problems, max_new_tokens=4) == first
    True
    ```
    """
    if on_mismatch not in ("regenerate", "error"):
        raise ValueError(f"on_mismatch is 'regenerate' or 'error', got {on_mismatch!r}.")
    if path is not None and os.path.exists(path):
        expected = _expected_key(teacher, tokenizer, problems, teacher_name, max_new_tokens)
        try:
            cached = TeacherReference.load(path)
            differences = cached.mismatches(expected)
        except (ValueError, OSError, TypeError) as error:
            cached, differences = None, [f"unreadable ({error})"]
        if cached is not None and not differences:
            logger.info(f"Reusing the teacher's completions cached in {path}.")
            return cached
        message = f"The teacher reference {path} was made with other settings: " + "; ".join(differences)
        if on_mismatch == "error":
            raise ValueError(message + ". Delete it, or give another path.")
        logger.warning(message + "; generating it again.")
    journal_path = None if path is None else os.fspath(path) + ".generate.jsonl"
    reference = build_teacher_reference(
        teacher, tokenizer, problems, teacher_name=teacher_name, max_new_tokens=max_new_tokens,
        batch_size=batch_size, show_progress=show_progress, verifier=verifier, journal_path=journal_path,
    )
    if path is not None:
        reference.save(path)
        os.remove(journal_path)  # the reference holds every completion now
    return reference
