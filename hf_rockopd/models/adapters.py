"""Saving a LoRA student without the Hub: the question peft asks the Hub, answered from the local copy of its base.

peft's `save_pretrained(save_embedding_layers="auto")` decides whether an adapter holds the full embedding layers by
reading the base model's `config.json` from `base_model_name_or_path`: a local directory, else the Hub. A base named
by a Hub id but loaded from the Hugging Face cache or an offline GGUF copy (`resolve_causal_lm`) makes every save
ask the Hub: without a network it warns "Unable to fetch remote file ...", with `HF_HUB_OFFLINE=1` it skips the
lookup, and either way it then warns "Could not find a config file in ... - will assume that the vocabulary was not
modified". `adapter_embedding_layers` gives peft's answer from the local config, and peft asks no one.

Example:
```python
>>> from peft import LoraConfig, get_peft_model
>>> from hf_rockopd.models import build_tiny_causal_lm
>>> from hf_rockopd.models.adapters import adapter_embedding_layers, local_config_dir
>>> local_config_dir("no-org/no-such-model") is None
True
>>> model = build_tiny_causal_lm()
>>> model.name_or_path = "no-org/no-such-model"  # a Hub id with no local copy: peft's own lookup decides
>>> adapter_embedding_layers(get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))) is None
True
```
"""

from __future__ import annotations

import os
from typing import Any

from .resolve import _looks_like_path, converted_model_dir
from .sources import GGUF_SOURCES


__all__ = ["adapter_embedding_layers", "local_config_dir"]


def local_config_dir(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> str | None:
    """The local directory holding the `config.json` of a model named by path or Hub id, found where
    `resolve_causal_lm` looks (the path, the Hugging Face cache, the converted copy of an offline GGUF), or None.
    Never the network."""
    name = os.path.expanduser(os.fspath(name_or_path))
    if os.path.isfile(os.path.join(name, "config.json")):
        return name
    if _looks_like_path(name):
        return None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json")
    if isinstance(cached, str):  # otherwise None (not cached) or a marker saying the Hub has no such file
        return os.path.dirname(cached)
    if name in GGUF_SOURCES:
        converted = converted_model_dir(name, cache_dir)
        if os.path.isfile(os.path.join(converted, "config.json")):
            return converted
    return None


def adapter_embedding_layers(model: Any) -> bool | None:
    """What peft's `save_embedding_layers="auto"` decides for `model` (a PEFT model), decided here without the Hub;
    None where peft decides without it anyway or where only it can (no local copy of the base: online, it asks the Hub).

    As in peft: embedding layers that are LoRA targets are saved (from the config alone: None here); otherwise they are
    saved only when the vocabulary size differs from the base's, read from the base's local `config.json`.
    """
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    from peft.utils.other import EMBEDDING_LAYER_NAMES

    for config in configs.values():
        targets = getattr(config, "target_modules", None)
        if isinstance(targets, str) and targets != "all-linear":
            return None  # a pattern: peft matches it against the module names
        targeted = bool(targets) and not isinstance(targets, str) and any(n in targets for n in EMBEDDING_LAYER_NAMES)
        peft_type = getattr(config, "peft_type", None)
        trainable_tokens = getattr(peft_type, "value", peft_type) == "TRAINABLE_TOKENS" or (
            getattr(config, "trainable_token_indices", None) is not None
        )
        if targeted and not trainable_tokens:
            return None  # peft saves them, deciding from the config
    bases = {getattr(config, "base_model_name_or_path", None) for config in configs.values()}
    base = bases.pop() if len(bases) == 1 else None
    if not base or os.path.isfile(os.path.join(base, "config.json")):
        return None  # peft reads the local config itself (or, with no base name, assumes no resize): no lookup
    directory = local_config_dir(base)
    if directory is None:
        return None
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    return bool(vocab_size) and vocab_size != type(model.config).from_pretrained(directory).vocab_size
