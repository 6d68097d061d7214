"""The generation journal: greedy completions written batch by batch, so that a killed evaluation resumes at the batch
it was in rather than from its first problem.

A long evaluation on a CPU (250 problems at 512 tokens: an hour for a 1.5B teacher) must survive a stop. Each finished
batch is appended to a JSON-lines file as one line; the first line holds the key that the completions depend on
(model weights, tokenizer, problems, token limit, batch size: greedy decoding of a left-padded batch depends on its
other rows). A journal opened with another key is started afresh, with a warning, so a stale file is never mixed
into a new evaluation. This module is the file format's one owner.

Example:
```python
>>> import os, tempfile
>>> from hf_rockopd.evaluation.journal import GenerationJournal
>>> path = os.path.join(tempfile.mkdtemp(), "generate.jsonl")
>>> journal = GenerationJournal(path, {"model": "abc", "max_new_tokens": 8})
>>> journal.record(0, [[1, 2]], [[5, 6]])
>>> GenerationJournal(path, {"model": "abc", "max_new_tokens": 8}).batch(0)
([[1, 2]], [[5, 6]])
>>> GenerationJournal(path, {"model": "xyz", "max_new_tokens": 8}).batch(0) is None  # another model: started afresh
True
```
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = ["GenerationJournal"]

_FORMAT = "hf_rockopd.generation_journal/1"


class GenerationJournal:
    """Finished batches of a generation, keyed by their first problem's index, in an append-only JSON-lines file.

    Args:
        path: the journal file (created with its folder; a file made under another `key` is replaced).
        key: what the completions depend on; JSON-serialisable.

    Example:
    ```python
    journal = GenerationJournal("run/generate_after.jsonl", {"model": model_fingerprint(model), ...})
    prompts, completions = generate_completions(model, tokenizer, problems, journal=journal)
    ```
    """

    def __init__(self, path: str | os.PathLike, key: Mapping[str, Any]) -> None:
        self.path = os.fspath(path)
        self.key = json.loads(json.dumps(dict(key), sort_keys=True))
        self._batches: dict[int, tuple[list[list[int]], list[list[int]]]] = {}
        if os.path.exists(self.path):
            self._read()
        if not self._batches:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w", encoding="utf-8") as f:
                f.write(json.dumps({"format": _FORMAT, "key": self.key}, sort_keys=True) + "\n")

    def _read(self) -> None:
        with open(self.path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            header = {}
        if header.get("format") != _FORMAT or header.get("key") != self.key:
            if lines:
                logger.warning(f"The generation journal {self.path} was made with other settings; starting it again.")
            return
        for line in lines[1:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # the process was killed while writing this line: the batch is generated again
            self._batches[int(row["start"])] = (row["prompt_ids"], row["completion_ids"])

    def __len__(self) -> int:
        """Finished batches."""
        return len(self._batches)

    def batch(self, start: int) -> tuple[list[list[int]], list[list[int]]] | None:
        """`(prompt ids, completion ids)` of the batch starting at problem `start`, or None if not yet generated."""
        return self._batches.get(int(start))

    def record(self, start: int, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> None:
        """Append a finished batch (flushed and synced: a kill right after loses nothing)."""
        row = {"start": int(start), "prompt_ids": [list(map(int, p)) for p in prompt_ids],
               "completion_ids": [list(map(int, c)) for c in completion_ids]}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._batches[int(start)] = (row["prompt_ids"], row["completion_ids"])
