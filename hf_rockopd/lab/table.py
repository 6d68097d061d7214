"""The token table's file format: its one owner (names, columns, Parquet parts, metadata, reader and writers).

A token table is a directory: one Parquet part per collected batch (`part-00000.parquet`, ...; one row per generated
token, columns `TOKEN_TABLE_COLUMNS`), `meta.json` (the tokenizer and settings that made it, also in each part's
schema metadata), and optionally `grad_cosine.parquet` (each row's cosine with G_balanced, `lab.gradients`).
`collect_token_table` and `gradient_cosines` write it through the writers here; `load_token_table` reads it.

Example:
```python
>>> import pandas as pd
>>> from hf_rockopd.lab import load_token_table
>>> frame = pd.DataFrame({"prompt_index": [0, 0], "token_id": [5, 7], "token": ["a", "b"], "divergence": [0.1, 0.9]})
>>> load_token_table(frame, vocab_size=10).mean_divergence()[[5, 7]].tolist()
[0.1, 0.9]
```
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from transformers.utils import logging


logger = logging.get_logger(__name__)

__all__ = [
    "GRAD_COSINE_FILE",
    "TOKEN_TABLE_COLUMNS",
    "TOKEN_TABLE_META",
    "TokenTable",
    "check_same_tokenizer",
    "load_token_table",
    "part_name",
    "part_names",
    "prepare_table_dir",
    "read_parts",
    "write_grad_cosines",
    "write_part",
]

TOKEN_TABLE_COLUMNS = (
    "prompt_index",
    "position",
    "token_id",
    "token",
    "divergence",
    "student_entropy",
    "teacher_entropy",
    "logit_grad_norm",
)
# Parquet schema metadata keys: a table knows the tokenizer and settings that made it, so two tables from different
# tokenizers are never compared by token id.
_META_KEY = b"hf_rockopd"

TOKEN_TABLE_META = "meta.json"
GRAD_COSINE_FILE = "grad_cosine.parquet"


def part_name(index: int) -> str:
    """The file name of a table's `index`-th Parquet part (one per collected batch).

    Example:
    ```python
    >>> part_name(3)
    'part-00003.parquet'
    ```
    """
    return f"part-{index:05d}.parquet"


def part_names(table_dir: str | os.PathLike) -> list[str]:
    """The Parquet parts of a table directory, in order (`[]` when there is none yet).

    Example:
    ```python
    >>> import tempfile
    >>> part_names(tempfile.mkdtemp())
    []
    ```
    """
    if not os.path.isdir(table_dir):
        return []
    return sorted(p for p in os.listdir(table_dir) if p.startswith("part-") and p.endswith(".parquet"))


def _write_atomically(table: pa.Table, path: str) -> None:
    tmp = f"{path}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, path)  # a killed run never leaves a half-written file behind


def _with_meta(table: pa.Table, meta: Mapping[str, Any]) -> pa.Table:
    return table.replace_schema_metadata({_META_KEY: json.dumps(dict(meta)).encode()})


def prepare_table_dir(output_dir: str | os.PathLike, meta: Mapping[str, Any]) -> None:
    """Create a table directory and write its `meta.json`; `ValueError` if it holds a table made with other settings.

    Resuming into a directory collected with other settings would mix two corpora, so that is refused.

    Example:
    ```python
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "table")
    >>> prepare_table_dir(path, {"beta": 1.0}); prepare_table_dir(path, {"beta": 1.0})
    >>> prepare_table_dir(path, {"beta": 0.5})
    Traceback (most recent call last):
    ...
    ValueError: ... collected with other settings {'beta': (1.0, 0.5)} (old, new)...
    ```
    """
    os.makedirs(output_dir, exist_ok=True)
    _check_meta_matches(output_dir, meta)
    with open(os.path.join(output_dir, TOKEN_TABLE_META), "w", encoding="utf-8") as f:
        json.dump(dict(meta), f, indent=2)


def write_part(
    output_dir: str | os.PathLike, index: int, columns: Mapping[str, pa.Array], meta: Mapping[str, Any]
) -> str:
    """Write one Parquet part (`TOKEN_TABLE_COLUMNS`, the collection's `meta` in its schema) atomically; its path.

    A new part makes `grad_cosine.parquet` stale (G_balanced is a corpus-wide sum), so that file is removed first.

    Example:
    ```python
    >>> import pyarrow as pa, tempfile
    >>> table_dir = tempfile.mkdtemp()
    >>> columns = {"prompt_index": pa.array([0]), "position": pa.array([0]), "token_id": pa.array([5]),
    ...            "token": pa.array(["a"]), "divergence": pa.array([0.5], pa.float32())}
    >>> path = write_part(table_dir, 0, columns, {"vocab_size": 10})
    >>> os.path.basename(path), load_token_table(path).vocab_size  # one part carries the metadata too
    ('part-00000.parquet', 10)
    ```
    """
    cosine_path = os.path.join(output_dir, GRAD_COSINE_FILE)
    if os.path.exists(cosine_path):
        os.remove(cosine_path)
    path = os.path.join(output_dir, part_name(index))
    _write_atomically(_with_meta(pa.table(dict(columns)), meta), path)
    return path


def write_grad_cosines(
    table_dir: str | os.PathLike, frames: list[pd.DataFrame], cosines: np.ndarray, info: Mapping[str, Any]
) -> str:
    """Write `grad_cosine.parquet`: one cosine per row of the parts `frames` (in part order), with `info` (which
    must name the `parts` it was computed from) in its schema metadata. `load_token_table` merges it as the
    `grad_cosine` column while it matches the parts. Returns its path.

    Example:
    ```python
    >>> import numpy as np, pandas as pd, tempfile
    >>> frame = pd.DataFrame({"prompt_index": [0], "position": [0]})
    >>> os.path.basename(write_grad_cosines(tempfile.mkdtemp(), [frame], np.array([0.5]), {"parts": []}))
    'grad_cosine.parquet'
    ```
    """
    table = pa.table(
        {
            "prompt_index": pa.array(np.concatenate([f["prompt_index"].to_numpy() for f in frames]), pa.int64()),
            "position": pa.array(np.concatenate([f["position"].to_numpy() for f in frames]), pa.int64()),
            "grad_cosine": pa.array(np.asarray(cosines), pa.float64()),
        }
    )
    path = os.path.join(table_dir, GRAD_COSINE_FILE)
    _write_atomically(_with_meta(table, info), path)
    return path


def read_parts(table_dir: str | os.PathLike) -> tuple[list[str], list[pd.DataFrame]]:
    """`(part names, one DataFrame per part)` of a table directory, in order."""
    parts = part_names(table_dir)
    return parts, [pq.read_table(os.path.join(table_dir, p)).to_pandas() for p in parts]


def _check_meta_matches(output_dir: str | os.PathLike, meta: Mapping[str, Any]) -> None:
    path = os.path.join(output_dir, TOKEN_TABLE_META)
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    changed = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
    if changed:
        raise ValueError(
            f"{output_dir} holds a token table collected with other settings {changed} (old, new). Resuming would mix "
            "them; use a new output directory or delete this one."
        )



@dataclass
class TokenTable:
    """A token table (`frame`, one row per generated token) and the metadata of its collection.

    Example:
    ```python
    >>> import pandas as pd
    >>> table = TokenTable(pd.DataFrame({"token_id": [1, 1, 3], "token": ["a", "a", "c"], "divergence": [0.2, 0.4, 1.0]}))
    >>> table.vocab_size, table.counts().tolist(), table.decode()
    (4, [0.0, 2.0, 0.0, 1.0], {1: 'a', 3: 'c'})
    ```
    """

    frame: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    @property
    def vocab_size(self) -> int:
        if self.meta.get("vocab_size") is not None:
            return int(self.meta["vocab_size"])
        return int(self.frame["token_id"].max()) + 1 if len(self.frame) else 0

    def counts(self) -> np.ndarray:
        """`(V,)` occurrences of each token id."""
        return np.bincount(self.frame["token_id"].to_numpy(), minlength=self.vocab_size).astype(np.float64)

    def divergence_sums(self) -> np.ndarray:
        """`(V,)` total divergence of each token id."""
        ids, divergence = self.frame["token_id"].to_numpy(), self.frame["divergence"].to_numpy(np.float64)
        return np.bincount(ids, weights=divergence, minlength=self.vocab_size)

    def mean_divergence(self) -> np.ndarray:
        """`(V,)` mean divergence of each token id, NaN where never seen."""
        count = self.counts()
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, self.divergence_sums() / np.maximum(count, 1), np.nan)

    def decode(self) -> dict[int, str]:
        """`{token_id: decoded string}` for the ids in the table."""
        first = self.frame.drop_duplicates("token_id")
        return dict(zip(first["token_id"].astype(int), first["token"].astype(str)))


def load_token_table(path: str | os.PathLike | pd.DataFrame, vocab_size: int | None = None) -> TokenTable:
    """Read a token table: a directory written by `collect_token_table`, one Parquet file, or a DataFrame.

    Raises `ValueError` for a missing column, an empty table, non-finite divergences, or ids outside `vocab_size`.

    Example:
    ```python
    >>> import pandas as pd
    >>> from hf_rockopd.lab import load_token_table
    >>> frame = pd.DataFrame({"prompt_index": [0, 0], "position": [0, 1], "token_id": [5, 7], "token": ["a", "b"],
    ...                       "divergence": [0.1, 0.9]})
    >>> load_token_table(frame, vocab_size=10).counts()[[5, 7]].tolist()
    [1.0, 1.0]
    ```
    """
    meta: dict[str, Any] = {}
    if isinstance(path, pd.DataFrame):
        frame, source = path.copy(), "<DataFrame>"
    else:
        source = os.fspath(path)
        if os.path.isdir(source):
            parts = part_names(source)
            if not parts:
                raise ValueError(f"Token table {source} is empty: no Parquet part. Run `collect` first.")
            tables = [pq.read_table(os.path.join(source, p)) for p in parts]
            meta_path = os.path.join(source, TOKEN_TABLE_META)
            if os.path.exists(meta_path):
                with open(meta_path, encoding="utf-8") as f:
                    meta = json.load(f)
            frame = pa.concat_tables(tables).to_pandas()
            cosine_path = os.path.join(source, GRAD_COSINE_FILE)
            if os.path.exists(cosine_path):
                cosine = pq.read_table(cosine_path)
                info = json.loads((cosine.schema.metadata or {}).get(_META_KEY, b"{}"))
                if info.get("parts") == parts and cosine.num_rows == len(frame):
                    # Written part by part in the same order as the parts, so rows align one to one.
                    cosine = cosine.to_pandas()
                    if (cosine["prompt_index"].to_numpy() == frame["prompt_index"].to_numpy()).all() and (
                        cosine["position"].to_numpy() == frame["position"].to_numpy()
                    ).all():
                        frame["grad_cosine"] = cosine["grad_cosine"].to_numpy()
                        meta["g_balanced_norm"] = info.get("g_balanced_norm")
                else:
                    logger.warning(
                        "%s does not match the parts of %s (stale); ignoring it. Rerun `gradient_cosines`.",
                        cosine_path, source,
                    )
        elif os.path.isfile(source):
            table = pq.read_table(source)
            raw = (table.schema.metadata or {}).get(_META_KEY)
            meta = json.loads(raw) if raw else {}
            frame = table.to_pandas()
        else:
            raise FileNotFoundError(f"Token table {source} does not exist. Give a directory written by `collect`.")
    required = ("prompt_index", "token_id", "token", "divergence")
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise ValueError(f"Token table {source} lacks columns {missing}; it has {list(frame.columns)}.")
    if len(frame) == 0:
        raise ValueError(f"Token table {source} is empty (no generated token). Collect on more prompts.")
    if not np.isfinite(frame["divergence"].to_numpy(np.float64)).all():
        raise ValueError(f"Token table {source} has non-finite divergences; it cannot be scored.")
    if vocab_size is not None:
        if meta.get("vocab_size") not in (None, vocab_size):
            raise ValueError(
                f"Token table {source} was collected with a vocabulary of {meta['vocab_size']} ids, not {vocab_size}. "
                "It comes from another tokenizer."
            )
        meta.setdefault("vocab_size", vocab_size)
    ids = frame["token_id"].to_numpy()
    if ids.min() < 0 or (meta.get("vocab_size") is not None and ids.max() >= int(meta["vocab_size"])):
        raise ValueError(
            f"Token table {source} has token ids in [{ids.min()}, {ids.max()}], outside the vocabulary of "
            f"{meta.get('vocab_size')} ids. It comes from another tokenizer."
        )
    return TokenTable(frame=frame.reset_index(drop=True), meta=meta, source=source)


def check_same_tokenizer(a: TokenTable, b: TokenTable) -> None:
    """Raise `ValueError` unless two tables share vocabulary size and decode every common id to the same string.

    Example:
    ```python
    >>> import pandas as pd
    >>> frame = pd.DataFrame({"prompt_index": [0], "token_id": [5], "token": ["a"], "divergence": [0.1]})
    >>> check_same_tokenizer(load_token_table(frame, vocab_size=10), load_token_table(frame, vocab_size=10))
    ```
    """
    if a.vocab_size != b.vocab_size:
        raise ValueError(
            f"Token tables {a.source} ({a.vocab_size} ids) and {b.source} ({b.vocab_size} ids) come from different "
            "tokenizers; their token ids cannot be compared."
        )
    da, db = a.decode(), b.decode()
    differ = [i for i in set(da) & set(db) if da[i] != db[i]]
    if differ:
        i = sorted(differ)[0]
        raise ValueError(
            f"Token tables {a.source} and {b.source} decode {len(differ)} common ids differently (id {i}: {da[i]!r} "
            f"vs {db[i]!r}); they come from different tokenizers."
        )
