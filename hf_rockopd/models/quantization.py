"""bitsandbytes 4-bit layers on CPU: undo the inference packing that would silently stop LoRA gradients."""

from __future__ import annotations

import torch


__all__ = ["unpack_cpu_4bit_weights"]


def unpack_cpu_4bit_weights(model: torch.nn.Module) -> int:
    """Undo bitsandbytes' CPU inference packing of 4-bit weights; return the number of layers restored.

    On CPUs with AVX-512 BF16, bitsandbytes repacks a `Linear4bit` weight for fast inference the first time the layer
    runs in eval mode without gradients (generation, evaluation) and never packs it back. A LoRA adapter on such a
    layer then silently receives no gradient. Calling this before a training forward restores the trainable layout.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm, unpack_cpu_4bit_weights
    >>> unpack_cpu_4bit_weights(build_tiny_causal_lm())  # nothing quantized, nothing to do
    0
    ```
    """
    try:
        from bitsandbytes.nn import Linear4bit
        from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse
    except ImportError:  # bitsandbytes missing, or a version without CPU packing
        return 0
    restored = 0
    for module in model.modules():
        if not isinstance(module, Linear4bit):
            continue
        state = getattr(module.weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu_inverse(
                module.weight.data, state
            )
            restored += 1
    return restored
