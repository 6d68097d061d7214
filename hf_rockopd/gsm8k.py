"""GSM8K: final-answer extraction, gold parsing, the one answer tolerance, and problem loading.

Evaluation (`hf_rockopd.evaluation`) and the lab's knockout (`hf_rockopd.lab`) both grade answers here, so a problem is
right or wrong the same way everywhere.

Example:
```python
>>> from hf_rockopd.gsm8k import extract_numeric_answer, is_correct, parse_gold_answer
>>> is_correct(extract_numeric_answer("So 3 + 4 = 7 apples."), parse_gold_answer("3 + 4 = 7\\n#### 7"))
True
```
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from typing import Any


__all__ = [
    "ANSWER_ABS_TOL",
    "ANSWER_REL_TOL",
    "GSM8K_HUB_ID",
    "Problem",
    "check_system_prompt",
    "extract_numeric_answer",
    "is_correct",
    "load_gsm8k_problems",
    "parse_gold_answer",
    "question_messages",
    "read_jsonl",
]

Problem = tuple[list[dict[str, str]], float]
"""A GSM8K-style problem: `(chat messages of the question, gold numeric answer)`, as `lab.knockout` takes it."""

# ---------------------------------------------------------------------------------------------------------------------
# Final-answer extraction
# ---------------------------------------------------------------------------------------------------------------------

# Thousands may be grouped by commas ("1,234") or by spaces, including the no-break and thin spaces of typeset
# output ("1 234"); a group is exactly three digits, so "3 4" stays two numbers and "1,23" is not 123.
_SPACE = "[ \u00a0\u2009\u202f]"
_INTEGER = rf"(?:\d{{1,3}}(?:,\d{{3}})+(?!\d)|\d{{1,3}}(?:{_SPACE}\d{{3}})+(?!\d)|\d+)"
# A minus sign counts only where it cannot be a subtraction or a hyphen ("5-3", "x-2", "50 - 15", "(3) - 2"): not
# right after a word character, and not after an operand and a space ("is -4" stays negative). A cut-off answer ending
# in "50 - 15" was read as -15.
_MINUS = r"(?<![\w.)\]])(?<![\d.)\]]\s)[-\u2212]"
_NUMBER = re.compile(
    rf"(?P<sign>{_MINUS}\s?)?(?:[$€£¥]\s?(?P<sign2>[-\u2212])?)?(?P<int>{_INTEGER})?(?P<frac>\.\d+)?"
)
_ANSWER_PHRASE = re.compile(r"(?:final\s+)?answer\s*(?:is|=|:|would\s+be|will\s+be)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\s*\{")


def _numbers(text: str) -> list[float]:
    """Every number in `text`, in order, as floats (currency, separators and signs understood)."""
    values = []
    for match in _NUMBER.finditer(text):
        integer, frac = match.group("int"), match.group("frac")
        if integer is None and frac is None:
            continue
        digits = re.sub(f"[,{_SPACE[1:-1]}]", "", integer or "0") + (frac or "")
        value = float(digits)
        if match.group("sign") or match.group("sign2"):
            value = -value
        values.append(value)
    return values


def _boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}`, braces balanced (so `\\boxed{\\frac{1}{2}}` is whole)."""
    contents = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                contents.append(text[start:i])
                break
    return contents


def _boxed_value(content: str) -> float | None:
    frac = re.fullmatch(r"\s*(-?)\s*\\d?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}\s*", content)
    if frac:
        num, den = _numbers(frac.group(2)), _numbers(frac.group(3))
        if len(num) == 1 and len(den) == 1 and den[0] != 0:
            return (-1 if frac.group(1) else 1) * num[0] / den[0]
        return None
    values = _numbers(content)
    return values[-1] if values else None


