"""Prompt loading for the lab: chat prompts for `collect_token_table`, problems for `knockout` (`hf_rockopd.data`).

Both read JSON lines with `hf_rockopd.data.gsm8k.read_jsonl`, the package's one reader.

Example:
```python
prompts = load_prompts("gsm8k/train.jsonl", limit=500)          # chats, for collect_token_table
problems = load_problems("gsm8k/train.jsonl", limit=200)        # (chat, gold) pairs, for knockout
```
"""

from __future__ import annotations

import os
from typing import Any

from ..data import load_problems
from ..data.chat import check_system_prompt, question_messages, read_jsonl


__all__ = ["load_problems", "load_prompts"]

# One problem loader for the knockout and `hf-rockopd eval` (any dataset in TRL's formats): `hf_rockopd.data`'s.


def load_prompts(
    path: str | os.PathLike,
    limit: int | None = None,
    field_name: str | None = None,
    system_prompt: str | None = None,
) -> list[Any]:
    """Read prompts from a JSON-lines file: each line has `messages` (a chat), `prompt` or `question` (GSM8K); any
    other dataset (a Parquet, CSV or JSON file, a folder, a Hub id) is read by `hf_rockopd.data.load_problems`.

    Returns chat message lists (`[{"role": "user", "content": ...}]`), the form `collect_token_table` takes.
    `system_prompt` opens each chat that has no system turn of its own (`hf_rockopd.data.gsm8k.question_messages`), as
    the distill and ablate jobs' prompts did when they were given one.

    Example:
    ```python
    >>> import tempfile, os, json
    >>> from hf_rockopd.lab import load_prompts
    >>> path = os.path.join(tempfile.mkdtemp(), "p.jsonl")
    >>> _ = open(path, "w").write(json.dumps({"question": "1 + 1?", "answer": "2"}) + "\\n")
    >>> load_prompts(path)
    [[{'role': 'user', 'content': '1 + 1?'}]]
    ```
    """
    check_system_prompt(system_prompt)  # before the file is read
    if not str(path).lower().endswith(".jsonl"):
        problems = load_problems(path, limit=limit, prompt_column=field_name, system_prompt=system_prompt)
        return [chat for chat, _ in problems]
    fields = [field_name] if field_name else ["messages", "prompt", "question"]
    prompts: list[Any] = []
    for line_no, row in read_jsonl(path, limit):
        found = next((name for name in fields if isinstance(row, dict) and row.get(name)), None)
        if found is None:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(
                f"{path}, line {line_no}: no prompt field; expected one of {fields}, got {keys}. Pass "
                "`field_name=` (`--prompt-field`) to name the column that holds the prompt."
            )
        value = row[found]
        if found == "messages":
            # Drop a trailing assistant answer: the student must generate it.
            value = [m for m in value if m.get("role") != "assistant"] or value
            if system_prompt and not any(m.get("role") == "system" for m in value):
                value = [{"role": "system", "content": system_prompt}, *value]
            prompts.append(value)
        else:
            prompts.append(question_messages(str(value), system_prompt))
    if not prompts:
        raise ValueError(f"{path} holds no prompt. Give a JSON-lines file with one prompt per line.")
    return prompts
