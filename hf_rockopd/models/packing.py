"""Inference-only models on CPU through oneDNN: frozen linear layers with their weights prepacked once.

Why: on a CPU, generation is a chain of small-batch products `x @ W.T` (M = batch rows per decode step), and MKL's
small-M path runs them well above the time it takes to read W once (issue 29: on an AVX2 EPYC, 24 ms at M = 8 for a
8960 x 1536 weight against 4.3 ms at M = 1). oneDNN's matmul on a weight converted to its own layout once
(`Tensor.to_mkldnn`) takes the same product at 2-2.5x less on both AVX2 and AVX-512 hosts
(`benchmarks/decode.py`). The converted weight replaces the dense one, so no model is held twice.

Only weights that never train may be packed: the whole teacher, a model loaded just to evaluate or serve. The packed
layer has no backward, so it refuses an input that needs a gradient rather than return one silently wrong. A
trainer's teacher keeps its output head dense (`skip`): the trainers read the head's weight (its device; FSDP2
gathers it), while the commands that only generate and score (`eval`, the lab, `serve-teacher`) pack it too, which
matters most for a small model whose head is a third of its bytes (`benchmarks/decode.py`).

Example:
```python
>>> import torch
>>> from hf_rockopd.models import build_tiny_causal_lm, pack_for_inference
>>> model = build_tiny_causal_lm()
>>> ids = torch.tensor([[1, 2, 3]])
>>> with torch.no_grad():
...     dense = model(ids).logits
>>> pack_for_inference(model) > 0
True
>>> with torch.no_grad():
...     torch.allclose(model(ids).logits, dense, atol=1e-5)
True
```
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch import nn


__all__ = ["PACKING_ENV", "PackedLinear", "can_pack", "dense_named_parameters", "pack_for_inference"]

PACKING_ENV = "HF_ROCKOPD_PACK_LINEAR"
"""Environment variable: `0` turns packing off everywhere (the MKL path, for comparison or a host where it is slower)."""


class PackedLinear(nn.Module):
    """A frozen `nn.Linear` whose weight lives in oneDNN's layout; forward only.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.models.packing import PackedLinear
    >>> linear = torch.nn.Linear(4, 3)
    >>> x = torch.randn(2, 4)
    >>> torch.allclose(PackedLinear(linear)(x), linear(x).detach(), atol=1e-6)
    True
    ```
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Buffers, not parameters: nothing may train them, and `model.parameters()` then lists only trainable-kind
        # tensors. The dense weight is dropped by the caller when this module replaces the linear.
        self.register_buffer("packed_weight", linear.weight.detach().to_mkldnn(), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(
                "A packed (inference-only) linear layer got an input that needs a gradient. Packing is for frozen "
                "models that only run forward (the teacher, an evaluated model); do not pack a model you train."
            )
        if x.dtype != torch.float32:
            x = x.float()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(model: nn.Module) -> bool:
    """Whether `pack_for_inference` would change `model`: on CPU, float32, oneDNN built in, and not turned off by
    `HF_ROCKOPD_PACK_LINEAR=0`.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm, can_pack
    >>> can_pack(build_tiny_causal_lm().bfloat16())
    False
    ```
    """
    if os.environ.get(PACKING_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = next(model.parameters())
    except StopIteration:
        return False
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def pack_for_inference(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Freeze `model` and replace each plain `nn.Linear` (not those named in `skip`) with a `PackedLinear`, in place.

    For a model that will only ever run forward. Returns the number of layers packed (0, and `model` untouched, when
    `can_pack(model)` is false). Subclasses of `nn.Linear` (bitsandbytes 4-bit) and everything inside a peft LoRA
    layer are left alone; so is a weight shared with another module (tied), which would otherwise be held twice.
    """
    if not can_pack(model):
        return 0
    counts: dict[int, int] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    # peft's LoRA layers read their base layer's and adapters' `.weight` in forward: leave everything inside them.
    from peft.tuners.tuners_utils import BaseTunerLayer

    inside_tuner = {id(sub) for m in model.modules() if isinstance(m, BaseTunerLayer) for sub in m.modules()}
    targets = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or name.split(".")[-1] in skip or id(module) in inside_tuner:
            continue
        if counts[id(module.weight)] == 1:
            targets.append(name)
    model.requires_grad_(False)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(parent.get_submodule(child)))
    if targets:
        # transformers loads safetensors through one memory map per file, released only when no tensor of it is
        # left: packing read every dense weight into that map's pages, and the embeddings and norms still hold it.
        # Owning copies of the rest let the map (and the dense weights' pages) go, so the packed model takes what
        # the dense one took, not both (measured on SmolLM2: 1.40 GB RSS packed with the map, 1.10 without).
        for module in model.modules():
            for tensors in (module._parameters, module._buffers):
                for key, tensor in tensors.items():
                    if tensor is not None and not tensor.is_mkldnn:
                        tensor.data = tensor.data.clone()
    return len(targets)


def dense_named_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`model.named_parameters()` as the model had them before `pack_for_inference`: same names, order and values
    (a packed weight is read back to dense, one layer at a time), so a fingerprint of a model does not depend on
    whether it was packed.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm, dense_named_parameters, pack_for_inference
    >>> model = build_tiny_causal_lm()
    >>> before = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    >>> _ = pack_for_inference(model)
    >>> after = list(dense_named_parameters(model))
    >>> [n for n, _ in after] == [n for n, _ in before] and all(a.equal(b) for (_, a), (_, b) in zip(after, before))
    True
    ```
    """
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, PackedLinear):
            yield f"{dot}weight", module.packed_weight.to_dense()
            if module.bias is not None:
                yield f"{dot}bias", module.bias
            continue
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) not in seen:
                seen.add(id(parameter))
                yield f"{dot}{name}", parameter
