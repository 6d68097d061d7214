"""Rock statistics per teacher, beside the pooled ones, when several teachers are served.

With a dict of teacher URLs the token policy sees every example's divergence to its own teacher, and its rock set is
pooled over the teachers: one frozen set for the run. Different teachers can disagree with the student on different
tokens (a math teacher on digits, a code teacher on indentation), which the pooled set averages away. With
`rock_statistics_per_teacher=True` the engine also counts, for each teacher name, every scored completion token and
its divergence, and `rock_tokens.json` gets a `per_teacher` table: each teacher's own top tokens by
`R(v) = count x mean divergence`, selected as the policy selects (the same `top_k`, `min_count`, frequent-token and
stop-token exclusions). The freezing itself stays pooled; these tables say whether a per-teacher set would differ.

Example:
```python
>>> import torch
>>> from hf_rockopd.engine.per_teacher import PerTeacherStatistics
>>> from hf_rockopd.policies import TokenBatch
>>> stats = PerTeacherStatistics(vocab_size=10)
>>> batch = TokenBatch(token_ids=torch.tensor([[3, 3, 4], [5, 5, 5]]), mask=torch.ones(2, 3, dtype=torch.bool), step=0,
...                    divergence=torch.tensor([[1.0, 1.0, 0.5], [2.0, 2.0, 2.0]]), scored=torch.ones(2, 3, dtype=torch.bool))
>>> stats.update(batch, ["math", "code"])
>>> [row["token_id"] for row in stats.tables(top_k=1, min_count=1, exclude_top_frequent=0)["math"]]
[3]
```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..policies import TokenBatch
from ..policies.rock_set import select_rock_tokens


__all__ = ["PerTeacherStatistics"]


class PerTeacherStatistics:
    """Token counts and divergence sums per teacher name, over the training batches' scored completion tokens.

    Args:
        vocab_size: the student's vocabulary size.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.count: dict[str, torch.Tensor] = {}
        self.divergence: dict[str, torch.Tensor] = {}

    def update(self, batch: TokenBatch, routing: Sequence[str | None]) -> None:
        """Add a batch's scored tokens to their rows' teachers (`routing[b]` names row `b`'s)."""
        if batch.divergence is None or batch.scored is None:
            return
        seen = (batch.scored & batch.mask).cpu()
        ids, values = batch.token_ids.cpu(), batch.divergence.detach().float().cpu()
        for row, name in enumerate(routing):
            if name is None or not seen[row].any():
                continue
            if name not in self.count:
                self.count[name] = torch.zeros(self.vocab_size, dtype=torch.float64)
                self.divergence[name] = torch.zeros(self.vocab_size, dtype=torch.float64)
            tokens = ids[row][seen[row]]
            self.count[name].index_add_(0, tokens, torch.ones(tokens.shape, dtype=torch.float64))
            self.divergence[name].index_add_(0, tokens, values[row][seen[row]].double())

    def tables(
        self, top_k: int = 50, min_count: int = 2, exclude_top_frequent: int = 5, exclude_ids: Sequence[int] = ()
    ) -> dict[str, list[dict[str, Any]]]:
        """Each teacher's top tokens by R(v), best first: `token_id`, `count`, `frequency`, `mean_divergence`,
        `rock_score` (the rows of `rock_tokens.json`)."""
        out = {}
        for name in sorted(self.count):
            count = self.count[name]
            mean = torch.where(count > 0, self.divergence[name] / count.clamp(min=1), torch.full_like(count, math.nan))
            ids, scores = select_rock_tokens(count, mean, top_k, min_count, exclude_top_frequent, exclude_ids)
            total = float(count.sum()) or 1.0
            out[name] = [
                {"token_id": i, "count": int(count[i]), "frequency": float(count[i]) / total,
                 "mean_divergence": float(mean[i]), "rock_score": float(scores[i])}
                for i in ids
            ]  # fmt: skip
        return out
