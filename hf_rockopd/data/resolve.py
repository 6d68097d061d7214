"""Datasets found the way models are found: a local copy first, the Hub last, one error listing what was tried.

For a name such as `openai/gsm8k` (with its config and split), the places, in order:

1. an explicit path: a data file (JSONL, JSON, Parquet, CSV) or a folder holding `<split>.<ext>`;
2. the folder in `$HF_ROCKOPD_DATA_DIR`: `<dir>/<name>/<split>.<ext>`;
3. the development machines' shared folder, `../shared/data/<name>/<split>.<ext>` (from the working directory);
4. the `datasets` cache, then the Hub (`datasets.load_dataset(name, config, split=split)`; offline, with
   `HF_DATASETS_OFFLINE=1`, the cache alone).

`<name>` is the id's last part as written, lowercased, and lowercased without punctuation: `openai/gsm8k` is looked
for as `gsm8k/`, `HuggingFaceH4/MATH-500` as `MATH-500/`, `math-500/` or `math500/`.

Example:
```python
from hf_rockopd.data import resolve_dataset

found = resolve_dataset("openai/gsm8k", split="train")  # ../shared/data/gsm8k/train.jsonl here, the Hub elsewhere
print(found.location, len(found.dataset))
```
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DATA_DIR_ENV", "DEFAULT_CONFIGS", "ResolvedDataset", "dataset_folder_names", "load_data_file",
           "resolve_dataset"]

DATA_DIR_ENV = "HF_ROCKOPD_DATA_DIR"
# File suffix -> the `datasets` builder that reads it.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Hub datasets that cannot load without a config; any other id takes `config=None` (its default).
DEFAULT_CONFIGS = {"openai/gsm8k": "main"}
_SHARED_DATA = os.path.join("..", "shared", "data")


@dataclass
class ResolvedDataset:
    """A dataset and where it was found: `source` is `"path"`, `"data_dir"`, `"shared"` or `"hub"` (the Hub or the
    `datasets` cache), `location` the file, folder or Hub id."""

    dataset: Any
    source: str
    location: str


def dataset_folder_names(name: str) -> list[str]:
    """The folder names a Hub id is looked for under in a data directory.

    Example:
    ```python
    >>> from hf_rockopd.data import dataset_folder_names
    >>> dataset_folder_names("HuggingFaceH4/MATH-500")
    ['MATH-500', 'math-500', 'math500']
    ```
    """
    last = name.rstrip("/").split("/")[-1]
    return list(dict.fromkeys([last, last.lower(), re.sub(r"[^a-z0-9]", "", last.lower())]))


def load_data_file(path: str | os.PathLike) -> Any:
    """A local data file (JSONL, JSON, Parquet, CSV) as a `datasets.Dataset`.

    Example:
    ```python
    >>> import json, os, tempfile
    >>> from hf_rockopd.data import load_data_file
    >>> path = os.path.join(tempfile.mkdtemp(), "p.jsonl")
    >>> _ = open(path, "w").write(json.dumps({"question": "1 + 1?", "answer": "2"}) + "\\n")
    >>> load_data_file(path).column_names
    ['question', 'answer']
    ```
    """
    from datasets import load_dataset

    path = os.fspath(path)
    suffix = Path(path).suffix.lower()
    if suffix not in _BUILDERS:
        raise ValueError(
            f"{path!r} is not a data file this package reads: give a {', '.join(_BUILDERS)} file (suffix {suffix!r})."
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Dataset file {path!r} does not exist.")
    if os.path.getsize(path) == 0:  # `datasets` fails on an empty file with an unhelpful StopIteration
        raise ValueError(f"Dataset file {path!r} is empty. Give at least one row.")
    return load_dataset(_BUILDERS[suffix], data_files=path, split="train")


def _split_file(folder: str, split: str) -> str | None:
    for suffix in _BUILDERS:
        candidate = os.path.join(folder, f"{split}{suffix}")
        if os.path.isfile(candidate):
            return candidate
    return None


def _in_data_dir(root: str, name: str, split: str) -> str | None:
    for folder in dataset_folder_names(name):
        found = _split_file(os.path.join(root, folder), split)
        if found:
            return found
    return None


def _looks_like_path(name: str) -> bool:
    return os.path.exists(name) or Path(name).suffix.lower() in _BUILDERS or name.startswith((".", "/", "~"))


def resolve_dataset(name: str, config: str | None = None, split: str = "train") -> ResolvedDataset:
    """The dataset `name` (a local file or folder, or a Hub id), from the first place that has it (see the module).

    Raises `FileNotFoundError` for an explicit path that does not exist, and for a Hub id found nowhere, listing every
    place tried and how to fix it.
    """
    name = os.path.expanduser(os.fspath(name))
    if _looks_like_path(name):
        if os.path.isdir(name):
            found = _split_file(name, split)
            if found is None:
                raise FileNotFoundError(
                    f"Dataset folder {name!r} holds no {split}.<{'|'.join(s[1:] for s in _BUILDERS)}> file; give the "
                    "data file itself, or name the split with --dataset_split."
                )
            return ResolvedDataset(load_data_file(found), "path", found)
        return ResolvedDataset(load_data_file(name), "path", name)
    tried: list[str] = []
    data_dir = os.environ.get(DATA_DIR_ENV)
    places = [("data_dir", data_dir, f"${DATA_DIR_ENV}")] if data_dir else []
    places.append(("shared", _SHARED_DATA, "the shared data folder"))
    for source, root, label in places:
        found = _in_data_dir(root, name, split)
        if found:
            return ResolvedDataset(load_data_file(found), source, found)
        shown = "|".join(dataset_folder_names(name))
        tried.append(f"{label}: no {os.path.abspath(root)}/{{{shown}}}/{split}.{{jsonl,json,parquet,csv}}")
    if not data_dir:
        tried.insert(0, f"${DATA_DIR_ENV}: not set")
    config = config if config is not None else DEFAULT_CONFIGS.get(name)
    try:
        from datasets import load_dataset

        return ResolvedDataset(load_dataset(name, config, split=split), "hub", name)
    except Exception as err:  # noqa: BLE001 - any failure of the cache and the Hub is reported with the places tried
        tried.append(f"the datasets cache and the Hub (load_dataset({name!r}, {config!r}, split={split!r})): "
                     f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
    raise FileNotFoundError(
        f"Dataset {name!r} (config {config!r}, split {split!r}) was not found. Tried, in order:\n  - "
        + "\n  - ".join(tried)
        + f"\nGive a local file (JSONL, JSON, Parquet, CSV), put a copy at $"
        f"{DATA_DIR_ENV}/{dataset_folder_names(name)[-1]}/{split}.jsonl, or connect to the Hub."
    )
