"""LoRA students on disk without the Hub: saving one (the question peft asks the Hub, answered from the local copy of
its base) and loading a saved adapter folder back as one plain model (`load_merged_adapter`).

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

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from .resolve import (
    ADAPTER_CONFIG_NAME,
    ResolvedModel,
    _looks_like_path,
    converted_model_dir,
    is_adapter_dir,
    resolve_causal_lm,
)
from .sources import GGUF_SOURCES


__all__ = ["ADAPTER_CONFIG_NAME", "adapter_base_name", "adapter_embedding_layers", "is_adapter_dir",
           "load_merged_adapter", "local_config_dir"]


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


def adapter_base_name(path: str | os.PathLike) -> str:
    """The base model an adapter folder names (`base_model_name_or_path` of its `adapter_config.json`).

    Raises `ValueError` when the folder names none: peft then cannot know what the adapter belongs to.
    """
    config_path = os.path.join(os.path.expanduser(os.fspath(path)), ADAPTER_CONFIG_NAME)
    with open(config_path) as handle:
        base = json.load(handle).get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"{config_path} names no base model (base_model_name_or_path is {base!r}). Set it to the Hub id or path "
            "of the model the adapter was trained on."
        )
    return base


def load_merged_adapter(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    kept_layers: Sequence[int] | None = None,
    cache_dir: str | os.PathLike | None = None,
    with_tokenizer: bool = True,
) -> ResolvedModel:
    """A saved LoRA adapter folder as one plain model: its base found as `resolve_causal_lm` finds any model (offline
    first), cut to `kept_layers` when the adapter was trained on a layer-pruned copy, the adapter loaded and merged.

    Merging gives the same outputs as the adapter on its base (to float rounding) and a model every evaluation and
    generation path runs as it runs any other. An adapter trained on a 4-bit base merges into the full-precision base:
    the model the card's loading example builds. The adapter file's weights must be exactly those of the base's adapted
    modules. Nothing in peft's files says that the adapter of a layer-pruned student belongs to a pruned base (its
    target modules are "layers.0", "layers.1", ...): without `kept_layers` it would adapt the wrong layers of the
    full base, so the commands read them from the run's `run_report.json`.

    Args:
        path: the adapter folder (`adapter_config.json`, `adapter_model.safetensors`; `save_pretrained` of a
            `PeftModel`, or `hf-rockopd distill --use_peft`'s output directory).
        dtype: dtype of the loaded base and merged weights.
        kept_layers: the base's decoder layers the adapter's model kept (`run_report.json`'s `student.kept_layers`),
            or None for an unpruned base.
        cache_dir: where a converted offline GGUF base is kept.
        with_tokenizer: also load a tokenizer: the folder's own if it holds one, else the base's.

    Raises:
        ValueError: the folder names no base, or the adapter's weights and the (pruned) base's adapted modules differ.

    Example:
    ```python
    from hf_rockopd.models.adapters import load_merged_adapter
    # `hf-rockopd distill --use_peft` output of a student that kept layers [0, 1, 2, 3, 20, 21, 22, 23] of its base
    student = load_merged_adapter("runs/qwen-long/uniform", kept_layers=[0, 1, 2, 3, 20, 21, 22, 23]).model
    ```
    """
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from .pruning import prune_decoder_layers

    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    base_name = adapter_base_name(path)
    own_tokenizer = os.path.isfile(os.path.join(path, "tokenizer_config.json"))
    base = resolve_causal_lm(base_name, dtype=dtype, cache_dir=cache_dir,
                             with_tokenizer=with_tokenizer and not own_tokenizer)
    model = prune_decoder_layers(base.model, kept_layers) if kept_layers else base.model
    peft_model = PeftModel.from_pretrained(model, path)
    weights = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(weights):
        saved, expected = set(load_file(weights)), set(get_peft_model_state_dict(peft_model))
        if saved != expected:
            # Both ways: an adapter of a 2-layer pruned student fits layers 0-1 of a 4-layer base without an extra key,
            # but leaves layers 2-3 without theirs.
            odd = sorted(saved ^ expected)
            raise ValueError(
                f"The adapter in {path} does not fit its base {base_name!r}"
                f"{f' cut to layers {list(kept_layers)}' if kept_layers else ''}: "
                f"{len(saved - expected)} of its weights match no module, {len(expected - saved)} adapted modules have "
                f"no weights in it (first: {odd[0]}). Load it onto the model it was trained on: for a layer-pruned "
                "student, pass the kept layers (run_report.json's student.kept_layers)."
            )
    merged = peft_model.merge_and_unload()
    tokenizer = None
    if with_tokenizer:
        if own_tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
        else:
            tokenizer = base.tokenizer
    return ResolvedModel(merged, tokenizer, "adapter", path)
