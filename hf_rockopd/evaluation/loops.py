"""Loops in generated text: a span of tokens repeated back to back ("…20 cookies, 20 cookies, 20 cookies…").

`find_loop` finds the longest one in a completion (token ids, or texts cut with `split_text`), `loop_rate` is the
share of completions that contain one, and `numeric_token_ids` names the ids that only write numbers, whose
repetition ("3.846153846…") is a repeating decimal, not degenerate text. `hf_rockopd.evaluation.quality` reports them with the
other text measures.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_MAX_PERIOD",
    "DEFAULT_MIN_REPEATS",
    "DEFAULT_MIN_SPAN",
    "Loop",
    "find_loop",
    "loop_rate",
    "numeric_token_ids",
    "split_text",
]

# The loop defaults were chosen on GSM8K's 7,473 reference solutions cut by `split_text` (digits one per token, as
# the SmolLM2 and Qwen tokenizers do): "20 cookies, 20 cookies, 20 cookies" spans 14 tokens (period 5), the gallons
# loop ("the number of gallons in the first gallon, which is …" three times) 29 tokens (period 11). With 3 repeats and
# 12 tokens, 13 of the 7,473 solutions (0.17 %) are flagged, all written-out sums or products ("3 cars + 3 cars +
# 3 cars + 3 cars", "2*2*2*…"), which have the very shape of a short loop; a lower span flags digit runs and
# "+ 2 + 2 +", a higher one misses the cookies. Two back-to-back copies are not a loop: reference solutions restate
# an equation line ("2L + 11 = 35\n2L + 11 = 35") often enough; `repeated_ngram_fraction` measures milder repetition.
DEFAULT_MAX_PERIOD = 40
DEFAULT_MIN_REPEATS = 3
DEFAULT_MIN_SPAN = 12

# The Qwen2 / GPT-4-style pre-tokenizer with the standard library's `re` (`[^\W\d_]` is a letter): words with their
# leading space, single digits, punctuation runs, newlines. Texts then cut into units about as long as BPE tokens.
_PRE_TOKENIZER = re.compile(r"[^\r\n\w]?[^\W\d_]+|\d| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def split_text(text: str) -> list[str]:
    """Cut a text into BPE-sized pieces (words with their leading space, single digits, punctuation, newlines).

    The pieces join back to the text, and the loop defaults, chosen in token ids, apply to them.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.loops import split_text
    >>> split_text("He has 20 cookies, 20 cookies.")
    ['He', ' has', ' ', '2', '0', ' cookies', ',', ' ', '2', '0', ' cookies', '.']
    ```
    """
    return _PRE_TOKENIZER.findall(text)



def _as_list(tokens: Sequence[Hashable]) -> list:
    return tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)  # a tensor's elements hash by identity


@dataclass(frozen=True)
class Loop:
    """A span of `period` tokens repeated back to back from `start`, covering `span` tokens (`repeats` = span/period).

    Example:
    ```python
    >>> from hf_rockopd.evaluation.loops import Loop
    >>> Loop(start=2, period=3, repeats=3.0, span=9).to_dict()
    {'start': 2, 'period': 3, 'repeats': 3.0, 'span': 9}
    ```
    """

    start: int
    period: int
    repeats: float
    span: int

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict."""
        return asdict(self)


# What a number is written with: digits, a decimal point, a thousands separator (alone or with a leading space).
_NUMERIC = re.compile(r" ?[\d.,]+")


def numeric_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of a tokenizer whose text is only digits, '.' or ',' (with at most a leading space): `find_loop`'s
    `numeric` tokens for ids.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.loops import numeric_token_ids
    >>> from hf_rockopd.models import build_tiny_tokenizer
    >>> tokenizer = build_tiny_tokenizer()
    >>> ids = numeric_token_ids(tokenizer)
    >>> tokenizer.convert_tokens_to_ids("7") in ids, tokenizer.convert_tokens_to_ids("a") in ids
    (True, False)
    ```
    """
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return frozenset(i for i, text in enumerate(texts) if _NUMERIC.fullmatch(text))


def _numeric_mask(tokens: list, numeric: Collection[Hashable] | None) -> np.ndarray | None:
    """Which tokens write numbers: those in `numeric`, else string tokens matching `_NUMERIC`; None when none can."""
    if numeric is not None:
        numeric = set(numeric)
        return np.fromiter((t in numeric for t in tokens), dtype=bool, count=len(tokens))
    if tokens and all(isinstance(t, str) for t in tokens):
        return np.fromiter((bool(_NUMERIC.fullmatch(t)) for t in tokens), dtype=bool, count=len(tokens))
    return None


def find_loop(
    tokens: Sequence[Hashable],
    max_period: int = DEFAULT_MAX_PERIOD,
    min_repeats: int = DEFAULT_MIN_REPEATS,
    min_span: int = DEFAULT_MIN_SPAN,
    numeric: Collection[Hashable] | None = None,
) -> Loop | None:
    """The longest loop in a completion: a span of 1..`max_period` tokens repeated back to back, else None.

    A run where `tokens[i] == tokens[i + p]` for `L` consecutive positions is `(L + p) / p` copies of a period-`p`
    span. It is a loop when it covers at least `min_span` tokens and has at least `min_repeats` copies, a final copy
    counting when at least half of it is there: "20 cookies, 20 cookies, 20 cookies" is three copies of
    "20 cookies, " whose last comma never comes. `min_span` keeps digit runs ("1000000") and short written-out sums
    from counting; see `DEFAULT_MIN_SPAN` for how the defaults were chosen.

    A repeated span made only of `numeric` tokens (digits, a decimal point) is a number, not a loop: Qwen's
    tokenizer writes "3.846153846153846" one digit per token, a 6-digit period repeated. For ids give
    `numeric_token_ids(tokenizer)`; string tokens (`split_text`) are numeric when they are digits, '.' or ','.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.loops import find_loop, split_text
    >>> find_loop(split_text("So he has 20 cookies, 20 cookies, 20 cookies"))
    Loop(start=3, period=5, repeats=2.8, span=14)
    >>> find_loop(split_text("Natalia sold 48/2 = 24 clips in May and 48+24 = 72 clips in all.")) is None
    True
    >>> find_loop(split_text("so 50/13 = 3.846153846153846 hours")) is None  # a repeating decimal
    True
    ```
    """
    if max_period < 1 or min_repeats < 2 or min_span < 1:
        raise ValueError(
            f"find_loop needs max_period >= 1, min_repeats >= 2, min_span >= 1; got {max_period}, {min_repeats}, "
            f"{min_span}."
        )
    # Map the tokens (ids or strings) to small integers so that numpy can compare them.
    codes: dict[Hashable, int] = {}
    tokens = _as_list(tokens)
    array = np.fromiter((codes.setdefault(t, len(codes)) for t in tokens), dtype=np.int64, count=len(tokens))
    n, periods = len(array), min(max_period, len(array) // 2)
    if periods < 1:
        return None
    # All periods in one pass: row p - 1 marks tokens[i] == tokens[i + p] (-1 pads the end, equal to no code), framed
    # by False columns so that a run never crosses rows and every run's rising and falling edges pair up.
    padded = np.concatenate((array, np.full(periods, -1)))
    same = np.zeros((periods, n + 2), dtype=np.int8)
    same[:, 1:-1] = np.lib.stride_tricks.sliding_window_view(padded[1:], n)[:periods] == array
    edges = np.flatnonzero(np.diff(same.ravel()))
    starts, ends = edges[::2], edges[1::2]
    period = starts // (n + 2) + 1
    spans = ends - starts + period
    # floor(x + 0.5): a final copy counts when at least half of it is there (see the docstring).
    spans = np.where((spans >= min_span) & (np.floor(spans / period + 0.5) >= min_repeats), spans, 0)
    is_numeric = _numeric_mask(tokens, numeric)
    if is_numeric is not None:
        for i in np.flatnonzero(spans):
            first = int(starts[i] % (n + 2))
            if is_numeric[first : first + int(period[i])].all():
                spans[i] = 0
    if not spans.size or spans.max() == 0:
        return None
    # The longest wins; argmax takes the first, and runs are ordered by period: at equal span, the shortest period.
    i = int(spans.argmax())
    span, p = int(spans[i]), int(period[i])
    return Loop(start=int(starts[i] % (n + 2)), period=p, repeats=round(span / p, 4), span=span)


def loop_rate(
    completions: Sequence[Sequence[Hashable]],
    max_period: int = DEFAULT_MAX_PERIOD,
    min_repeats: int = DEFAULT_MIN_REPEATS,
    min_span: int = DEFAULT_MIN_SPAN,
    numeric: Collection[Hashable] | None = None,
) -> float:
    """The share of completions that contain a loop (`find_loop`); NaN for no completion.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.loops import loop_rate
    >>> loop_rate([[1, 2, 3, 4], [5, 6] * 8])
    0.5
    ```
    """
    flags = [find_loop(c, max_period, min_repeats, min_span, numeric) is not None for c in completions]
    return float(np.mean(flags)) if flags else float("nan")