def extract_numeric_answer(text: str) -> float | None:
    """The final numeric answer of a GSM8K-style solution, or `None` when it has none.

    Rules, first that applies: the number after the last `####`; the number in the last `\\boxed{...}` (a
    `\\frac{a}{b}` is `a / b`); the first number after the last "answer is" / "answer:" / "answer =" that is followed
    by one; else the last number in the text. Numbers may carry thousands separators ("1,234", "1 234"), currency
    ("$1,234.50"), units or a percent sign ("12 km", "45%"), a sign ("-5", "−5", "-$5") and a trailing period
    ("is 5."). A hyphen after a word character is a subtraction, not a sign ("10-3" ends with 3).

    Example:
    ```python
    >>> from hf_rockopd.gsm8k import extract_numeric_answer
    >>> extract_numeric_answer("48 / 2 = 24 clips in May.\\n#### 72"), extract_numeric_answer("So she earned $1,200.")
    (72.0, 1200.0)
    >>> extract_numeric_answer("The answer is -3.5 degrees, not 4."), extract_numeric_answer("no idea") is None
    (-3.5, True)
    ```
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_numeric_answer takes a string, got {type(text).__name__}.")
    marked = text.rsplit("####", 1)
    if len(marked) == 2:
        values = _numbers(marked[1])
        if values:
            return values[0]
    for content in reversed(_boxed_contents(text)):
        value = _boxed_value(content)
        if value is not None:
            return value
    for phrase in reversed(list(_ANSWER_PHRASE.finditer(text))):
        # Only the rest of the phrase's line, so "The answer is below.\n3 + 4 = 7" falls through to the last number.
        line = text[phrase.end() :].split("\n", 1)[0]
        # "The answer is 18 - 2 = 16": the result is what follows the last "=".
        values = _numbers(line.rsplit("=", 1)[-1]) or _numbers(line)
        if values:
            return values[0]
    values = _numbers(text)
    return values[-1] if values else None


def parse_gold_answer(answer: str) -> float:
    """The gold answer of a GSM8K `answer` field: the number after its `####` marker.

    Raises `ValueError` when there is no `####` followed by a number, naming the text, so a malformed data set fails
    before any generation.

    Example:
    ```python
    >>> from hf_rockopd.gsm8k import parse_gold_answer
    >>> parse_gold_answer("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\n#### 1,072")
    1072.0
    ```
    """
    marked = str(answer).rsplit("####", 1)
    values = _numbers(marked[1]) if len(marked) == 2 else []
    if not values:
        raise ValueError(
            f"No gold answer in {str(answer)[-80:]!r}: a GSM8K answer ends with '#### <number>'. Fix the data, or "
            "pass an answer field that holds GSM8K solutions."
        )
    return values[0]



# GSM8K golds are integers or short decimals, parsed from text like the prediction, so an honest match is exact up to
# float noise ("0.1 + 0.2"): the absolute tolerance absorbs that noise. The relative one takes over only above 1,000
# (where 1e-9 × |gold| > 1e-6), for the float error of large values; up to 1,000 the rule is |prediction − gold| ≤ 1e-6.
ANSWER_ABS_TOL = 1e-6
ANSWER_REL_TOL = 1e-9


def is_correct(prediction: float | None, gold: float) -> bool:
    """Whether an extracted answer equals the gold one: `math.isclose(prediction, gold, rel_tol=ANSWER_REL_TOL,
    abs_tol=ANSWER_ABS_TOL)`; no answer (`None`) is wrong.

    The one answer tolerance of the package: evaluation accuracy and the knockout both use it.

    Example:
    ```python
    >>> from hf_rockopd.gsm8k import is_correct
    >>> is_correct(72.0, 72), is_correct(0.1 + 0.2, 0.3), is_correct(71.99, 72), is_correct(None, 72)
    (True, True, False, False)
    ```
    """
    return prediction is not None and math.isclose(prediction, gold, rel_tol=ANSWER_REL_TOL, abs_tol=ANSWER_ABS_TOL)


# ---------------------------------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------------------------------

GSM8K_HUB_ID = "openai/gsm8k"


def read_jsonl(path: str | os.PathLike, limit: int | None = None) -> Iterator[tuple[int, Any]]:
    """`(line number, parsed row)` of the non-blank lines of a JSON-lines file, at most `limit` of them.

    The one reader of the package's JSON-lines inputs (the lab's prompts, GSM8K problems): a line that is not JSON is a
    `ValueError` naming the file and line.

    Example:
    ```python
    >>> import os, tempfile
    >>> from hf_rockopd.gsm8k import read_jsonl
    >>> path = os.path.join(tempfile.mkdtemp(), "rows.jsonl")
    >>> _ = open(path, "w").write('{"a": 1}\\n\\n{"a": 2}\\n')
    >>> list(read_jsonl(path))
    [(1, {'a': 1}), (3, {'a': 2})]
    ```
    """
    taken = 0
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if limit is not None and taken >= limit:
                return
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {line_no}: not valid JSON ({err.msg}).") from err
            taken += 1
            yield line_no, row


def _read_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a problem file: JSON lines, or one JSON array of objects (a `.json` file)."""
    with open(path, encoding="utf-8") as f:
        start = f.read(4096).lstrip()[:1]
    if start == "[":
        with open(path, encoding="utf-8") as f:
            numbered = list(enumerate(json.load(f), start=1))
        where = "item"
    else:
        numbered, where = list(read_jsonl(path)), "line"
    for number, row in numbered:
        if not isinstance(row, dict):
            raise ValueError(f"{path}, {where} {number}: a problem is a JSON object, got {type(row).__name__}.")
    return [row for _, row in numbered]


