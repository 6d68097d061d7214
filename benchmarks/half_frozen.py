"""`HalfFrozenPolicy`: the "half the completion positions frozen" setting of the training-step benchmark."""

from __future__ import annotations

import torch

from hf_rockopd.policies import TokenBatch, TokenPolicy


__all__ = ["HalfFrozenPolicy"]


class HalfFrozenPolicy(TokenPolicy):
    """Weight 0 on a random half (rounded down) of each batch's valid completion positions, 1 elsewhere.

    The frozen share is exactly one half whatever tokens were sampled (a token-set freeze such as `rock_freeze` freezes
    whatever share its tokens happen to take in the completions), and the weights are known before projection, as for
    every policy that needs no divergence, so the frozen rows are never projected. The draw is seeded by the step:
    every run and every trainer freezes the same positions of the same batch.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.policies import TokenBatch
    >>> from benchmarks.half_frozen import HalfFrozenPolicy
    >>> batch = TokenBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), step=0)
    >>> int((HalfFrozenPolicy().weights(batch) == 0).sum())
    3
    ```
    """

    def weights(self, batch: TokenBatch) -> torch.Tensor:
        weights = batch.mask.to(torch.float32)
        valid = batch.mask.flatten().nonzero().squeeze(1)
        generator = torch.Generator().manual_seed(int(batch.step))
        frozen = valid[torch.randperm(valid.numel(), generator=generator)[: valid.numel() // 2].to(valid.device)]
        weights.view(-1)[frozen] = 0.0
        return weights
