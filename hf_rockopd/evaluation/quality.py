"""Text-quality measures a degenerate student cannot fool: repetition, loops, distinct-n, finished answers, accuracy.

On-policy divergence is measured on the student's own samples, and once a phrase repeats in context the teacher
predicts the repetition too, so a student that loops ("…20 cookies, 20 cookies, 20 cookies…") *lowers* its on-policy
divergence while its text gets worse. These measures look at the text itself and are reported beside the divergence:

- `repeated_ngram_fraction`: 1 − distinct/total n-grams of one completion (n = 4): 0 never repeats, towards 1 loops.
- `find_loop` / `loop_rate`: a span of tokens repeated back to back; the share of completions that contain one.
- `distinct_n`: corpus distinct-n (distinct n-grams over all n-grams of all completions), n = 1, 2.
- `is_finished` / `is_clipped`: a stop id before the token limit; the limit hit without one.
- `accuracy_interval`: accuracy with its 95 % Wilson interval.
- `completion_quality`: one completion's measures as numbers (per-problem outcomes for the ablation's statistics).
- `TextQuality` / `text_quality`: all of these for one list of completions (finished, clipped, loop rates…), JSON.

Every function is pure and takes token ids (or any hashable tokens: `split_text` cuts a text into tokens the way a
BPE pre-tokenizer does, so the same defaults apply to texts).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
from scipy import stats

# Loops have their own module; their names stay importable from here, where every quality measure is.
from .loops import (
    DEFAULT_MAX_PERIOD,
    DEFAULT_MIN_REPEATS,
    DEFAULT_MIN_SPAN,
    Loop,
    _as_list,
    find_loop,
    loop_rate,
    numeric_token_ids,
    split_text,
)

__all__ = [
    "DEFAULT_MAX_PERIOD",
    "DEFAULT_MIN_REPEATS",
    "DEFAULT_MIN_SPAN",
    "DEFAULT_NGRAM",
    "Loop",
    "Proportion",
    "TextQuality",
    "accuracy_interval",
    "completion_quality",
    "distinct_n",
    "find_loop",
    "is_clipped",
    "is_finished",
    "loop_rate",
    "numeric_token_ids",
    "repeated_ngram_fraction",
    "split_text",
    "strip_stop",
    "text_quality",
]

DEFAULT_NGRAM = 4
def strip_stop(ids: Sequence[int], stop_ids: Iterable[int]) -> list[int]:
    """The completion before its first stop id: the text whose quality is measured (the stop id and padding go).

    Example:
    ```python
    >>> from hf_rockopd.evaluation.quality import strip_stop
    >>> strip_stop([5, 6, 2, 0, 0], [2])
    [5, 6]
    ```
    """
    stops, ids = {int(i) for i in stop_ids}, [int(i) for i in ids]
    return next((ids[:position] for position, token in enumerate(ids) if token in stops), ids)


def _ngrams(tokens: Sequence[Hashable], n: int) -> list[tuple]:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}.")
    tokens = _as_list(tokens)
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def repeated_ngram_fraction(tokens: Sequence[Hashable], n: int = DEFAULT_NGRAM) -> float:
    """1 − distinct/total n-grams of one completion: the share of its n-grams that repeat an earlier one.

    NaN when the completion has fewer than `n` tokens (no n-gram: nothing to measure, not "no repetition").

    Example:
    ```python
    >>> from hf_rockopd.evaluation.quality import repeated_ngram_fraction
    >>> repeated_ngram_fraction([1, 2, 3, 4, 5])
    0.0
    >>> repeated_ngram_fraction([1, 2, 1, 2, 1, 2, 1], n=2)  # 6 bigrams, 2 distinct
    0.6666666666666667
    ```
    """
    grams = _ngrams(tokens, n)
    if not grams:
        return float("nan")
    return 1.0 - len(set(grams)) / len(grams)


def distinct_n(completions: Iterable[Sequence[Hashable]], n: int = 1) -> float:
    """Corpus distinct-n: distinct n-grams over all n-grams of all completions (NaN when there is none).

    A student that says the same thing in every answer has a low distinct-n even if no single answer loops.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.quality import distinct_n
    >>> distinct_n([[1, 2, 3], [1, 2, 4]], n=1), distinct_n([[1, 2, 3], [1, 2, 4]], n=2)
    (0.6666666666666666, 0.75)
    ```
    """
    grams = [g for tokens in completions for g in _ngrams(tokens, n)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def _check_limit(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")


def is_finished(ids: Sequence[int], stop_ids: Iterable[int], max_new_tokens: int) -> bool:
    """Whether the completion ended by itself: a stop id among its first `max_new_tokens` tokens.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.quality import is_finished
    >>> is_finished([5, 6, 2, 0], stop_ids=[2], max_new_tokens=4), is_finished([5, 6, 7, 8], [2], 4)
    (True, False)
    ```
    """
    _check_limit(max_new_tokens)
    stops = {int(i) for i in stop_ids}
    return any(int(token) in stops for token in list(ids)[:max_new_tokens])


def is_clipped(ids: Sequence[int], stop_ids: Iterable[int], max_new_tokens: int) -> bool:
    """Whether the completion hit `max_new_tokens` without a stop id (cut by the limit, as the evaluation counts it).

    A completion shorter than the limit without a stop id (cut by a stop string, say) is neither finished nor clipped.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.quality import is_clipped
    >>> is_clipped([5, 6, 7, 8], stop_ids=[2], max_new_tokens=4), is_clipped([5, 6], [2], 4)
    (True, False)
    ```
    """
    return not is_finished(ids, stop_ids, max_new_tokens) and len(ids) >= max_new_tokens


def _share(values: Sequence[float]) -> float:
    """The mean of the defined values (NaN is undefined, e.g. no 4-gram); NaN when none is."""
    finite = [float(v) for v in values if not math.isnan(v)]
    return float(np.mean(finite)) if finite else float("nan")


@dataclass(frozen=True)
class Proportion:
    """A share with its confidence interval: `successes` of `trials`, `estimate` in [`low`, `high`].

    Example:
    ```python
    >>> from hf_rockopd.evaluation.quality import Proportion
    >>> Proportion(successes=0, trials=0, estimate=float("nan"), low=float("nan"), high=float("nan")).to_dict()
    {'successes': 0, 'trials': 0, 'estimate': None, 'low': None, 'high': None, 'confidence': 0.95}
    ```
    """

    successes: int
    trials: int
    estimate: float
    low: float
    high: float
    confidence: float = 0.95

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict (NaN, undefined for no trial, becomes None: JSON has no NaN)."""
        return {k: _json_float(v) for k, v in asdict(self).items()}

    def format(self, digits: int = 3) -> str:
        """`estimate [low, high]`, e.g. for tables."""
        if self.trials == 0:
            return "n/a"
        return f"{self.estimate:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def accuracy_interval(correct: int | Sequence[bool], trials: int | None = None, confidence: float = 0.95) -> Proportion:
    """Accuracy with its Wilson score interval (`scipy.stats.binomtest(...).proportion_ci(method="wilson")`).

    The Wilson interval keeps its coverage at 0/n and n/n and for small n, where the normal (Wald) interval collapses
    to a point: 0 of 16 correct is [0, 0.194], not [0, 0]. Pass either per-problem flags, or a count and `trials`.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.quality import accuracy_interval
    >>> accuracy_interval(3, 8).format()
    '0.375 [0.137, 0.694]'
    >>> accuracy_interval([True, False, False, False]).estimate
    0.25
    ```
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}.")
    if trials is None:
        if isinstance(correct, (int, np.integer)):
            raise ValueError("accuracy_interval needs `trials` with a count of correct answers.")
        flags = [bool(c) for c in correct]
        successes, trials = sum(flags), len(flags)
    else:
        successes = int(correct)
    if trials < 0 or not 0 <= successes <= trials:
        raise ValueError(f"Need 0 <= correct <= trials, got {successes} of {trials}.")
    if trials == 0:
        nan = float("nan")
        return Proportion(successes=0, trials=0, estimate=nan, low=nan, high=nan, confidence=confidence)
    interval = stats.binomtest(successes, trials).proportion_ci(confidence_level=confidence, method="wilson")
    low, high = float(interval.low), float(interval.high)
    return Proportion(successes, trials, successes / trials, low, high, confidence=confidence)


