"""Inference-only models on CPU through oneDNN: frozen linear layers with their weights prepacked once.

Why: on a CPU, generation is a chain of small-batch products `x @ W.T` (M = batch rows per decode step), and MKL's
small-M path runs them well above the time it takes to read W once (on an AVX2 EPYC, 24 ms at M = 8 for a
8960 x 1536 weight against 4.3 ms at M = 1). oneDNN's matmul on a weight converted to its own layout once
(`Tensor.to_mkldnn`) takes the same product at 2-2.5x less on both AVX2 and AVX-512 hosts
(`benchmarks/decode.py`). The converted weight replaces the dense one, so no model is held twice.

Only weights that never train are packed: the whole teacher, a model loaded just to evaluate or serve, and a LoRA
student's base layers (`pack_frozen_linears`), whose rollouts and evaluation answers are the same small-batch decode.
A packed layer's weight is a buffer, never trained; its input still gets a gradient (through the weight read back
dense for that one product), so the adapters before it train as they did. What reads a weight itself stays dense
(`skip`): the trainers' loss projects the student's rows through a bare `lm_head` and `RockDistillationTrainer` reads
the teacher's head, while the commands that only generate and score (`eval`, the lab, `serve-teacher`) pack the head
too, which matters most for a small model whose head is a third of its bytes (`benchmarks/decode.py`).

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

import bisect
import ctypes
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


__all__ = [
    "PACKING_ENV",
    "PackedLinear",
    "can_pack",
    "dense_named_parameters",
    "pack_for_inference",
    "pack_frozen_linears",
    "packed_for_inference",
    "packing_applies",
    "unpack_linears",
]

PACKING_ENV = "HF_ROCKOPD_PACK_LINEAR"
"""Environment variable: `0` turns packing off everywhere (the MKL path, for comparison or a host where it is slower)."""


class _PackedLinearFunction(torch.autograd.Function):
    """`x @ W.T + b` through oneDNN with a backward for `x` only (the weight is frozen).

    The backward reads the weight back dense for its one product and drops it, so a trained model's frozen layers
    (LoRA's base layers) are not held twice; the read-back costs about 4 ms per 17 MB on 2 cores, under 1 % of a
    training step of the Qwen pair."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.packed, ctx.input_shape = packed, x.shape
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.packed.to_dense()
        grad_input = grad.reshape(-1, grad.shape[-1]).mm(weight).view(ctx.input_shape)
        return grad_input, None, None


class PackedLinear(nn.Module):
    """A frozen `nn.Linear` whose weight lives in oneDNN's layout.

    Its forward is oneDNN's; an input that needs a gradient (a LoRA model in training: later layers' inputs depend on
    earlier adapters) gets one, the weight never does (it is a buffer, not a parameter).

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.models.packing import PackedLinear
    >>> linear = torch.nn.Linear(4, 3).requires_grad_(False)
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> torch.allclose(PackedLinear(linear)(x), linear(x), atol=1e-6)
    True
    >>> PackedLinear(linear)(x).sum().backward(); torch.allclose(x.grad, linear.weight.sum(0).expand(2, 4))
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
        if x.dtype != torch.float32:
            x = x.float()
        if x.requires_grad and torch.is_grad_enabled():
            return _PackedLinearFunction.apply(x, self.packed_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def to_linear(self) -> nn.Linear:
        """The dense, frozen `nn.Linear` this layer came from (same values, exactly)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.packed_weight.to_dense(), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.clone(), requires_grad=False)
        return linear

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


def packing_applies(args) -> bool:
    """Whether a run with these `TrainingArguments` packs its frozen layers: one CPU process only, since DDP
    broadcasts a model's buffers and FSDP/DeepSpeed shard plain tensors, neither of which a packed weight is.

    Example:
    ```python
    >>> from transformers import TrainingArguments
    >>> from hf_rockopd.models import packing_applies
    >>> packing_applies(TrainingArguments(output_dir="out", use_cpu=True, report_to="none"))
    True
    ```
    """
    return args.device.type == "cpu" and not args.fsdp and not args.deepspeed and args.world_size == 1


