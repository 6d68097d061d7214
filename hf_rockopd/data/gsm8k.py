"""GSM8K problem loading (`load_gsm8k_problems`): a JSON-lines file, a `datasets.Dataset` or the Hub's
`openai/gsm8k`, with the `#### n` gold checked on every row. Any other dataset: `hf_rockopd.data.load_problems`.

The chat helpers that used to live here are in `hf_rockopd.data.chat` (re-exported below for older imports).

Example:
```python
>>> from hf_rockopd.data.gsm8k import GSM8K_HUB_ID
>>> GSM8K_HUB_ID
'openai/gsm8k'
```
"""

from __future__ import annotations

import json
import os
from typing import Any

from .chat import Problem, check_system_prompt, question_messages, read_jsonl
from ..evaluation.answers import reference_answer

__all__ = ["GSM8K_HUB_ID", "Problem", "check_system_prompt", "load_gsm8k_problems", "question_messages", "read_jsonl"]

GSM8K_HUB_ID = "openai/gsm8k"


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
    >>> from hf_rockopd.data.gsm8k import load_gsm8k_problems
    >>> path = os.path.join(tempfile.mkdtemp(), "p.jsonl")
    >>> _ = open(path, "w").write(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\\n#### 2"}) + "\\n")
    >>> load_gsm8k_problems(path)
    [([{'role': 'user', 'content': '1 + 1?'}], '1 + 1 = 2\\n#### 2')]
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
            reference_answer(answer, "gsm8k")  # the `#### n` gold is checked here, before any generation
        except (TypeError, ValueError) as err:
            raise ValueError(f"{name}, row {index}: {err}") from None
        problems.append((question_messages(str(question), system_prompt), str(answer)))
    return problems