def check_system_prompt(system_prompt: str | None) -> None:
    """Raise `ValueError` unless `system_prompt` is None or a non-empty string; every job checks it before it reads
    a file or loads a model.

    Example:
    ```python
    >>> from hf_rockopd.gsm8k import check_system_prompt
    >>> check_system_prompt("Answer briefly.")
    >>> check_system_prompt(" ")
    Traceback (most recent call last):
    ...
    ValueError: system_prompt must be a non-empty string or None, got ' '. Leave it unset to use the chat template's own default system turn.
    ```
    """
    if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt.strip()):
        raise ValueError(
            f"system_prompt must be a non-empty string or None, got {system_prompt!r}. Leave it unset to use the "
            "chat template's own default system turn."
        )


def question_messages(question: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The chat a question is asked as: a user turn, after a system turn when `system_prompt` is given.

    Training prompts, held-out problems, the teacher's reference and the lab all build their chats here, so a
    system prompt reaches every one of them or none.

    Example:
    ```python
    >>> from hf_rockopd.gsm8k import question_messages
    >>> question_messages("1 + 1?", "Answer briefly.")
    [{'role': 'system', 'content': 'Answer briefly.'}, {'role': 'user', 'content': '1 + 1?'}]
    ```
    """
    check_system_prompt(system_prompt)
    user = {"role": "user", "content": str(question)}
    return [{"role": "system", "content": system_prompt}, user] if system_prompt else [user]


def load_gsm8k_problems(
    source: Any,
    *,
    limit: int | None = None,
    tail: bool = False,
    split: str = "train",
    question_field: str = "question",
    answer_field: str = "answer",
    system_prompt: str | None = None,
) -> list[Problem]:
    """GSM8K-style problems as `(messages, gold)` pairs, from a JSON-lines file, a `datasets.Dataset`, or the Hub.

    Args:
        source: a `.jsonl` path (or a `.json` array of objects; read with `read_jsonl`), a `datasets.Dataset`, or
            `"openai/gsm8k"` (loaded with `load_dataset(..., "main", split=split)`; needs the Hub or its local cache).
        limit: keep this many problems (default: all).
        tail: take them from the end instead of the start: the end of a training file as a held-out set.
        question_field, answer_field: the columns holding the question and the GSM8K solution (`#### n` gold).
        system_prompt: a system turn before every question (`question_messages`); `None` leaves the chat
            template's default.

    Raises:
        ValueError: a missing column (the message lists the columns there are), an empty set, or an answer without a
            `####` gold number (the message names the row).

    Example:
    ```python
    >>> import json, os, tempfile
    >>> from hf_rockopd.gsm8k import load_gsm8k_problems
    >>> path = os.path.join(tempfile.mkdtemp(), "p.jsonl")
    >>> _ = open(path, "w").write(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\\n#### 2"}) + "\\n")
    >>> load_gsm8k_problems(path)
    [([{'role': 'user', 'content': '1 + 1?'}], 2.0)]
    ```
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (or None for all problems), got {limit}.")
    check_system_prompt(system_prompt)  # before any file is read
    rows: list[dict[str, Any]] | None = None
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        if os.path.isfile(name):
            rows = _read_rows(name)
            # Columns in order of first appearance; a row without one reads as None (and fails as that row).
            columns = list(dict.fromkeys(key for row in rows for key in row))
        elif name == GSM8K_HUB_ID:
            from datasets import load_dataset

            dataset = load_dataset(GSM8K_HUB_ID, "main", split=split)
        else:
            raise FileNotFoundError(
                f"No problem file at {name!r}. Give a JSON-lines file with `{question_field}` and `{answer_field}` "
                f"per line, or {GSM8K_HUB_ID!r} to load GSM8K from the Hub."
            )
    else:
        from datasets import Dataset

        if not isinstance(source, Dataset):
            raise TypeError(
                f"source must be a path, a datasets.Dataset or {GSM8K_HUB_ID!r}, got {type(source).__name__}."
            )
        dataset, name = source, "the dataset"
    if rows is None:
        columns = dataset.column_names
    missing = [f for f in (question_field, answer_field) if f not in columns]
    if missing:
        raise ValueError(
            f"{name} has no column {missing} (columns: {columns}). GSM8K-style problems need "
            f"`{question_field}` and `{answer_field}`; pass question_field=/answer_field= (`--question-field`, "
            "`--answer-field`) to name other columns."
        )
    count = len(rows) if rows is not None else len(dataset)
    if count == 0:
        raise ValueError(f"{name} holds no problem. Give at least one problem.")
    indices = range(count)
    if limit is not None:
        indices = indices[-limit:] if tail else indices[:limit]
    if rows is not None:
        questions = [rows[i].get(question_field) for i in indices]
        answers = [rows[i].get(answer_field) for i in indices]
    else:
        selected = dataset.select(indices)
        questions, answers = selected[question_field], selected[answer_field]
    problems = []
    for index, question, answer in zip(indices, questions, answers):
        try:
            gold = parse_gold_answer(answer)
        except ValueError as err:
            raise ValueError(f"{name}, row {index}: {err}") from None
        problems.append((question_messages(str(question), system_prompt), gold))
    return problems
