"""Problems and training prompts from any dataset: resolve it (`resolve`), read its columns (`formats`), draw the
held-out problems (seeded, never trained on) or take them from a separate evaluation dataset.

Example:
```python
from hf_rockopd.data import load_problems, split_dataset

problems = load_problems("HuggingFaceH4/MATH-500", split="test", limit=32)       # (messages, reference) pairs
data = split_dataset("openai/gsm8k", num_train=256, num_eval=16, seed=42)        # training chats + held-out problems
```
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .chat import Problem, check_system_prompt
from .formats import DataColumns, detect_columns, row_problem, row_training_messages
from .resolve import ResolvedDataset, resolve_dataset

__all__ = ["DataSplit", "load_dataset_columns", "load_problems", "split_dataset"]


def load_dataset_columns(
    source: Any, *, config: str | None = None, split: str = "train", prompt_column: str | None = None,
    answer_column: str | None = None,
) -> tuple[Any, DataColumns, str]:
    """`(dataset, columns, location)` of `source`: a path or Hub id (`resolve_dataset`) or a `datasets.Dataset`.

    Raises before any model loads: a dataset found nowhere (`FileNotFoundError`, listing the places tried), columns
    that fit no format, or an empty dataset (`ValueError`).
    """
    if isinstance(source, (str, os.PathLike)):
        found: ResolvedDataset = resolve_dataset(os.fspath(source), config=config, split=split)
        dataset, location = found.dataset, found.location
    else:
        from datasets import Dataset

        if not isinstance(source, Dataset):
            raise TypeError(f"A dataset is a path, a Hub id or a datasets.Dataset, got {type(source).__name__}.")
        dataset, location = source, "the dataset"
    columns = detect_columns(dataset.column_names, prompt_column, answer_column, source=f"Dataset {location!r}")
    if len(dataset) == 0:
        raise ValueError(f"Dataset {location!r} holds no rows. Give at least one problem.")
    return dataset, columns, location


def _problems(dataset: Any, columns: DataColumns, indices: Any, system_prompt: str | None, where: str) -> list:
    problems = []
    for index in indices:
        try:
            problems.append(row_problem(dataset[int(index)], columns, system_prompt))
        except ValueError as err:
            raise ValueError(f"{where}, row {int(index)}: {err}") from None
    return problems


def load_problems(
    source: Any,
    *,
    config: str | None = None,
    split: str = "train",
    prompt_column: str | None = None,
    answer_column: str | None = None,
    limit: int | None = None,
    tail: bool = False,
    system_prompt: str | None = None,
) -> list[Problem]:
    """Problems `(prompt messages, reference)` of any dataset in TRL's formats (`formats.detect_columns`).

    Args:
        source: a data file (JSONL, JSON, Parquet, CSV), a folder, a Hub id (`resolve_dataset`: a local copy first), or
            a `datasets.Dataset`.
        config, split: the Hub configuration and split (a data folder's `<split>.<ext>` file).
        prompt_column, answer_column: override the guessed columns.
        limit: keep this many problems (default: all); `tail` takes them from the end.
        system_prompt: a system turn before every prompt without one.

    Example:
    ```python
    >>> import json, os, tempfile
    >>> from hf_rockopd.data import load_problems
    >>> path = os.path.join(tempfile.mkdtemp(), "p.jsonl")
    >>> _ = open(path, "w").write(json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\\n")
    >>> load_problems(path)
    [([{'role': 'user', 'content': '1 + 1?'}], '2')]
    ```
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an integer >= 1 (or None for all problems), got {limit!r}.")
    check_system_prompt(system_prompt)  # before any file is read
    dataset, columns, location = load_dataset_columns(
        source, config=config, split=split, prompt_column=prompt_column, answer_column=answer_column
    )
    indices = range(len(dataset))
    if limit is not None:
        indices = indices[-limit:] if tail else indices[:limit]
    return _problems(dataset, columns, indices, system_prompt, location)


@dataclass
class DataSplit:
    """Training prompts (a `Dataset` of `messages`) and held-out problems, disjoint, with where they came from."""

    train: Any
    problems: list[Problem]
    columns: DataColumns
    location: str
    eval_location: str
    validation: list[Problem] = field(default_factory=list)
    # Row indices in the original dataset (before the shuffle) of the held-out and validation problems: the list a
    # report commits, so that anyone can check they were never trained on.
    eval_indices: list[int] = field(default_factory=list)
    validation_indices: list[int] = field(default_factory=list)


def split_dataset(
    dataset: Any,
    num_train: int,
    num_eval: int,
    *,
    seed: int = 42,
    config: str | None = None,
    split: str = "train",
    prompt_column: str | None = None,
    answer_column: str | None = None,
    system_prompt: str | None = None,
    eval_dataset: Any = None,
    eval_config: str | None = None,
    eval_split: str = "test",
    num_validation: int = 0,
) -> DataSplit:
    """Training prompts and held-out problems, disjoint: from one dataset, shuffled with `seed` and the held-out ones
    drawn first (the same evaluation set whatever `num_train` is); or the problems from `eval_dataset` (same columns
    and overrides), the first `num_eval` after the same shuffle. `num_validation` more problems are drawn right after
    the held-out ones (`DataSplit.validation`, never trained on either): the slice to choose settings on, so that the
    held-out problems are never tuned on.

    Example:
    ```python
    >>> import json, os, tempfile
    >>> from hf_rockopd.data import split_dataset
    >>> path = os.path.join(tempfile.mkdtemp(), "p.jsonl")
    >>> rows = [{"question": f"{i} + 1?", "answer": f"#### {i + 1}"} for i in range(6)]
    >>> _ = open(path, "w").write("".join(json.dumps(r) + "\\n" for r in rows))
    >>> data = split_dataset(path, num_train=4, num_eval=2, seed=0)
    >>> len(data.train), len(data.problems), data.train[0]["messages"][-1]["role"]
    (4, 2, 'assistant')
    ```
    """
    check_system_prompt(system_prompt)
    for name, value, low in (("num_train_prompts", num_train, 1), ("num_eval_problems", num_eval, 0),
                             ("num_validation_problems", num_validation, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    rows, columns, location = load_dataset_columns(
        dataset, config=config, split=split, prompt_column=prompt_column, answer_column=answer_column
    )
    held_in = 0 if eval_dataset is not None else num_eval + num_validation
    if num_train + held_in > len(rows):
        raise ValueError(
            f"num_train_prompts + num_eval_problems + num_validation_problems = {num_train + held_in} but "
            f"{location!r} has {len(rows)} rows. Ask for fewer, or give the held-out problems with --eval_dataset."
        )
    # `Dataset.shuffle(seed)` is this permutation; drawn here so that the original row indices are known.
    order = np.random.default_rng(seed).permutation(len(rows)).tolist()
    rows = rows.select(order)
    eval_location = location
    if eval_dataset is not None:
        eval_rows, _, eval_location = load_dataset_columns(
            eval_dataset, config=eval_config, split=eval_split, prompt_column=prompt_column,
            answer_column=answer_column,
        )
        eval_columns = detect_columns(eval_rows.column_names, prompt_column, answer_column,
                                      source=f"Dataset {eval_location!r}")
        if num_eval + num_validation > len(eval_rows):
            raise ValueError(
                f"num_eval_problems + num_validation_problems = {num_eval + num_validation} but {eval_location!r} "
                f"has {len(eval_rows)} rows."
            )
        eval_order = np.random.default_rng(seed).permutation(len(eval_rows)).tolist()
        source, source_columns, where = eval_rows.select(eval_order), eval_columns, eval_location
    else:
        eval_order, source, source_columns, where = order, rows, columns, location
    problems = _problems(source, source_columns, range(num_eval), system_prompt, where)
    validation = _problems(source, source_columns, range(num_eval, num_eval + num_validation), system_prompt, where)
    train = rows.select(range(held_in, held_in + num_train))

    def to_messages(row: dict[str, Any]) -> dict[str, Any]:
        return {"messages": row_training_messages(row, columns, system_prompt)}

    # Only `messages` stays: the collator reads it, and other columns (a chat `prompt`) would confuse TRL.
    train = train.map(to_messages, remove_columns=train.column_names)
    return DataSplit(
        train=train, problems=problems, columns=columns, location=location, eval_location=eval_location,
        validation=validation, eval_indices=eval_order[:num_eval],
        validation_indices=eval_order[num_eval : num_eval + num_validation],
    )
