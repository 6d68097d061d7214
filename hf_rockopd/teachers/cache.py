"""The offline teacher cache: a teacher's top-k log-probabilities of fixed token sequences, stored once, read back as
a teacher source.

Fixed sequences are the ones a teacher would be asked about again and again: the teacher's own reference completions
of the evaluation problems (scored before and after training, in every run of an ablation) and a dataset's own
completions (the off-policy batches of `lmbda < 1`). Scored once, by a local model or a server, they need no teacher
afterwards: `hf-rockopd eval --teacher_cache` measures the teacher-forced divergence without a teacher in memory, and
a trainer given `teacher_cache` reads its fixed batches from it (a rollout the cache cannot know goes to the served
teacher, or is an error naming the step).

Building one is resumable: each finished batch is also written to `<path>.parts/` (small caches of the same format),
so a build killed after an hour goes on at the batch it was in; the parts go once the whole file is written.

The file is Parquet (one owner: this module). One row per sequence: `key` (sha256 of the settings and the token
ids), `length` (its tokens), and the packed targets flattened (`topk_ids`, `topk_logprobs`, `length * (top_k + 1)`
values each; row `i` is the distribution of token `i` given the tokens before it, padding at position 0). The settings
(`CacheSettings`: teacher, top-k, temperature, vocabulary size) are in the file's metadata and in every key, so a
cache made with other settings is refused by name, never silently reused.

Example:
```python
>>> import tempfile, torch
>>> from hf_rockopd.models import build_tiny_causal_lm
>>> from hf_rockopd.teachers import CacheSettings, CachedTeacher, ModelTopKTeacher, TeacherCache
>>> teacher = build_tiny_causal_lm()
>>> settings = CacheSettings(teacher="tiny", top_k=4, vocab_size=teacher.config.vocab_size)
>>> path = tempfile.mkdtemp() + "/cache.parquet"
>>> cache = TeacherCache.build(ModelTopKTeacher(teacher, top_k=4), [[5, 6, 7], [8, 9]], settings, path)
>>> source = CachedTeacher(TeacherCache.load(path, top_k=4, teacher="tiny"))
>>> ids = torch.tensor([[5, 6, 7]])
>>> torch.allclose(source.targets(ids, torch.ones_like(ids), step=0),
...                ModelTopKTeacher(teacher, top_k=4).targets(ids, torch.ones_like(ids), step=0), atol=1e-5)
True
```
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.utils import logging

from ..losses import pack_topk, unpack_topk
from .sources import ServedTeacher, TopKTeacher, connect_served_teacher, empty_targets

logger = logging.get_logger(__name__)


__all__ = ["CACHE_FORMAT", "CacheSettings", "CachedTeacher", "TeacherCache", "connect_teacher_source"]

CACHE_FORMAT = "hf_rockopd.teacher_cache/1"
_METADATA_KEY = b"hf_rockopd"


@dataclass(frozen=True)
class CacheSettings:
    """What a cached answer depends on; a cache is only read under the settings it was made with.

    Parameters:
        teacher (`str`): the teacher's name (Hub id, path, or the model name a server reports).
        top_k (`int`): log-probabilities kept per position (plus the sequence's own token, as vLLM lists it).
        vocab_size (`int`, *optional*): the teacher's vocabulary size when known (a local model; vLLM's API does not
            say it). Whatever it is, the cached ids are checked against the student's vocabulary.
        temperature (`float`, defaults to `1.0`): the teacher's softmax temperature (a served teacher's is 1).
        teacher_fingerprint (`str`, *optional*): a fingerprint of the teacher's weights when it was a local model
            (`hf_rockopd.evaluation.teacher_reference.model_fingerprint`); compared only when both sides have one.

    Example:
    ```python
    >>> from hf_rockopd.teachers import CacheSettings
    >>> CacheSettings(teacher="t", top_k=4, vocab_size=100).mismatches(teacher="t", top_k=8)
    ['top_k: the cache has 4, asked for 8']
    ```
    """

    teacher: str
    top_k: int
    vocab_size: int | None = None
    temperature: float = 1.0
    teacher_fingerprint: str | None = field(default=None, compare=False)

    def __post_init__(self):
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {self.top_k!r}.")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < 1):
            raise ValueError(f"vocab_size must be a positive integer, got {self.vocab_size!r}.")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}.")

    def key_prefix(self) -> bytes:
        """The part of every sequence key that names these settings (not the weights' fingerprint: see above)."""
        fields = {"teacher": self.teacher, "top_k": self.top_k, "vocab_size": self.vocab_size,
                  "temperature": float(self.temperature), "format": CACHE_FORMAT}  # fmt: skip
        return json.dumps(fields, sort_keys=True).encode("utf-8")

    def mismatches(self, **expected: Any) -> list[str]:
        """`field: the cache has X, asked for Y` for every given setting (`teacher=`, `top_k=`, ...) that differs; a
        setting given as None is not compared (the reader does not know it)."""
        found = []
        for name, want in expected.items():
            have = getattr(self, name)
            if want is None or have is None or have == want:
                continue
            if name == "teacher_fingerprint":
                found.append("teacher_fingerprint: the cache was made from other weights of this teacher")
            else:
                found.append(f"{name}: the cache has {have!r}, asked for {want!r}")
        return found


def sequence_key(settings: CacheSettings, token_ids: Sequence[int]) -> str:
    """sha256 of the settings and the token ids: the row key of a sequence."""
    digest = hashlib.sha256(settings.key_prefix())
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.hexdigest()


class TeacherCache:
    """Cached top-k targets of token sequences (see the module docstring). Build with [`TeacherCache.build`], read
    with [`TeacherCache.load`]; [`CachedTeacher`] makes one a teacher source."""

    def __init__(self, settings: CacheSettings, entries: dict[str, torch.Tensor], path: str | None = None):
        self.settings, self.entries, self.path = settings, entries, path

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, token_ids: Sequence[int]) -> torch.Tensor | None:
        """Packed `(len(token_ids), 2, top_k + 1)` targets of the sequence, or None when it is not cached."""
        return self.entries.get(sequence_key(self.settings, token_ids))

    @classmethod
    def build(
        cls,
        source: TopKTeacher,
        sequences: Sequence[Sequence[int]],
        settings: CacheSettings,
        path: str | os.PathLike,
        batch_size: int = 8,
        show_progress: bool = False,
    ) -> TeacherCache:
        """Score `sequences` with `source` (a local `ModelTopKTeacher` or a `ServedTeacher`, at `settings.top_k`),
        `batch_size` at a time, and write the cache to `path` (Parquet). Returns the cache.

        Each finished batch is kept in `<path>.parts/` until the whole file is written: a build that was stopped
        goes on at its batch when called again with the same settings (parts made with other settings or teacher
        weights are discarded)."""
        from tqdm.auto import tqdm

        if source.top_k != settings.top_k:
            raise ValueError(f"The source answers top-{source.top_k}, the settings say top_k={settings.top_k}.")
        parts = f"{os.fspath(path)}.parts"
        entries = cls._read_parts(parts, settings)
        unique = list({sequence_key(settings, s): list(s) for s in sequences if len(s) > 1}.items())
        starts = range(0, len(unique), batch_size)
        done = {start for start in starts if all(key in entries for key, _ in unique[start : start + batch_size])}
        label = "teacher cache" + (f" ({len(done)} batch{'es' if len(done) > 1 else ''} resumed from {parts})"
                                   if done else "")
        for start in tqdm(starts, desc=label, disable=not show_progress):
            if start in done:
                continue
            chunk = unique[start : start + batch_size]
            length = max(len(ids) for _, ids in chunk)
            input_ids = torch.zeros(len(chunk), length, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for row, (_, ids) in enumerate(chunk):  # right padding: a sequence's positions are its own
                input_ids[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
            targets = source.targets(input_ids, mask, step=start // batch_size).cpu()
            batch = {key: targets[row, : len(ids)].clone() for row, (key, ids) in enumerate(chunk)}
            part = os.path.join(parts, f"batch-{start:07d}.parquet")
            cls(settings, batch).save(part + ".tmp")
            os.replace(part + ".tmp", part)  # a part is whole or absent, never half written
            entries.update(batch)
        wanted = {key for key, _ in unique}
        cache = cls(settings, {key: value for key, value in entries.items() if key in wanted}, str(path))
        cache.save(path)
        shutil.rmtree(parts, ignore_errors=True)
        return cache

    @classmethod
    def _read_parts(cls, parts: str, settings: CacheSettings) -> dict[str, torch.Tensor]:
        """The entries of a stopped build's finished batches; none (and the folder removed) when any part was made
        with other settings or weights, or cannot be read."""
        if not os.path.isdir(parts):
            return {}
        expected = {name: getattr(settings, name) for name in
                    ("teacher", "top_k", "vocab_size", "temperature", "teacher_fingerprint")}
        entries: dict[str, torch.Tensor] = {}
        for name in sorted(os.listdir(parts)):
            if not name.endswith(".parquet"):
                continue  # a part being written when the build was stopped
            try:
                entries.update(cls.load(os.path.join(parts, name), **expected).entries)
            except (ValueError, OSError) as err:
                logger.warning(f"The teacher cache's parts in {parts} cannot be reused ({err}); starting afresh.")
                shutil.rmtree(parts, ignore_errors=True)
                return {}
        return entries

    def save(self, path: str | os.PathLike) -> str:
        """Write the cache as Parquet (settings in the file's metadata). Returns the path."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        keys = list(self.entries)
        flat_ids, flat_lp = [], []
        for key in keys:
            ids, lp = unpack_topk(self.entries[key])
            flat_ids.append(ids.reshape(-1).to(torch.int32).numpy())
            flat_lp.append(lp.reshape(-1).to(torch.float32).numpy())
        table = pa.table(
            {
                "key": pa.array(keys, pa.string()),
                "length": pa.array([int(self.entries[k].shape[0]) for k in keys], pa.int32()),
                "topk_ids": pa.array(flat_ids, pa.list_(pa.int32())),
                "topk_logprobs": pa.array(flat_lp, pa.list_(pa.float32())),
            }
        )
        meta = {"format": CACHE_FORMAT, "settings": asdict(self.settings)}
        table = table.replace_schema_metadata({_METADATA_KEY: json.dumps(meta).encode("utf-8")})
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        pq.write_table(table, str(path))
        return str(path)

    @classmethod
    def read_settings(cls, path: str | os.PathLike) -> CacheSettings:
        """The settings a cache file was made with (its metadata only; the rows are not read)."""
        import pyarrow.parquet as pq

        if not os.path.isfile(path):
            raise FileNotFoundError(f"No teacher cache at {str(path)!r}. Make one with `hf-rockopd teacher-cache`.")
        try:
            raw = (pq.read_schema(str(path)).metadata or {}).get(_METADATA_KEY)
        except Exception as err:  # pyarrow raises its own error types for a file that is not Parquet
            raise ValueError(f"{str(path)!r} is not a teacher cache (not a Parquet file: {err}).") from None
        meta = json.loads(raw) if raw else {}
        if meta.get("format") != CACHE_FORMAT:
            raise ValueError(
                f"{str(path)!r} is not a teacher cache of this version (format {meta.get('format')!r}, expected "
                f"{CACHE_FORMAT!r}). Rebuild it with `hf-rockopd teacher-cache`."
            )
        return CacheSettings(**meta["settings"])

    @classmethod
    def load(cls, path: str | os.PathLike, **expected: Any) -> TeacherCache:
        """Read a cache, refusing (a `ValueError` naming each difference) one made with settings other than the given
        `expected` ones (`teacher=`, `top_k=`, `vocab_size=`, `temperature=`, `teacher_fingerprint=`; None: not
        known, not compared)."""
        import pyarrow.parquet as pq

        settings = cls.read_settings(path)
        problems = settings.mismatches(**expected)
        if problems:
            raise ValueError(
                f"The teacher cache {str(path)!r} was made with other settings ({'; '.join(problems)}); it is never "
                "reused under different ones. Rebuild it with `hf-rockopd teacher-cache` for these settings."
            )
        table = pq.read_table(str(path)).to_pydict()
        width = settings.top_k + 1
        entries = {}
        for key, length, ids, lp in zip(table["key"], table["length"], table["topk_ids"], table["topk_logprobs"]):
            entries[key] = pack_topk(
                torch.tensor(ids, dtype=torch.long).view(length, width),
                torch.tensor(lp, dtype=torch.float32).view(length, width),
            )
        return cls(settings, entries, str(path))


class CachedTeacher:
    """A [`TeacherCache`] as a teacher source; sequences it does not hold go to `fallback` (a served teacher), or are
    an error naming the step and the cache.

    Args:
        cache: the loaded cache.
        fallback: the source asked for the rest (a rollout is new text: only a live teacher can score it).
    """

    def __init__(self, cache: TeacherCache, fallback: TopKTeacher | None = None):
        if fallback is not None and fallback.top_k != cache.settings.top_k:
            raise ValueError(
                f"The teacher cache {cache.path!r} holds top-{cache.settings.top_k}, the served teacher answers "
                f"top-{fallback.top_k}; one loss needs one k."
            )
        self.cache, self.fallback, self.top_k = cache, fallback, cache.settings.top_k
        self.source = f"cache {cache.path} ({cache.settings.teacher})" + (f" + {fallback.source}" if fallback else "")
        self.hits = self.misses = 0

    def check_vocabulary(self, vocab: int, tokenizer: Any = None) -> None:
        largest = max((int(unpack_topk(t)[0].max()) for t in self.cache.entries.values()), default=-1)
        if largest >= vocab:
            raise ValueError(
                f"The teacher cache {self.cache.path!r} lists token id {largest}; the student's vocabulary has {vocab} "
                "ids. The cache was made by a teacher of another tokenizer."
            )
        if self.fallback is not None:
            self.fallback.check_vocabulary(vocab, tokenizer)

    def targets(self, input_ids, attention_mask, *, step: int, needed=None, routing=None) -> torch.Tensor:
        batch, length = input_ids.shape
        out = empty_targets(batch, length, self.top_k + 1, input_ids.device)
        valid = attention_mask.bool()
        wanted = valid if needed is None else valid & needed
        missing = []
        for b in range(batch):
            if not wanted[b].any():
                continue
            found = self.cache.lookup(input_ids[b][valid[b]].tolist())
            if found is None:
                missing.append(b)
            else:
                out[b, valid[b]] = found.to(out.device)
        self.hits += batch - len(missing)
        self.misses += len(missing)
        if missing and self.fallback is None:
            raise ValueError(
                f"Step {step}: {len(missing)} of the batch's {batch} sequences are not in the teacher cache "
                f"{self.cache.path!r} (first: row {missing[0]}, {int(valid[missing[0]].sum())} tokens). A cache holds "
                "fixed sequences only; new text (the student's rollouts) needs a live teacher: set "
                "teacher_server_url as well."
            )
        if missing:
            rows = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
            rows[missing] = True
            asked = wanted & rows[:, None]
            served = self.fallback.targets(input_ids, attention_mask, step=step, needed=asked, routing=routing)
            out[rows] = served[rows].to(out.device)
        return out


def connect_teacher_source(args: Any, tokenizer: Any = None) -> TopKTeacher | None:
    """A trainer config's teacher outside its memory: the served teacher(s) of `teacher_server_url`, read through
    `teacher_cache` first when that is set; None when neither is (the teacher is a model in process).

    The cache is refused when its teacher is not the server's model (by name), or its top-k and temperature are not
    the config's (checked by the config already, before any model loads).
    """
    served = connect_served_teacher(args, tokenizer) if args.teacher_server_url is not None else None
    if args.teacher_cache is None:
        return served
    name = served.client.model if isinstance(served, ServedTeacher) else None
    cache = TeacherCache.load(
        args.teacher_cache, top_k=args.teacher_top_k, temperature=args.loss_temperature, teacher=name
    )
    return CachedTeacher(cache, fallback=served)
