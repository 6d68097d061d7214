"""The `rock/*` and `completions/*` training metrics, summed over all processes before any ratio is taken.

Metrics are appended to a trainer's per-mode metric lists (`trainer._metrics["train"]`), which TRL's trainers average
at each log. Every ratio is computed from global sums, so a 2-process run logs the same numbers as one process seeing
both halves of the batch.

Example:
```python
>>> import torch
>>> from collections import defaultdict
>>> from hf_rockopd.engine.metrics import completion_sums, log_completion_metrics
>>> labels = torch.tensor([[-100, 5, 2, -100], [-100, 5, 5, 5]])  # eos id 2: the second completion was cut off
>>> metrics = defaultdict(list)
>>> log_completion_metrics(metrics, completion_sums([labels], [True], eos_ids=[2]))
>>> dict(metrics)
{'completions/mean_length': [2.5], 'completions/clipped_ratio': [0.5]}
```
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
from transformers.utils import logging

from ..policies import TokenBatch, TokenPolicy


logger = logging.get_logger(__name__)

__all__ = ["completion_sums", "gather_sum", "log_completion_metrics", "log_rock_metrics", "rock_metric_sums"]

Metrics = MutableMapping[str, list]


def gather_sum(values: torch.Tensor, accelerator: Any | None) -> torch.Tensor:
    """`values` (1-D) summed element-wise over all processes; as is with one process or without an accelerator.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.engine.metrics import gather_sum
    >>> gather_sum(torch.tensor([1.0, 2.0]), accelerator=None)
    tensor([1., 2.])
    ```
    """
    if accelerator is None or accelerator.num_processes <= 1:
        return values
    return accelerator.gather(values[None]).sum(0)


def rock_metric_sums(
    batch: TokenBatch, weights: torch.Tensor, grad_rows: torch.Tensor, probe_rows: torch.Tensor, probe_fraction: float
) -> torch.Tensor:
    """This process's sums behind the `rock/*` metrics of one micro-batch, as one float64 vector (see the code)."""
    mask = batch.mask
    down = mask & (weights < 1)
    frozen = mask & (weights == 0)
    other = mask & ~down
    div, gnorm = batch.divergence, batch.logit_grad_norm
    # Inverse-probability weights: probed positions stand for 1/fraction positions each, so the rocks' share of
    # divergence mass and gradient is estimated without projecting every frozen token.
    inv_p = grad_rows.float() + (probe_rows.float() / probe_fraction if probe_fraction > 0 else 0.0)
    down_scored, other_scored = down & batch.scored, other & batch.scored
    return torch.stack(
        [
            mask.sum(),
            down.sum(),
            frozen.sum(),
            grad_rows.sum(),
            probe_rows.sum(),
            (frozen & ~probe_rows).sum(),  # frozen and unmeasured: shares are then unknown
            div[down_scored].sum(),
            down_scored.sum(),
            div[other_scored].sum(),
            other_scored.sum(),
            (div * inv_p)[down].sum(),
            (gnorm * inv_p)[down].sum(),
            gnorm[other].sum(),
        ]
    ).double()


def log_rock_metrics(metrics: Metrics, sums: torch.Tensor, probe_fraction: float, policy: TokenPolicy) -> None:
    """Append the `rock/*` metrics computed from global [`rock_metric_sums`] and the policy's own `metrics()`."""
    (n_valid, n_down, n_frozen, n_grad, n_probe, n_blind, d_down, n_d_down, d_other, n_d_other,
     mass_down, g_down, g_other) = sums.tolist()  # fmt: skip
    if n_valid > 0:
        metrics["rock/down_weighted_fraction"].append(n_down / n_valid)
        metrics["rock/frozen_fraction"].append(n_frozen / n_valid)
        metrics["rock/projected_fraction"].append((n_grad + n_probe) / n_valid)
    if n_d_down > 0:
        metrics["rock/mean_divergence_rock"].append(d_down / n_d_down)
    if n_d_other > 0:
        metrics["rock/mean_divergence_other"].append(d_other / n_d_other)
    if n_valid > 0 and (n_blind == 0 or probe_fraction > 0):
        if mass_down + d_other > 0:
            metrics["rock/divergence_mass_share"].append(mass_down / (mass_down + d_other))
        if g_down + g_other > 0:
            metrics["rock/grad_norm_share"].append(g_down / (g_down + g_other))
    for key, value in policy.metrics().items():
        metrics[f"rock/{key}"].append(value)


def completion_sums(
    labels: Sequence[torch.Tensor], generated: Sequence[bool], eos_ids: int | Sequence[int] | None
) -> torch.Tensor:
    """This process's counts over an accumulation step's micro-batches, as one float64 vector on the labels' device:
    `[completion tokens of all micro-batches, generated completions, their tokens, those without eos, those checked
    for eos]`. `labels` are `(B, L)` with -100 outside completions (TRL's layout, shifted by one here); `generated`
    says which micro-batches the student (or teacher) sampled; without `eos_ids` nothing is checked for eos.

    Example: see the module docstring.
    """
    device = labels[0].device
    eos = None if eos_ids is None else torch.tensor(eos_ids if isinstance(eos_ids, (list, tuple)) else [eos_ids])
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    for batch_labels, sampled in zip(labels, generated):
        valid = batch_labels[:, 1:] != -100
        sums[0] += valid.sum().to(device)
        if not sampled:
            continue
        lengths = valid.sum(dim=1)
        sums[1] += lengths.numel()
        sums[2] += lengths.sum().to(device)
        if eos is not None:
            # A completion without eos hit max_new_tokens: it is scored as is, but a high share means the student is
            # trained on cut-off answers (raise max_new_tokens), as in TRL's GRPO `clipped_ratio`.
            ended = (torch.isin(batch_labels, eos.to(batch_labels.device)) & (batch_labels != -100)).any(dim=1)
            sums[3] += (~ended).sum().to(device)
            sums[4] += ended.numel()
    return sums


def log_completion_metrics(metrics: Metrics, sums: torch.Tensor) -> None:
    """Append `completions/mean_length` and `completions/clipped_ratio` from global [`completion_sums`]."""
    _, n_completions, n_tokens, n_clipped, n_checked = sums.tolist()
    if n_completions > 0:
        metrics["completions/mean_length"].append(n_tokens / n_completions)
    if n_checked > 0:
        metrics["completions/clipped_ratio"].append(n_clipped / n_checked)
