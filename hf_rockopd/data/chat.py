"""Problems and chats: the `Problem` pair, the chat a question is asked as, the system-prompt check, and the one
JSON-lines reader of the package's inputs.

Example:
```python
>>> from hf_rockopd.data.chat import question_messages
>>> question_messages("1 + 1?")
[{'role': 'user', 'content': '1 + 1?'}]
```
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["Problem", "check_system_prompt", "question_messages", "read_jsonl"]

Problem = tuple[list[dict[str, str]], str | float | None]
"""A problem: `(chat messages of the question, reference answer)`; the reference is text (a GSM8K solution ending in
`#### n`, a MATH answer, a chat's last assistant turn) or a number, read by `evaluation.answers.reference_answer`; None for a prompt without a reference."""


def read_jsonl(path: str | os.PathLike, limit: int | None = None) -> Iterator[tuple[int, Any]]:
    """`(line number, parsed row)` of the non-blank lines of a JSON-lines file, at most `limit` of them.

    The one reader of the package's JSON-lines inputs (the lab's prompts, GSM8K problems): a line that is not JSON is a
    `ValueError` naming the file and line.

    Example:
    ```python
    >>> import os, tempfile
    >>> from hf_rockopd.data.chat import read_jsonl
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


def check_system_prompt(system_prompt: str | None) -> None:
    """Raise `ValueError` unless `system_prompt` is None or a non-empty string; every job checks it before it reads
    a file or loads a model.

    Example:
    ```python
    >>> from hf_rockopd.data.chat import check_system_prompt
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
    >>> from hf_rockopd.data.chat import question_messages
    >>> question_messages("1 + 1?", "Answer briefly.")
    [{'role': 'system', 'content': 'Answer briefly.'}, {'role': 'user', 'content': '1 + 1?'}]
    ```
    """
    check_system_prompt(system_prompt)
    user = {"role": "user", "content": str(question)}
    return [{"role": "system", "content": system_prompt}, user] if system_prompt else [user]
