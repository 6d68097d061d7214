"""Which columns of a dataset hold the prompt and the reference answer, in TRL's formats, and the rows as problems.

Formats, first that fits (`--prompt_column` / `--answer_column` override the guess):

- `messages` (TRL's conversational language modeling): a chat; its last assistant turn is the reference, the turns
  before it the prompt;
- `prompt` (TRL's prompt-only or prompt-completion): text (one user turn) or a chat; the reference is the
  `completion` column (its last assistant turn when conversational), or an answer column;
- question/answer pairs: `question` or `problem` (GSM8K, MATH), with `answer` or `solution` as the reference.

A reference column is optional: prompts alone train, and evaluate with `--verifier none`.

Example:
```python
>>> from hf_rockopd.data import detect_columns, row_problem
>>> columns = detect_columns(["problem", "solution", "answer"])
>>> columns
DataColumns(format='question_answer', prompt='problem', answer='answer')
>>> row_problem({"problem": "1 + 1?", "answer": "2"}, columns)
([{'role': 'user', 'content': '1 + 1?'}], '2')
```
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .chat import Problem, check_system_prompt, question_messages

__all__ = ["ANSWER_COLUMNS", "FORMATS", "QUESTION_COLUMNS", "DataColumns", "detect_columns", "row_problem",
           "row_training_messages"]

QUESTION_COLUMNS = ("question", "problem")
ANSWER_COLUMNS = ("answer", "solution", "completion", "ground_truth", "final_answer")
FORMATS = (
    "`messages` (a chat; the last assistant turn is the reference)",
    "`prompt` (text or a chat), with an optional `completion` or answer column",
    "question/answer pairs (`question` or `problem`, with `answer` or `solution`)",
)


@dataclass(frozen=True)
class DataColumns:
    """The columns a dataset's problems are read from.

    Parameters:
        format: `"messages"`, `"prompt"` or `"question_answer"`.
        prompt: the column holding the prompt (text or chat).
        answer: the column holding the reference answer; None for `messages` without an override (its last assistant
            turn) or for prompts without references.
    """

    format: str
    prompt: str
    answer: str | None


def detect_columns(
    columns: Sequence[str], prompt_column: str | None = None, answer_column: str | None = None,
    source: str = "The dataset",
) -> DataColumns:
    """The format of a dataset with `columns`, with the overrides; a `ValueError` naming the columns and the formats
    when none fits, or when an override names a missing column.

    Example:
    ```python
    >>> from hf_rockopd.data import detect_columns
    >>> detect_columns(["question", "answer"]).format, detect_columns(["messages"]).format
    ('question_answer', 'messages')
    >>> detect_columns(["text", "label"])
    Traceback (most recent call last):
    ...
    ValueError: The dataset has columns ['text', 'label'], which fit none of the formats: `messages` (a chat; the last assistant turn is the reference); `prompt` (text or a chat), with an optional `completion` or answer column; question/answer pairs (`question` or `problem`, with `answer` or `solution`). Name its columns with --prompt_column (and --answer_column).
    ```
    """
    columns = list(columns)
    for flag, name in (("--prompt_column", prompt_column), ("--answer_column", answer_column)):
        if name is not None and name not in columns:
            raise ValueError(f"{source} has no column {name!r} ({flag}); its columns are {columns}.")
    if answer_column is not None and answer_column == prompt_column:
        raise ValueError(f"--prompt_column and --answer_column both name {prompt_column!r}; give two columns.")
    if prompt_column is not None:
        fmt = {"messages": "messages", "prompt": "prompt"}.get(prompt_column, "question_answer")
        prompt = prompt_column
    elif "messages" in columns:
        fmt, prompt = "messages", "messages"
    elif "prompt" in columns:
        fmt, prompt = "prompt", "prompt"
    else:
        prompt = next((c for c in QUESTION_COLUMNS if c in columns), None)
        if prompt is None:
            raise ValueError(
                f"{source} has columns {columns}, which fit none of the formats: {'; '.join(FORMATS)}. Name its "
                "columns with --prompt_column (and --answer_column)."
            )
        fmt = "question_answer"
    answer = answer_column
    if answer is None and fmt != "messages":
        answer = next((c for c in ANSWER_COLUMNS if c in columns and c != prompt), None)
    return DataColumns(format=fmt, prompt=prompt, answer=answer)


def _is_chat(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in value)


def _text(value: Any) -> str | None:
    """A reference's text: a string, a number as text, or a chat's last assistant turn."""
    if value is None:
        return None
    if _is_chat(value):
        turns = [m for m in value if m.get("role") == "assistant"]
        return str(turns[-1].get("content", "")) if turns else None
    return value if isinstance(value, str) else str(value)


def _with_system(chat: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    if system_prompt and not any(m.get("role") == "system" for m in chat):
        return [{"role": "system", "content": system_prompt}, *chat]
    return chat


def row_problem(row: dict[str, Any], columns: DataColumns, system_prompt: str | None = None) -> Problem:
    """One row as `(prompt messages, reference)`: the reference is text, or None when the row has none.

    `system_prompt` opens a chat that has no system turn of its own. A row whose prompt is empty is a `ValueError`.

    Example:
    ```python
    >>> from hf_rockopd.data import DataColumns, row_problem
    >>> chat = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "\\\\boxed{4}"}]
    >>> row_problem({"messages": chat}, DataColumns("messages", "messages", None))
    ([{'role': 'user', 'content': '2 + 2?'}], '\\\\boxed{4}')
    ```
    """
    check_system_prompt(system_prompt)
    value = row.get(columns.prompt)
    if value is None:
        # A file mixing formats (JSON lines with `messages` on some rows, `question` on others): each row is read by
        # the first prompt column it fills, and its reference likewise.
        filled = next((c for c in ("messages", "prompt", *QUESTION_COLUMNS) if row.get(c) is not None), None)
        if filled is not None and filled != columns.prompt:
            answer = columns.answer if columns.answer and row.get(columns.answer) is not None else None
            if answer is None and filled != "messages":
                answer = next((c for c in ANSWER_COLUMNS if row.get(c) is not None and c != filled), None)
            return row_problem(row, DataColumns(columns.format, filled, answer), system_prompt)
    reference = _text(row.get(columns.answer)) if columns.answer is not None else None
    if _is_chat(value):
        chat = [dict(m) for m in value]
        if chat and chat[-1].get("role") == "assistant":
            last = chat.pop()
            if columns.answer is None:
                reference = _text([last])
        elif reference is None:  # a chat without its answer turn: an answer column of the row, if it has one
            reference = next((_text(row[c]) for c in ANSWER_COLUMNS if row.get(c) is not None), None)
        if not chat:
            raise ValueError(f"A row's {columns.prompt!r} chat has no turn before its answer: {value!r:.120}.")
        return _with_system(chat, system_prompt), reference
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"A row has an empty prompt in column {columns.prompt!r}: {row!r:.120}.")
    return question_messages(str(value), system_prompt), reference


def row_training_messages(row: dict[str, Any], columns: DataColumns, system_prompt: str | None = None) -> list[dict]:
    """The chat a training prompt is given as (`messages`, what the on-policy collator reads): the prompt, then the
    reference as the assistant turn when there is one (the dataset completion of off-policy steps).

    Example:
    ```python
    >>> from hf_rockopd.data import detect_columns, row_training_messages
    >>> row_training_messages({"question": "1 + 1?", "answer": "#### 2"}, detect_columns(["question", "answer"]))
    [{'role': 'user', 'content': '1 + 1?'}, {'role': 'assistant', 'content': '#### 2'}]
    ```
    """
    chat, reference = row_problem(row, columns, system_prompt)
    return chat if reference is None else [*chat, {"role": "assistant", "content": reference}]
