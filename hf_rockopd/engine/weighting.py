"""Which completion positions carry weight, which are projected, and the weighted loss over them.

The steps of one micro-batch, in the order the engine runs them:

1. `RockTokenEngine.plan` ([`checked_weights`], [`probe_rows`], [`normalizer`]): the policy weights every valid
   position from the token it predicts (unless it needs this step's divergences first); positions with weight > 0 are
   the gradient rows, a seeded `rock_probe_fraction` of the others the probe rows. Nothing else is ever projected.
2. [`project_rows`]: the output heads run on those rows only, `loss_chunk_size` at a time; with the weights known,
   the weighted loss and its gradient are fused per chunk.
3. [`fill_scores`]: the measured divergences and entropies go back into the `TokenBatch` for the policy's update and
   the metrics.

Example:
```python
>>> import torch
>>> from hf_rockopd.engine.weighting import normalizer
>>> normalizer("tokens", torch.tensor([1.0, 0.5]), torch.tensor(4), training=True, num_items_in_batch=torch.tensor(8),
...            accumulation_steps=2, num_processes=2)
tensor(4.)
```
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from transformers.utils import logging

from ..losses import ChunkedDivergence, chunked_divergence, chunked_weighted_loss
from ..models.introspection import logits_fn
from ..policies import TokenBatch, TokenPolicy


logger = logging.get_logger(__name__)

__all__ = [
    "LossPlan",
    "Projection",
    "check_finite",
    "checked_weights",
    "fill_scores",
    "normalizer",
    "probe_rows",
    "project_rows",
]


@dataclass
class LossPlan:
    """What one micro-batch's loss will project and how it is normalized, decided before any head runs.

    `weights`, `row_weights` and `normalizer` are `None` for a policy that weights from this step's divergences
    (`needs_divergence`/`needs_entropy`): then every valid position is a gradient row and the weights come after.
    """

    batch: TokenBatch
    grad_rows: torch.Tensor  # (B, T) bool: rows projected with gradient
    probe_rows: torch.Tensor  # (B, T) bool: zero-weight rows scored without gradient
    n_valid: torch.Tensor  # valid positions in this micro-batch
    num_items_in_batch: torch.Tensor | None  # valid positions of the accumulation step over all processes
    accumulation_steps: int
    weights: torch.Tensor | None = None
    row_weights: torch.Tensor | None = None  # weights[grad_rows]
    normalizer: torch.Tensor | None = None


@dataclass
class Projection:
    """The heads' output on a plan's rows."""

    grad: ChunkedDivergence  # rows that carry weight (differentiable unless `loss` is set)
    probe: ChunkedDivergence  # zero-weight rows scored without gradient
    anchor: torch.Tensor  # 0.0 connected to the student's graph, for batches with no weighted row
    loss: torch.Tensor | None = None  # the fused weighted loss, when the weights were known before projecting


def checked_weights(policy: TokenPolicy, batch: TokenBatch) -> torch.Tensor:
    """The policy's weights for `batch` as float32, zero outside the mask; `ValueError` on a wrong shape or values.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.engine.weighting import checked_weights
    >>> from hf_rockopd.policies import TokenBatch, UniformPolicy
    >>> batch = TokenBatch(token_ids=torch.tensor([[3, 4]]), mask=torch.tensor([[True, False]]), step=0)
    >>> checked_weights(UniformPolicy(), batch)
    tensor([[1., 0.]])
    ```
    """
    weights = policy.weights(batch)
    name = policy.name or type(policy).__name__
    if not torch.is_tensor(weights) or weights.shape != batch.mask.shape:
        shape = tuple(weights.shape) if torch.is_tensor(weights) else type(weights).__name__
        raise ValueError(f"Policy {name!r} returned weights of shape {shape}; expected {tuple(batch.mask.shape)}.")
    weights = weights.to(device=batch.mask.device, dtype=torch.float32)
    valid_w = weights[batch.mask]
    if not torch.isfinite(valid_w).all() or (valid_w < 0).any():
        raise ValueError(
            f"Policy {name!r} returned negative or non-finite weights at step {batch.step} "
            f"(min {valid_w.min().item() if valid_w.numel() else 0.0}). Weights must be finite and >= 0."
        )
    return weights * batch.mask


def normalizer(
    kind: str,
    row_weights: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    training: bool,
    num_items_in_batch: torch.Tensor | None,
    accumulation_steps: int,
    num_processes: int,
) -> torch.Tensor:
    """The denominator of the loss for `rock_normalization` `kind` (`"tokens"` or `"weights"`, see `RockOPDConfig`).

    Example: see the module docstring.
    """
    # Without a global count (evaluation, or a direct call), each micro-batch is a mean over its own tokens.
    accumulation = accumulation_steps if training else 1
    if kind == "tokens":
        if training and num_items_in_batch is not None:
            # Global count over processes and accumulation steps; DDP then averages gradients over processes.
            return num_items_in_batch / num_processes
        if num_items_in_batch is not None:
            # Evaluation with a caller's count (no gradients are averaged): the divisor as given, as TRL does.
            return torch.as_tensor(num_items_in_batch, device=n_valid.device)
        return n_valid * accumulation
    return row_weights.sum() * accumulation


def project_rows(
    plan: LossPlan,
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student: nn.Module,
    teacher: nn.Module | None,
    *,
    beta: float,
    temperature: float,
    chunk_size: int,
    heads: tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> Projection:
    """The heads of both models on `plan.grad_rows` (with gradient) and `plan.probe_rows` (without), nothing else.

    `student_hidden`/`teacher_hidden` are `(B, T, H)` hidden states aligned with the plan's `(B, T)` masks. With
    `plan.row_weights` (weights decided before the divergence) the weighted loss and its gradient are fused per chunk
    (`chunked_weighted_loss`, 4 matrix products per chunk); otherwise the per-row divergences stay differentiable for
    weights decided from them (`chunked_divergence`). `heads` replaces `(logits_fn(student), logits_fn(teacher))`
    (the engine passes gathered heads under FSDP2, see `hf_rockopd.engine.sharding`). A `None` teacher head means
    `teacher_hidden` holds a top-k teacher's packed targets (`hf_rockopd.losses.sparse.pack_topk`), `(B, T, 2, W)`.

    Example: `RockTokenEngine.project_causal_lm` calls it after running both backbones.
    """
    grad_rows, probe_rows = plan.grad_rows, plan.probe_rows
    if heads is None:
        heads = (logits_fn(student), logits_fn(teacher) if teacher is not None else None)
    student_logits, teacher_logits = heads
    common = {"beta": beta, "temperature": temperature, "chunk_size": chunk_size}
    loss = None
    if plan.row_weights is None:
        grad = chunked_divergence(
            student_hidden[grad_rows], teacher_hidden[grad_rows], student_logits, teacher_logits, **common
        )
    else:
        loss, grad = chunked_weighted_loss(
            student_hidden[grad_rows],
            teacher_hidden[grad_rows],
            student_logits,
            teacher_logits,
            plan.row_weights,
            plan.normalizer,
            **common,
        )
    with torch.no_grad():
        probe = chunked_divergence(
            student_hidden[probe_rows], teacher_hidden[probe_rows], student_logits, teacher_logits, **common
        )
    if grad_rows.any():
        anchor = student_hidden.new_zeros(())
    else:
        # Nothing carries weight: a zero that still reaches every student parameter, so the backward pass (and
        # DDP's gradient reduction) sees the same graph as on any other batch.
        anchor = 0.0 * student_logits(student_hidden[:1, :1]).float().sum()
    return Projection(grad=grad, probe=probe, anchor=anchor, loss=loss)


def fill_scores(batch: TokenBatch, grad_rows: torch.Tensor, probe_rows: torch.Tensor, projection: Projection) -> None:
    """Scatter the projected rows' divergence, entropies and logit-gradient norms into `batch` (0 elsewhere)."""
    grad, probe = projection.grad, projection.probe

    def scatter(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(batch.mask.shape, dtype=torch.float32, device=batch.mask.device)
        full[grad_rows] = a.detach().float()
        full[probe_rows] = b.float()
        return full

    batch.divergence = scatter(grad.divergence, probe.divergence)
    batch.student_entropy = scatter(grad.student_entropy, probe.student_entropy)
    batch.teacher_entropy = scatter(grad.teacher_entropy, probe.teacher_entropy)
    batch.logit_grad_norm = scatter(grad.logit_grad_norm, probe.logit_grad_norm)
    batch.scored = grad_rows | probe_rows


def check_finite(projection: Projection, step: int) -> None:
    """`FloatingPointError` naming the step when a scored position's divergence is NaN or inf."""
    for values in (projection.grad.divergence, projection.probe.divergence):
        bad = ~torch.isfinite(values.detach())
        if bad.any():
            raise FloatingPointError(
                f"Non-finite per-token divergence at step {step}: {int(bad.sum())} of {values.numel()} scored "
                "positions are NaN or inf. Check the teacher's logits (NaN/inf weights or overflow in low "
                "precision), the loss_temperature, and that student and teacher share one tokenizer."
            )


def probe_rows(candidates: torch.Tensor, fraction: float, seed_key: Any) -> torch.Tensor:
    """A random `fraction` of the `candidates` positions, drawn from a generator seeded by `hash(seed_key)`.

    The engine's key is (seed, step, micro-step, rank), so a resumed run probes the same positions.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.engine.weighting import probe_rows
    >>> candidates = torch.tensor([[True, True, False]])
    >>> probe_rows(candidates, 1.0, seed_key=0).tolist(), probe_rows(candidates, 0.0, seed_key=0).tolist()
    ([[True, True, False]], [[False, False, False]])
    ```
    """
    if fraction <= 0 or not candidates.any():
        return torch.zeros_like(candidates)
    if fraction >= 1:
        return candidates.clone()
    generator = torch.Generator(device="cpu").manual_seed(hash(seed_key) % (2**63))
    draw = torch.rand(candidates.shape, generator=generator).to(candidates.device)
    return candidates & (draw < fraction)
