"""Policies that weight each batch from this step's scores: `loss_quantile` (divergence) and `entropy` (the student's
entropy). The trainer projects every valid position for them first."""

from __future__ import annotations

import math

import torch

from .base import TokenBatch, TokenPolicy, register_policy
from .configs import EntropyConfig, LossQuantileConfig, resolve_config


__all__ = ["EntropyPolicy", "LossQuantilePolicy"]


@register_policy("loss_quantile")
class LossQuantilePolicy(TokenPolicy):
    """Per batch, positions whose divergence is above the `quantile` of the batch's valid positions get `weight`.

    A loss-based baseline: it needs this step's divergence, so every valid position is projected.

    Args:
        quantile (`float`, defaults to 0.9): in (0, 1).
        weight (`float`, defaults to 0.0): weight of the positions above it.
        config ([`LossQuantileConfig`], *optional*): the options as one checked object, instead of the keywords.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.policies import LossQuantilePolicy, TokenBatch
    >>> m = torch.ones(1, 4, dtype=torch.bool)
    >>> b = TokenBatch(torch.zeros(1, 4, dtype=torch.long), m, 0, divergence=torch.tensor([[0.1, 0.2, 0.3, 5.0]]), scored=m)
    >>> LossQuantilePolicy(quantile=0.5).weights(b).tolist()
    [[1.0, 1.0, 0.0, 0.0]]
    ```
    """

    needs_divergence = True

    config_class = LossQuantileConfig

    def __init__(
        self,
        quantile: float = LossQuantileConfig.quantile,
        weight: float = LossQuantileConfig.weight,
        *,
        config: LossQuantileConfig | None = None,
    ):
        self.config = resolve_config(LossQuantileConfig, config, quantile=quantile, weight=weight)
        self.quantile = self.config.quantile
        self.weight = self.config.weight

    def weights(self, batch: TokenBatch) -> torch.Tensor:
        w = batch.mask.to(torch.float32)
        if batch.divergence is None:
            raise ValueError("loss_quantile needs batch.divergence (the trainer provides it for needs_divergence).")
        values = batch.divergence[batch.mask]
        if values.numel() == 0:
            return w
        threshold = torch.quantile(values.float(), self.quantile)
        return torch.where(batch.mask & (batch.divergence > threshold), self.weight, w)


@register_policy("entropy")
class EntropyPolicy(TokenPolicy):
    """Keep (weight 1) only the `keep_fraction` of valid positions with the highest student entropy; others `weight`.

    The "80/20 forking tokens" idea: the few high-entropy positions are where the reasoning branches.

    Args:
        keep_fraction (`float`, defaults to 0.2): in (0, 1].
        weight (`float`, defaults to 0.0): weight of the other positions.
        config ([`EntropyConfig`], *optional*): the options as one checked object, instead of the keywords.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.policies import EntropyPolicy, TokenBatch
    >>> m = torch.ones(1, 4, dtype=torch.bool)
    >>> b = TokenBatch(torch.zeros(1, 4, dtype=torch.long), m, 0, student_entropy=torch.tensor([[0.1, 2.0, 0.3, 0.2]]), scored=m)
    >>> EntropyPolicy(keep_fraction=0.25).weights(b).tolist()
    [[0.0, 1.0, 0.0, 0.0]]
    ```
    """

    needs_entropy = True

    config_class = EntropyConfig

    def __init__(
        self,
        keep_fraction: float = EntropyConfig.keep_fraction,
        weight: float = EntropyConfig.weight,
        *,
        config: EntropyConfig | None = None,
    ):
        self.config = resolve_config(EntropyConfig, config, keep_fraction=keep_fraction, weight=weight)
        self.keep_fraction = self.config.keep_fraction
        self.weight = self.config.weight

    def weights(self, batch: TokenBatch) -> torch.Tensor:
        if batch.student_entropy is None:
            raise ValueError("entropy needs batch.student_entropy (the trainer provides it for needs_entropy).")
        flat_mask = batch.mask.flatten()
        n_valid = int(flat_mask.sum())
        w = torch.where(batch.mask, self.weight, 0.0).to(torch.float32)
        if n_valid == 0:
            return w
        # The relative slack absorbs float round-off: 0.07 * 100 is 7.000000000000001, whose ceil would keep 8.
        x = self.keep_fraction * n_valid
        k = max(1, math.ceil(x - 1e-9 * x))
        ent = batch.student_entropy.flatten().float().masked_fill(~flat_mask, -math.inf)
        keep = torch.topk(ent, k).indices
        w = w.flatten()
        w[keep] = 1.0
        return w.view_as(batch.mask)