def _json_float(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


@dataclass(frozen=True)
class TextQuality:
    """The text quality of one list of completions (see the module docstring for each measure).

    Parameters:
        num_completions: completions measured.
        finished_rate: share that end with a stop id before `max_new_tokens`.
        clipped_rate: share cut by the limit without a stop id.
        repeated_ngram_fraction: mean over completions (with at least `ngram` tokens) of 1 − distinct/total n-grams.
        ngram: the n of `repeated_ngram_fraction`.
        loop_rate: share of completions containing a loop (`find_loop` with `loop_settings`).
        distinct_1, distinct_2: corpus distinct-1 and distinct-2.
        mean_length: mean completion length in tokens, stop id and padding excluded.
        accuracy: accuracy with its Wilson interval, when correctness was given, else None.
        loop_settings: `max_period`, `min_repeats`, `min_span` of the loop detector.
        NaN (undefined, e.g. for no completion) is None in `to_dict()`, so the dict is valid JSON.

    Example:
    ```python
    >>> import json
    >>> from hf_rockopd.evaluation.quality import TextQuality, text_quality
    >>> q = text_quality([[5, 6, 2], [5, 7, 8, 9]], stop_ids=[2], max_new_tokens=4, correct=[True, False])
    >>> q.accuracy.format(), q.finished_rate
    ('0.500 [0.095, 0.905]', 0.5)
    >>> TextQuality.from_dict(json.loads(json.dumps(q.to_dict()))) == q
    True
    ```
    """

    num_completions: int
    finished_rate: float
    clipped_rate: float
    repeated_ngram_fraction: float
    ngram: int
    loop_rate: float
    distinct_1: float
    distinct_2: float
    mean_length: float
    accuracy: Proportion | None = None
    loop_settings: Mapping[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict (for `run_report.json`, `eval.json` and the card)."""
        data = {f.name: _json_float(getattr(self, f.name)) for f in fields(self)}
        data["accuracy"] = None if self.accuracy is None else self.accuracy.to_dict()
        data["loop_settings"] = None if self.loop_settings is None else dict(self.loop_settings)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TextQuality:
        """Read back a `to_dict()`; a missing key is a `ValueError` naming it (None reads back as NaN)."""
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is not None]
        if missing:
            raise ValueError(f"A text-quality dict lacks {missing}.")
        nested = ("accuracy", "loop_settings")
        values = {f.name: _nan_if_none(data[f.name]) for f in fields(cls) if f.name not in nested}
        accuracy, settings = data.get("accuracy"), data.get("loop_settings")
        return cls(
            **values,
            accuracy=None if accuracy is None else Proportion(**{k: _nan_if_none(v) for k, v in accuracy.items()}),
            loop_settings=None if settings is None else dict(settings),
        )


def _nan_if_none(value: Any) -> Any:
    return float("nan") if value is None else value


def completion_quality(
    ids: Sequence[int],
    stop_ids: Iterable[int],
    max_new_tokens: int,
    ngram: int = DEFAULT_NGRAM,
    max_period: int = DEFAULT_MAX_PERIOD,
    min_repeats: int = DEFAULT_MIN_REPEATS,
    min_span: int = DEFAULT_MIN_SPAN,
    numeric: Collection[Hashable] | None = None,
) -> dict[str, float]:
    """One completion's measures, as numbers: the per-problem outcomes of an evaluation or an ablation run.

    `finished`, `clipped` and `loop` are 0.0 / 1.0; `repeated_ngram_fraction` (NaN under `ngram` tokens) and
    `length` are measured before the first stop id; `numeric` (`numeric_token_ids(tokenizer)`) keeps repeating
    decimals from counting as loops. `text_quality` is built from these, so the two always agree.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.quality import completion_quality
    >>> completion_quality([4, 5, 6] * 6, stop_ids=[2], max_new_tokens=18)
    {'finished': 0.0, 'clipped': 1.0, 'loop': 1.0, 'repeated_ngram_fraction': 0.8, 'length': 18.0}
    ```
    """
    stops = [int(i) for i in stop_ids]  # read three times below: a generator would be empty by the second
    text = strip_stop(ids, stops)
    return {
        "finished": float(is_finished(ids, stops, max_new_tokens)),
        "clipped": float(is_clipped(ids, stops, max_new_tokens)),
        "loop": float(find_loop(text, max_period, min_repeats, min_span, numeric) is not None),
        "repeated_ngram_fraction": repeated_ngram_fraction(text, ngram),
        "length": float(len(text)),
    }


def text_quality(
    completions: Sequence[Sequence[int]],
    stop_ids: Iterable[int],
    max_new_tokens: int,
    correct: Sequence[bool] | None = None,
    ngram: int = DEFAULT_NGRAM,
    max_period: int = DEFAULT_MAX_PERIOD,
    min_repeats: int = DEFAULT_MIN_REPEATS,
    min_span: int = DEFAULT_MIN_SPAN,
    confidence: float = 0.95,
    numeric: Collection[Hashable] | None = None,
) -> TextQuality:
    """Every text-quality measure of a list of generated completions (token ids, as generated: padding is fine).

    Finished and clipped are read from the raw completions; the repetition measures from each completion before its
    first stop id, so the stop id and the padding after it are not counted as repeated text.

    Args:
        completions: the generated ids of each completion, without the prompt.
        stop_ids: the ids that end a completion (`hf_rockopd.models.introspection.eos_token_ids`).
        max_new_tokens: the generation limit the completions were produced with.
        correct: per-completion correctness, for the accuracy and its interval (optional).
        numeric: the ids that only write numbers (`numeric_token_ids(tokenizer)`): a repeating decimal is no loop.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.quality import text_quality
    >>> looping = [[4, 5, 6] * 6]                 # never stops, repeats a 3-token span 6 times
    >>> q = text_quality(looping, stop_ids=[2], max_new_tokens=18)
    >>> q.loop_rate, q.clipped_rate, round(q.repeated_ngram_fraction, 3)
    (1.0, 1.0, 0.8)
    ```
    """
    stops = [int(i) for i in stop_ids]
    _check_limit(max_new_tokens)
    if correct is not None and len(correct) != len(completions):
        raise ValueError(f"Got {len(correct)} correctness flags for {len(completions)} completions.")
    loop_settings = {"max_period": max_period, "min_repeats": min_repeats, "min_span": min_span}
    each = [completion_quality(c, stops, max_new_tokens, ngram, **loop_settings, numeric=numeric) for c in completions]
    texts = [strip_stop(c, stops) for c in completions]
    return TextQuality(
        num_completions=len(completions),
        finished_rate=_share([e["finished"] for e in each]),
        clipped_rate=_share([e["clipped"] for e in each]),
        repeated_ngram_fraction=_share([e["repeated_ngram_fraction"] for e in each]),
        ngram=ngram,
        loop_rate=_share([e["loop"] for e in each]),
        distinct_1=distinct_n(texts, 1),
        distinct_2=distinct_n(texts, 2),
        mean_length=_share([e["length"] for e in each]),
        accuracy=None if correct is None else accuracy_interval(list(correct), confidence=confidence),
        loop_settings=loop_settings,
    )
