"""Layer-pruned students: a copy of a teacher without some decoder layers, and which layers to keep."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel


__all__ = ["middle_block_layers", "prune_decoder_layers"]


def prune_decoder_layers(model: PreTrainedModel, keep: Sequence[int]) -> PreTrainedModel:
    """A copy of `model` that keeps only the decoder layers `keep` (in order), sharing nothing with the original.

    The usual way to make a student from a teacher: same tokenizer and head, fewer layers.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm, prune_decoder_layers
    >>> teacher = build_tiny_causal_lm(num_hidden_layers=4)
    >>> prune_decoder_layers(teacher, keep=[0, 3]).config.num_hidden_layers
    2
    ```
    """
    layers = model.get_decoder().layers
    keep = list(keep)
    if not keep or any(not 0 <= i < len(layers) for i in keep) or len(set(keep)) != len(keep):
        raise ValueError(f"keep must list distinct layer indices in [0, {len(layers)}), got {keep}.")
    student = copy.deepcopy(model)
    decoder = student.get_decoder()
    decoder.layers = torch.nn.ModuleList([decoder.layers[i] for i in keep])
    for new_index, layer in enumerate(decoder.layers):
        if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = new_index
    student.config.num_hidden_layers = len(keep)
    if getattr(student.config, "layer_types", None) is not None:
        student.config.layer_types = [student.config.layer_types[i] for i in keep]
    return student


def middle_block_layers(num_layers: int, keep: int) -> list[int]:
    """The decoder layers a pruned student keeps: all but one contiguous block of `num_layers - keep` layers, taken
    from just before the middle of the stack.

    The first layers build token features and the last ones feed the head, so both are kept. On SmolLM2-135M-Instruct
    (30 layers, 8 GSM8K solutions, reverse KL to the full model per token) keeping 24 layers this way (dropping 14-19)
    gave a divergence of 2.58 nats, against 4.68 for 24 evenly spaced layers, 9.40 for dropping 20-25 and 14.6 for
    dropping 22-27: the copy starts closer to the teacher and distillation has a working model to correct.

    Example:
    ```python
    >>> from hf_rockopd.models import middle_block_layers
    >>> middle_block_layers(30, 24) == [*range(14), *range(20, 30)]
    True
    ```
    """
    if not 1 <= keep <= num_layers:
        raise ValueError(f"keep must be in [1, {num_layers}] (the model has {num_layers} layers), got {keep}.")
    drop = num_layers - keep
    start = max(0, min(num_layers // 2 - 1, num_layers - 1 - drop))
    return [i for i in range(num_layers) if not start <= i < start + drop]
