"""Policies with fixed weights: `uniform` (plain on-policy distillation) and `rock_freeze` (a given rock set)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .rock_set import load_rock_set, validate_token_ids
from .base import TokenBatch, TokenPolicy, _expand_ids_mask, _set_weights, register_policy
from .configs import RockFreezeConfig, UniformConfig, resolve_config
from .statistics import TokenStatistics


__all__ = ["RockFreezePolicy", "UniformPolicy"]


@register_policy("uniform")
class UniformPolicy(TokenPolicy):
    """Plain on-policy distillation: every valid completion token has weight 1.

    With it, the loss equals TRL's `GKDTrainer.generalized_jsd_loss` on the same batch.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.policies import TokenBatch, UniformPolicy
    >>> UniformPolicy().weights(TokenBatch(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[True, False]]), 0)).tolist()
    [[1.0, 0.0]]
    ```
    """

    config_class = UniformConfig

    def __init__(self, *, config: UniformConfig | None = None):
        self.config = resolve_config(UniformConfig, config)

    def weights(self, batch: TokenBatch) -> torch.Tensor:
        return batch.mask.to(torch.float32)


@register_policy("rock_freeze")
class RockFreezePolicy(TokenPolicy):
    """A fixed set of token ids gets `weight` (0 freezes them), all other tokens 1.

    Args:
        token_ids (`list[int]` or `str`): the rock ids, or the path of a rock-set JSON file with `token_ids` (the lab's
            `rock_set.json` or a run's `rock_tokens.json`). Required.
        weight (`float`, *optional*, defaults to `0.0`): weight of rock positions; soft values are allowed.
        config ([`RockFreezeConfig`], *optional*): the options as one checked object, instead of the keywords.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.policies import RockFreezePolicy, TokenBatch
    >>> p = RockFreezePolicy(token_ids=[3], weight=0.25); p.setup(vocab_size=10)
    >>> p.weights(TokenBatch(torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.bool), 0)).tolist()
    [[0.25, 1.0]]
    ```
    """

    config_class = RockFreezeConfig

    def __init__(
        self,
        token_ids: Sequence[int] | str | os.PathLike | None = None,
        weight: float = RockFreezeConfig.weight,
        *,
        config: RockFreezeConfig | None = None,
    ):
        self.config = resolve_config(RockFreezeConfig, config, token_ids=token_ids, weight=weight)
        self.weight = self.config.weight
        self.source = self.config.token_ids if isinstance(self.config.token_ids, (str, os.PathLike)) else None
        if self.source is not None:
            self.token_ids = load_rock_set(self.source)["token_ids"]
        else:
            self.token_ids = list(self.config.token_ids)  # checked by the config; a copy, as setup() replaces it
        self.vocab_size: int | None = None
        self._id_mask: torch.Tensor | None = None
        self._stats: TokenStatistics | None = None

    def setup(self, vocab_size: int) -> None:
        if self.source is not None:
            self.token_ids = load_rock_set(self.source, vocab_size=vocab_size)["token_ids"]
        else:
            self.token_ids = validate_token_ids(self.token_ids, vocab_size, source="rock_freeze")
        self.vocab_size = vocab_size
        self._id_mask = _expand_ids_mask(self.token_ids, vocab_size)
        self._stats = TokenStatistics(vocab_size)

    def _ensure_setup(self, batch: TokenBatch) -> None:
        if self._id_mask is None:
            self.setup(max(max(self.token_ids) + 1, int(batch.token_ids.max()) + 1))

    def weights(self, batch: TokenBatch) -> torch.Tensor:
        self._ensure_setup(batch)
        return _set_weights(batch, self._id_mask, self.weight)

    def update(self, batch: TokenBatch, weights: torch.Tensor) -> None:
        if batch.training and self._stats is not None:
            self._stats.data += TokenStatistics.from_batch(batch, self._stats.vocab_size).data

    def rock_ids(self) -> list[int]:
        return list(self.token_ids)

    def rock_table(self) -> list[dict[str, Any]]:
        if self._stats is None:
            return super().rock_table()
        return self._stats.table(self.token_ids)

    def state_dict(self) -> dict[str, Any]:
        # A copy: `update()` adds to the live tensor in place, which would change a state already handed out.
        return {"token_ids": list(self.token_ids), "stats": None if self._stats is None else self._stats.data.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state["token_ids"]) != list(self.token_ids):
            raise ValueError(
                "The saved rock_freeze state was made for another rock set "
                f"({len(state['token_ids'])} ids) than the one configured ({len(self.token_ids)} ids)."
            )
        if state.get("stats") is not None and self._stats is not None:
            self._stats.data = state["stats"].clone()