def _packable_base_layers(model: nn.Module) -> tuple[set[int], set[int]]:
    """(ids of modules inside peft tuner layers, ids of the base layers among them that may be packed).

    A vanilla LoRA layer calls its base layer and reads only its adapters' weights in forward; a variant (DoRA) or a
    merged layer reads the base weight itself, so it keeps it dense."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    inside, bases = set(), set()
    for module in model.modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        inside.update(id(sub) for sub in module.modules())
        base = getattr(module, "base_layer", None)
        plain = not getattr(module, "lora_variant", None) and not getattr(module, "merged", False)
        if base is not None and plain and hasattr(module, "lora_A"):
            bases.add(id(base))
    return inside, bases


def pack_frozen_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace each plain, frozen `nn.Linear` of `model` (no parameter of it requires a gradient) with a
    `PackedLinear`, in place; the model may go on training its other parameters (LoRA adapters).

    What is packed: a LoRA model's base layers and any other frozen linear, except those named in `skip` (by their
    last name: the trainers' loss reads the student's `lm_head` as a bare `nn.Linear`), subclasses (bitsandbytes
    4-bit), an adapter's own layers, and a weight shared with another module (tied), which would then be held twice.
    Returns the number of layers packed (0, and `model` untouched, when `can_pack(model)` is false). Undo with
    `unpack_linears` (before merging adapters, saving a full model, or sharding).

    Example:
    ```python
    >>> from peft import LoraConfig, get_peft_model
    >>> from hf_rockopd.models import build_tiny_causal_lm, pack_frozen_linears
    >>> model = get_peft_model(build_tiny_causal_lm(), LoraConfig(r=2, target_modules="all-linear"))
    >>> pack_frozen_linears(model) == 7 * model.config.num_hidden_layers  # the base layers; adapters still train
    True
    ```
    """
    if not can_pack(model):
        return 0
    counts: dict[int, int] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    inside_tuner, bases = _packable_base_layers(model)
    targets = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or name.split(".")[-1] in skip:
            continue
        if id(module) in inside_tuner and id(module) not in bases:
            continue
        parameters = list(module.parameters(recurse=False))
        if any(p.requires_grad for p in parameters) or any(counts[id(p)] > 1 for p in parameters):
            continue
        targets.append(name)
    if not targets:
        return 0
    pages = _FileMappedPages(model)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = parent.get_submodule(child)
        setattr(parent, child, PackedLinear(linear))
        # The dense weight is dropped here, but transformers loads safetensors through one memory map per file,
        # unmapped only when no tensor of it is left: its pages would stay counted, the model held twice at the peak
        # (+1.7 GB on the Qwen teacher). They are released one weight at a time instead; the embeddings
        # and norms stay in the map, where only the rows a lookup touches take memory.
        pages.release(linear.weight)
    return len(targets)


def pack_for_inference(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Freeze `model` and pack its plain linear layers (`pack_frozen_linears`), for a model that only runs forward.

    Returns the number of layers packed (0, and `model` untouched, when `can_pack(model)` is false).
    """
    if not can_pack(model):
        return 0
    model.requires_grad_(False)
    return pack_frozen_linears(model, skip)


def unpack_linears(model: nn.Module) -> int:
    """Turn every `PackedLinear` of `model` back into the dense, frozen `nn.Linear` it came from; returns how many.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.models import build_tiny_causal_lm, pack_for_inference, unpack_linears
    >>> model = build_tiny_causal_lm()
    >>> packed = pack_for_inference(model)
    >>> unpack_linears(model) == packed, type(model.model.layers[0].mlp.up_proj).__name__
    (True, 'Linear')
    ```
    """
    names = [name for name, module in model.named_modules() if isinstance(module, PackedLinear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, parent.get_submodule(child).to_linear())
    return len(names)


@contextmanager
def packed_for_inference(model: nn.Module, skip: tuple[str, ...] = ()) -> Iterator[int]:
    """`pack_for_inference` for the duration of a block, then the dense layers and each parameter's `requires_grad`
    back: for a model that is evaluated, then trained. Yields the number of layers packed.

    The dense weights come back as new tensors: build an optimizer after the block, not before.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.models import build_tiny_causal_lm, packed_for_inference
    >>> model = build_tiny_causal_lm()
    >>> with packed_for_inference(model) as count, torch.no_grad():
    ...     _ = model(torch.tensor([[1, 2, 3]]))
    >>> count > 0 and all(p.requires_grad for p in model.parameters())
    True
    ```
    """
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    count = pack_for_inference(model, skip)
    try:
        yield count
    finally:
        unpack_linears(model)
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(trainable.get(name, False))


class _FileMappedPages:
    """The process's file-backed memory maps (Linux `/proc/self/maps`), to release a dense weight's pages once it is
    packed.

    `madvise(MADV_DONTNEED)` on whole pages inside the weight's bytes drops them from this process (the file stays in
    the page cache, and a later read would fault the file's content back in): nothing is lost, because the packed
    copy was just made and the dense tensor is being dropped. Only pages of a file mapping, never anonymous memory
    (where it would zero live data); elsewhere than Linux, nothing happens."""

    def __init__(self, model: nn.Module) -> None:
        self.ranges: list[tuple[int, int]] = []
        # Every tensor's bytes: a page another tensor still uses (a tie made of two parameters) is never released.
        self.tensors = [
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), id(t))
            for m in model.modules()
            for t in (*m._parameters.values(), *m._buffers.values())
            if t is not None and not t.is_mkldnn
        ]
        if not sys.platform.startswith("linux"):
            return
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split()
                    if len(fields) >= 6 and fields[5].startswith("/") and fields[1].startswith("r"):
                        low, high = (int(part, 16) for part in fields[0].split("-"))
                        self.ranges.append((low, high))
        except OSError:
            self.ranges = []
        self.ranges.sort()
        self.page = os.sysconf("SC_PAGE_SIZE") if self.ranges else 4096
        self.madvise = ctypes.CDLL(None, use_errno=True).madvise if self.ranges else None

    def mapped(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s bytes lie in a file mapping."""
        start = tensor.data_ptr()
        index = bisect.bisect_right(self.ranges, (start, float("inf"))) - 1
        return index >= 0 and self.ranges[index][0] <= start < self.ranges[index][1]

    def release(self, tensor: torch.Tensor) -> None:
        """Drop the whole pages of `tensor`, unless another tensor uses them."""
        if not tensor.is_contiguous() or not self.mapped(tensor):
            return
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        low = -(-start // self.page) * self.page
        high = end // self.page * self.page
        shared = any(a < high and low < b for a, b, other in self.tensors if other != id(tensor))
        if high > low and not shared:
            self.madvise(ctypes.c_void_p(low), ctypes.c_size_t(high - low), 4)  # 4: MADV_DONTNEED


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
