"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the engine: the teacher sharded like the student, and the output
heads gathered once per micro-batch for the chunked projection of the weighted rows.

Why this exists: under FSDP, accelerate prepares the teacher with `prepare_model(evaluation_mode=True)`, which does not
shard it, so TRL's `GKDTrainer` leaves a full teacher on every rank (on another device than the student: TRL issue
2580, https://github.com/huggingface/trl/issues/2580). [`shard_teacher`] shards it per decoder layer and at the root,
parameters resharded after every forward, with no gradients and no optimizer state, so its memory per rank falls
with the number of ranks.

The engine projects only the weighted rows through the heads, outside the models' own forward, `loss_chunk_size`
rows at a time. Calling an FSDP-managed head module per chunk would run FSDP's hooks per chunk (an all-gather each
time, and backward hooks fired inside the loss's forward pass), so [`gathered_heads`] hands the loss hook-free bare
`nn.Linear` heads instead:

- a head whose FSDP group is unsharded at that moment (the student's: accelerate keeps the final norm and `lm_head`
  unsharded after forward) shares its unsharded parameters: the loss's hand-written head gradient accumulates into
  them and FSDP reduce-scatters it with the rest of the group;
- a head whose group is sharded (the teacher's, resharded after its forward) is all-gathered once (`full_tensor`); a
  trainable one gets its gradient reduce-scattered into the sharded parameter's `.grad` (averaged over ranks, as FSDP
  averages) by a hook on the gathered copy.

Example:
```python
>>> from hf_rockopd.engine.sharding import is_fsdp2
>>> from hf_rockopd.models import build_tiny_causal_lm
>>> is_fsdp2(build_tiny_causal_lm())  # a plain module: nothing is sharded
False
```
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..models.introspection import backbone, logits_fn

__all__ = [
    "check_fsdp_accelerator",
    "check_fsdp_setup",
    "fsdp_mesh",
    "fsdp_requested",
    "gathered_heads",
    "is_fsdp2",
    "shard_teacher",
]


def _fsdp_module_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def is_fsdp2(model: nn.Module) -> bool:
    """Whether any submodule of `model` (or `model` itself) is sharded with FSDP2's `fully_shard`.

    Example: see the module docstring.
    """
    fsdp_module = _fsdp_module_type()
    return fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules())


