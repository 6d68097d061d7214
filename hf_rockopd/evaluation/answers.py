"""Final answers: find a completion's final answer and check it against a reference with `math-verify`.

Hugging Face's [`math-verify`](https://github.com/huggingface/Math-Verify) (also behind TRL's `accuracy_reward`) does
the extraction and the comparison: `\\boxed{}` first, then "the answer is" / "final answer:" anchors, LaTeX and plain
expressions, fractions, roots, intervals, sets, `\\text{}` answers, thousands separators, units. Our own code is kept
only where it demonstrably fails a case we need, each named in `tests/test_answers.py`:

- GSM8K's `#### n` marker (math-verify has no such anchor): the text after the last `####` is the answer;
- Markdown bold (`The answer is **42**.` reads as the string `42**.`): `**` is removed before parsing;
- the last-number fallback, an option (`last_number=True`, off by default): math-verify's unanchored extraction reads
  `50 - 15` as the expression 35, while a last-number rule must read 15 (never -15, a bug of the old extractor).

A completion without a final-answer marker has no prediction (`None`): it counts as wrong, and when it hit the token
limit the evaluation reports it as cut. The last-number fallback never applies to a cut completion (a cut-off
derivation whose last number happens to equal the gold is not an answer).

Example:
```python
>>> from hf_rockopd.evaluation.answers import verify_answer
>>> verify_answer("So she has \\\\boxed{72} dollars.", "#### 72", verifier="gsm8k")
True
>>> verify_answer("Half of it: \\\\boxed{0.5}", "\\\\frac{1}{2}"), verify_answer("Still computing 50 - 15", "35")
(True, None)
```
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any, Literal

__all__ = [
    "VERIFIERS",
    "Verifier",
    "check_verifier",
    "extract_answer",
    "grade_completion",
    "reference_answer",
    "verify_answer",
]

Verifier = Literal["math", "gsm8k", "none"]
VERIFIERS: tuple[str, ...] = ("math", "gsm8k", "none")
"""`math`: the reference is a final answer (or a solution with `\\boxed{}` or `####`); `gsm8k`: the reference is a
GSM8K solution whose gold is the number after `####`; `none`: no accuracy is scored."""

# math-verify has no `####` anchor; GSM8K solutions (and students trained on them) end with "#### n".
_GSM8K_MARK = "####"
# math-verify reads "The answer is **42**." as the string "42**."; bold markers carry no mathematics.
_BOLD = re.compile(r"\*\*|__")
# The last-number fallback's number, thousands grouped by commas or not. A minus sign counts only where it cannot be a
# subtraction: not after a word character, and not after an operand and a space ("50 - 15" ends with 15, not -15 as
# the old extractor read it; "is -4" stays -4).
_LAST_NUMBER = re.compile(r"(?:(?<![\w.)\]])(?<![\d.)\]]\s)-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def check_verifier(verifier: str) -> None:
    """Raise `ValueError` unless `verifier` is one of `VERIFIERS`; jobs call it before any model loads.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.answers import check_verifier
    >>> check_verifier("math")
    >>> check_verifier("exact")
    Traceback (most recent call last):
    ...
    ValueError: verifier must be one of ('math', 'gsm8k', 'none'), got 'exact'. Use 'math' for final answers (\\boxed{}, 'the answer is'), 'gsm8k' for '#### n' solutions, 'none' to score no accuracy.
    ```
    """
    if verifier not in VERIFIERS:
        raise ValueError(
            f"verifier must be one of {VERIFIERS}, got {verifier!r}. Use 'math' for final answers (\\boxed{{}}, "
            "'the answer is'), 'gsm8k' for '#### n' solutions, 'none' to score no accuracy."
        )


def _timeouts() -> dict[str, Any]:
    # math-verify times out with signal.alarm, which only works in the main thread (as in TRL's accuracy_reward).
    if threading.current_thread() is threading.main_thread():
        return {"parsing_timeout": 5}
    logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
    return {"parsing_timeout": None}


@functools.lru_cache(maxsize=1)
def _anchored_config() -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # Anchored only: without a marker there is no answer (try_extract_without_anchor=False); \boxed{} first.
    return [
        LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),
        ExprExtractionConfig(try_extract_without_anchor=False),
    ]


def _parse_expression(text: str) -> list[Any]:
    """math-verify's parse of a bare answer ("72", "\\frac{1}{2}", "(1, 3]"), as LaTeX math."""
    from math_verify import parse

    text = _BOLD.sub("", text).strip().rstrip(".").strip()
    if not text:
        return []
    parsed = parse(f"${text}$", **_timeouts())
    return parsed or parse(text, **_timeouts())


def _boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        brace = text.find("{", start)
        if brace != -1 and not text[start + len("\\boxed") : brace].strip():
            depth = 0
            for i in range(brace, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[brace + 1 : i]
        start = text.rfind("\\boxed", 0, start)
    return None


def extract_answer(completion: str, *, last_number: bool = False) -> list[Any] | None:
    """The final answer of `completion`, as math-verify parses it (`[sympy value, text]`), or `None` without one.

    A final answer needs a marker: `\\boxed{...}`, `#### n`, or an anchor such as "the answer is" / "final answer:".
    `last_number=True` falls back to the last number of a completion without a marker (off by default: see the
    module docstring).

    Example:
    ```python
    >>> from hf_rockopd.evaluation.answers import extract_answer
    >>> extract_answer("The answer is **42**.")[-1], extract_answer("so 50 - 15"), extract_answer("so 50 - 15", last_number=True)[-1]
    ('42', None, '15')
    ```
    """
    if not isinstance(completion, str):
        raise TypeError(f"extract_answer takes a string, got {type(completion).__name__}.")
    from math_verify import parse

    if _GSM8K_MARK in completion:
        tail = completion.rsplit(_GSM8K_MARK, 1)[1].strip().split("\n", 1)[0]
        parsed = _parse_expression(tail)
        if parsed:
            return parsed
    text = _BOLD.sub("", completion)
    parsed = parse(text, extraction_config=_anchored_config(), extraction_mode="first_match", **_timeouts())
    if parsed:
        return parsed
    if last_number:
        numbers = _LAST_NUMBER.findall(text)
        if numbers:
            return _parse_expression(numbers[-1].replace(",", "")) or None
    return None


def reference_answer(reference: Any, verifier: str = "math") -> str:
    """The gold answer text of a reference, as `verifier` reads it.

    `gsm8k`: the number after the last `####` of a GSM8K solution (a bare number is taken as it is). `math`: the last
    `\\boxed{}` of a worked solution, else the text after `####`, else the whole reference (a MATH `answer` column).

    Raises `ValueError` for a `gsm8k` reference without `#### n`, or an empty one, naming the text.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.answers import reference_answer
    >>> reference_answer("48/2 = 24 clips.\\n#### 72", "gsm8k"), reference_answer("so \\\\boxed{\\\\frac{1}{2}}.")
    ('72', '\\\\frac{1}{2}')
    ```
    """
    check_verifier(verifier)
    if isinstance(reference, bool) or not isinstance(reference, (str, int, float)):
        raise TypeError(
            f"A reference answer is a string or a number, got {type(reference).__name__}: {reference!r:.80}."
        )
    if isinstance(reference, (int, float)):
        return str(int(reference)) if float(reference).is_integer() else repr(float(reference))
    text = reference.strip()
    if verifier == "gsm8k":
        if _GSM8K_MARK in text:
            gold = text.rsplit(_GSM8K_MARK, 1)[1].strip().replace(",", "")
        else:
            gold = text if _LAST_NUMBER.fullmatch(text.replace(",", "")) else ""
        if not gold:
            raise ValueError(
                f"No gold answer in {text[-80:]!r}: a GSM8K reference ends with '#### <number>'. Fix the data, or use "
                "--verifier math for references that are final answers or \\boxed{} solutions."
            )
        return gold
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    if _GSM8K_MARK in text:
        return text.rsplit(_GSM8K_MARK, 1)[1].strip()
    if not text:
        raise ValueError("An empty reference answer: give the final answer (or a solution with \\boxed{} or ####).")
    return text


@functools.lru_cache(maxsize=4096)
def _parsed_reference(gold: str) -> tuple[Any, ...]:
    return tuple(_parse_expression(gold))


def verify_answer(completion: str, reference: Any, verifier: str = "math", *, last_number: bool = False) -> bool | None:
    """Whether the final answer of `completion` equals `reference`, checked by math-verify; `None` when the completion
    has no final answer (no `\\boxed{}`, `####` or "the answer is"), which the evaluation counts as wrong.

    Args:
        completion: the model's text.
        reference: the reference answer (see `reference_answer` for how each verifier reads it).
        verifier: `"math"`, `"gsm8k"` or `"none"` (which scores nothing and returns None).
        last_number: fall back to the completion's last number when it has no marker (off by default).

    Example:
    ```python
    >>> from hf_rockopd.evaluation import verify_answer
    >>> verify_answer("The answer is $72.", "#### 72", "gsm8k"), verify_answer("\\\\boxed{(1, 3]}", "(1,3]")
    (True, True)
    >>> verify_answer("The answer is 7.", "\\\\frac{1}{2}"), verify_answer("Let me think", "7") is None
    (False, True)
    ```
    """
    check_verifier(verifier)
    if verifier == "none":
        return None
    gold = _parsed_reference(reference_answer(reference, verifier))
    predicted = extract_answer(completion, last_number=last_number)
    return None if predicted is None else _equal(gold, predicted)


def _equal(gold: tuple[Any, ...], predicted: list[Any]) -> bool:
    if not gold:
        return False  # an unparseable reference: math-verify cannot credit any answer
    from math_verify import verify

    main = threading.current_thread() is threading.main_thread()
    return bool(verify(list(gold), predicted, timeout_seconds=5 if main else None))


def grade_completion(
    completion: str, reference: Any, verifier: str = "math", *, cut: bool = False, last_number: bool = False
) -> tuple[str | None, bool | None]:
    """`(prediction, correct)` of one completion: the extracted answer's text (None without a final answer) and
    whether it is right (None for `verifier="none"` or no reference; a completion without an answer is wrong).

    The one grading rule of evaluation, teacher reference and knockout. `cut`: the completion hit the token limit; the
    last-number fallback (`last_number`) never applies to it.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.answers import grade_completion
    >>> grade_completion("The answer is 4.", "4"), grade_completion("2 + 2 = 4", "4", cut=True, last_number=True)
    (('4', True), (None, False))
    ```
    """
    check_verifier(verifier)
    # No reference (a prompt-only dataset): nothing to grade; the evaluation refuses it unless the verifier is none.
    gold = None if verifier == "none" or reference is None else _parsed_reference(reference_answer(reference, verifier))
    predicted = extract_answer(completion, last_number=last_number and not cut)
    prediction = None if predicted is None else str(predicted[-1])
    if gold is None:
        return prediction, None
    return prediction, predicted is not None and _equal(gold, predicted)
