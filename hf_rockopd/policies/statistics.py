"""Per-token-id statistics of the completions a policy has seen: occurrence counts and divergence sums, summed over
processes so that every rank decides on the same numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .base import TokenBatch


__all__ = ["TokenStatistics"]


def _all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum across processes when running distributed, so every rank holds the same statistics."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor


class TokenStatistics:
    """Per-token-id occurrence counts and divergence sums, float64, on the CPU.

    `count` counts every valid occurrence (known without projecting anything); `divergence_sum` and
    `divergence_count` cover only the occurrences whose divergence was measured.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.policies import TokenBatch, TokenStatistics
    >>> b = TokenBatch(torch.tensor([[1, 1, 2]]), torch.ones(1, 3, dtype=torch.bool), step=0,
    ...                divergence=torch.tensor([[0.5, 1.5, 2.0]]), scored=torch.ones(1, 3, dtype=torch.bool))
    >>> stats = TokenStatistics.from_batch(b, vocab_size=4)
    >>> stats.mean_divergence()[1].item(), stats.count.tolist()
    (1.0, [0.0, 2.0, 1.0, 0.0])
    ```
    """

    def __init__(self, vocab_size: int, data: torch.Tensor | None = None):
        self.vocab_size = int(vocab_size)
        self.data = torch.zeros(3, self.vocab_size, dtype=torch.float64) if data is None else data

    @property
    def count(self) -> torch.Tensor:
        return self.data[0]

    @property
    def divergence_sum(self) -> torch.Tensor:
        return self.data[1]

    @property
    def divergence_count(self) -> torch.Tensor:
        return self.data[2]

    @classmethod
    def from_batch(cls, batch: TokenBatch, vocab_size: int, reduce: bool = True) -> TokenStatistics:
        """Statistics of one batch; with `reduce`, summed over all processes."""
        ids = batch.token_ids[batch.mask]
        device = batch.token_ids.device
        data = torch.zeros(3, vocab_size, dtype=torch.float64, device=device)
        data[0].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float64))
        if batch.divergence is not None and batch.scored is not None:
            scored = batch.scored & batch.mask
            s_ids = batch.token_ids[scored]
            data[1].index_add_(0, s_ids, batch.divergence[scored].double())
            data[2].index_add_(0, s_ids, torch.ones_like(s_ids, dtype=torch.float64))
        if reduce:
            _all_reduce_sum(data)
        return cls(vocab_size, data.cpu())

    def mean_divergence(self) -> torch.Tensor:
        """`(V,)` mean divergence per id; NaN where no occurrence was measured."""
        return torch.where(
            self.divergence_count > 0,
            # Not clamp(min=1): decayed (EMA) counts are fractional, and sum / count must stay a mean.
            self.divergence_sum / torch.where(self.divergence_count > 0, self.divergence_count, 1.0),
            torch.full_like(self.divergence_sum, math.nan),
        )

    def table(self, ids: Sequence[int]) -> list[dict[str, Any]]:
        mean = self.mean_divergence()
        rows = []
        for i in ids:
            m = float(mean[i])
            rows.append(
                {
                    "token_id": int(i),
                    "count": int(self.count[i]),
                    "mean_divergence": None if math.isnan(m) else m,
                    "rock_score": None if math.isnan(m) else float(self.count[i]) * m,
                }
            )
        return rows