def fsdp_mesh(accelerator: Any):
    """The device mesh accelerate shards the student on: its `torch_device_mesh` restricted to the FSDP dimensions, or
    `None` (then `fully_shard` uses its default 1-D mesh over all processes, as accelerate does)."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None:
        return None
    names = tuple(accelerator.parallelism_config.fsdp_dim_names)
    return mesh[names] if names else None


def fsdp_requested(args: Any) -> bool:
    """Whether the run asks for FSDP: the Trainer's `fsdp`/`fsdp_config`, or `accelerate launch --use_fsdp`.

    Example:
    ```python
    >>> from types import SimpleNamespace
    >>> from hf_rockopd.engine.sharding import fsdp_requested
    >>> fsdp_requested(SimpleNamespace(fsdp=""))
    False
    ```
    """
    return bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def _fsdp_settings(args: Any) -> dict[str, Any]:
    """The FSDP plugin settings of a run: the Trainer's (`fsdp_config`, processed into `fsdp_plugin_args`) or the
    environment `accelerate launch` sets (accelerate's own default version is 1)."""
    settings = dict(getattr(args, "fsdp_plugin_args", None) or {})
    if "fsdp_version" not in settings:
        settings["fsdp_version"] = os.environ.get("FSDP_VERSION", "1")
    for key, env in (("cpu_offload", "FSDP_OFFLOAD_PARAMS"), ("activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING")):
        settings.setdefault(key, os.environ.get(env, "false").lower() == "true")
    if "reshard_after_forward" not in settings:
        settings["reshard_after_forward"] = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() != "false"
    return settings


def check_fsdp_setup(args: Any, trainer_name: str = "RockOPDTrainer") -> None:
    """Before any model loads: refuse FSDP1 and the FSDP2 options that have not been run (see the distributed
    matrix, docs/distributed.md). Nothing to check without FSDP.

    Example:
    ```python
    >>> from types import SimpleNamespace
    >>> from hf_rockopd.engine.sharding import check_fsdp_setup
    >>> check_fsdp_setup(SimpleNamespace(fsdp="", fsdp_plugin_args=None))
    ```
    """
    if not fsdp_requested(args):
        return
    settings = _fsdp_settings(args)
    if str(settings["fsdp_version"]) != "2":
        # FSDP1 flattens each wrapped module's parameters into one FlatParameter: the output heads cannot be
        # called on the weighted rows alone outside the wrapped forward. FSDP2 keeps per-parameter DTensors.
        raise ValueError(
            f"{trainer_name} supports FSDP2 only, and this run asks for FSDP version {settings['fsdp_version']}. "
            'Set fsdp_config={"version": 2} in the config (or `accelerate launch --use_fsdp --fsdp_version 2`); '
            "FSDP1 is deprecated in transformers and accelerate too."
        )
    untested = [
        name
        for name, bad in (
            ("cpu_offload", bool(settings["cpu_offload"])),
            ("activation_checkpointing", bool(settings["activation_checkpointing"])),
            ("reshard_after_forward=False", not settings["reshard_after_forward"]),
        )
        if bad
    ]
    if untested:
        raise ValueError(
            f"{trainer_name} under FSDP2 has been run with full sharding only (reshard_after_forward=True, no "
            f"offload, no FSDP activation checkpointing); this run sets {', '.join(untested)}. Remove it from "
            "fsdp_config (see the distributed matrix, docs/distributed.md)."
        )


def check_fsdp_accelerator(args: Any, accelerator: Any, trainer_name: str = "RockOPDTrainer") -> None:
    """Once accelerate is set up: an FSDP run must really be FSDP2 with one data-parallel mesh dimension.

    accelerate turns FSDP on only for GPU-like devices: on CPU it silently runs the processes as DDP (checked with
    accelerate 1.16), which is not what the config says, so that is refused too.

    Example:
    ```python
    >>> from types import SimpleNamespace
    >>> from hf_rockopd.engine.sharding import check_fsdp_accelerator
    >>> check_fsdp_accelerator(SimpleNamespace(fsdp=""), accelerator=None)  # no FSDP asked for: nothing to check
    ```
    """
    if not fsdp_requested(args):
        return
    if not getattr(accelerator, "is_fsdp2", False):
        raise ValueError(
            f"The config asks for FSDP, but accelerate set this run up as {accelerator.distributed_type}: accelerate "
            "enables FSDP on GPUs (and other accelerators) only, not on CPU. Drop fsdp/fsdp_config to train with DDP "
            "(`use_cpu=True` on CPU), or run on GPUs."
        )
    parallelism = getattr(accelerator, "parallelism_config", None)
    if parallelism is not None and len(tuple(parallelism.fsdp_dim_names)) > 1:
        raise ValueError(
            f"{trainer_name} under FSDP2 has been run with one data-parallel mesh dimension only; this run shards "
            f"over {tuple(parallelism.fsdp_dim_names)} (HSDP). Use plain FSDP2 sharding."
        )


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the classes a transformers model names in `_no_split_modules` (what
    accelerate's `transformer_based_wrap` shards), else the backbone's `layers`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names] if names else []
    if not layers:
        stack = getattr(backbone(model), "layers", None)
        layers = list(stack) if isinstance(stack, nn.ModuleList) else []
    if not layers:
        raise ValueError(
            f"Cannot find the decoder layers of the teacher ({type(model).__name__}) to shard with FSDP2: it names "
            "no `_no_split_modules` and its backbone has no `layers` list. hf_rockopd supports transformers causal LMs."
        )
    return layers


def shard_teacher(teacher: nn.Module, mesh: Any = None) -> nn.Module:
    """Shard a frozen teacher with FSDP2 on `mesh` (the student's, see [`fsdp_mesh`]; `None`: all processes): each
    decoder layer and the root, parameters resharded after every forward, `requires_grad=False` (no gradient, never
    in the optimizer). In place; moves the shards to the mesh's device.

    The teacher keeps its own dtype (no mixed-precision policy): it only runs forward passes. A teacher that is already
    sharded is returned as is.

    Example:
    ```python
    # in an FSDP2 run (what `RockOPDTrainer` does once accelerate is set up):
    teacher = shard_teacher(teacher, fsdp_mesh(trainer.accelerator))
    ```
    """
    from torch.distributed.fsdp import fully_shard

    if is_fsdp2(teacher):
        return teacher
    if mesh is not None and mesh.ndim != 1:
        raise ValueError(
            f"FSDP2 with a {mesh.ndim}-D device mesh (HSDP or tensor parallelism) has not been tested with "
            "hf_rockopd; use one data-parallel dimension (plain `fully_shard`)."
        )
    teacher.eval()
    teacher.requires_grad_(False)
    for layer in _decoder_layers(teacher):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    # The root too, and explicitly resharded after forward: FSDP2 keeps a root's parameters gathered by default,
    # expecting a backward pass that a teacher never runs.
    fully_shard(teacher, mesh=mesh, reshard_after_forward=True)
    return teacher


class _ReduceScatterInto:
    """Post-accumulate-grad hook of a gathered head tensor: reduce-scatter its full gradient into the sharded
    parameter's `.grad`, averaged over the mesh as FSDP averages every other gradient, and free the full one.

    A collective: every rank's backward must reach the gathered head once. It does, since a micro-batch with no
    weighted row still projects one row for its zero anchor (`engine.weighting.project_rows`)."""

    def __init__(self, sharded: torch.Tensor):
        self.sharded = sharded

    def __call__(self, gathered: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor, Partial

        sharded, mesh = self.sharded, self.sharded.device_mesh
        full = gathered.grad.to(sharded.dtype)
        gathered.grad = None
        grad = DTensor.from_local(full, mesh, [Partial()], run_check=False).redistribute(mesh, sharded.placements)
        grad = grad / mesh.size()
        if sharded.grad is None:
            sharded.grad = grad
        else:
            sharded.grad += grad


def _bare_head(head: nn.Module, dtype: torch.dtype | None) -> nn.Linear:
    """A hook-free `nn.Linear` computing what `head` computes, on full (gathered or unsharded) tensors."""
    from torch.distributed.tensor import DTensor

    if not isinstance(getattr(head, "weight", None), torch.Tensor) or not isinstance(head, nn.Linear):
        raise TypeError(
            f"Under FSDP2 the output head must be an `nn.Linear` (got {type(head).__name__}); 4-bit or custom heads "
            "are supported on a single process or DDP only."
        )
    bare = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(bare)
    bare.in_features, bare.out_features = head.in_features, head.out_features
    for name in ("weight", "bias"):
        param = getattr(head, name)
        if param is None:
            bare.register_parameter(name, None)
            continue
        if not isinstance(param, DTensor):
            # The group is unsharded right now: share its parameter, FSDP reduce-scatters what accumulates in it.
            bare.register_parameter(name, param)
            continue
        with torch.no_grad():
            full = param.full_tensor()
        if dtype is not None and full.dtype != dtype and full.is_floating_point():
            full = full.to(dtype)  # the compute dtype of a mixed-precision policy
        gathered = nn.Parameter(full, requires_grad=param.requires_grad)
        if param.requires_grad:
            gathered.register_post_accumulate_grad_hook(_ReduceScatterInto(param))
        bare.register_parameter(name, gathered)
    return bare


@contextmanager
def gathered_heads(
    student: nn.Module,
    teacher: nn.Module | None,
    student_dtype: torch.dtype | None = None,
    teacher_dtype: torch.dtype | None = None,
) -> Iterator[tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]]:
    """The two models' logits functions (`hf_rockopd.models.introspection.logits_fn`, logit scale and soft-cap included), with
    full, hook-free heads for a model sharded with FSDP2 and the models' own heads otherwise.

    `student_dtype`/`teacher_dtype` are the hidden states' dtypes: a gathered head is cast to them (FSDP2 mixed
    precision computes in a lower dtype than the sharded parameters hold). Gathered copies live until the context
    exits and the loss's backward has run.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.engine.sharding import gathered_heads
    >>> from hf_rockopd.models import build_tiny_causal_lm
    >>> student, teacher = build_tiny_causal_lm(seed=0), build_tiny_causal_lm(seed=1)
    >>> with gathered_heads(student, teacher) as (student_logits, teacher_logits):
    ...     student_logits(torch.zeros(1, student.config.hidden_size)).shape[-1] == student.config.vocab_size
    True
    ```
    """
    fns = []
    for model, dtype in ((student, student_dtype), (teacher, teacher_dtype)):
        if model is None:  # a teacher known by its top-k has no head
            fns.append(None)
        elif is_fsdp2(model):
            fns.append(logits_fn(model, head=_bare_head(model.get_output_embeddings(), dtype)))
        else:
            fns.append(logits_fn(model))
    yield fns[0], fns[1]
