"""`rock_online`: rock tokens found during training, from the student's own completions."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from .rock_set import select_rock_tokens
from .base import TokenBatch, TokenPolicy, _expand_ids_mask, _set_weights, register_policy
from .configs import RockOnlineConfig, resolve_config
from .statistics import TokenStatistics


__all__ = ["RockOnlinePolicy"]


@register_policy("rock_online")
class RockOnlinePolicy(TokenPolicy):
    """Finds rock tokens during training from the student's own completions and down-weights them.

    Per token id it accumulates occurrences and divergence mass over the last `window` optimizer steps (or as an
    exponential moving average with `ema_decay`). Every `refresh_every` steps from `warmup_steps` on, it ranks ids by
    the paper's Rock Score `R(v) = count · mean divergence`, drops ids seen fewer than `min_count` times and the
    `exclude_top_frequent` most frequent ids, and keeps the `top_k` best as candidates. A candidate becomes a rock
    only if it was a candidate at each of the last `persistence` refreshes and its mean divergence fell by at most
    `stagnation_tol` (relative) over them: rocks are the tokens that stay divergent *and* stop improving. Rocks get
    `weight`. Statistics are summed over processes, so every rank holds the same set.

    A frozen rock is not projected, so its divergence is not measured again; its last measured mean divergence is
    carried forward (the paper finds rocks stagnate) unless the trainer's `rock_probe_fraction` keeps sampling it.

    Args:
        top_k (`int`, defaults to 100), min_count (`int`, defaults to 2), exclude_top_frequent (`int`, defaults to 5):
            the paper's selection rule.
        warmup_steps (`int`, defaults to 20): steps of uniform weights before the first refresh.
        refresh_every (`int`, defaults to 10): steps between refreshes.
        window (`int`, defaults to 50): steps of statistics kept (ignored with `ema_decay`).
        ema_decay (`float`, *optional*): if set, statistics decay by this factor per step instead of a window.
        persistence (`int`, defaults to 2): consecutive refreshes an id must stay a candidate.
        stagnation_tol (`float`, defaults to 0.1): largest relative fall of mean divergence over those refreshes.
        weight (`float`, defaults to 0.0): weight of rock positions.
        allow_special_tokens (`bool`, defaults to False): let the tokenizer's stop and control tokens
            (`special_ids`, set by the trainer) become rocks; off, as freezing eos unteaches stopping.
        config ([`RockOnlineConfig`], *optional*): the options as one checked object, instead of the keywords.

    Example:
    ```python
    >>> from hf_rockopd.policies import get_policy
    >>> policy = get_policy("rock_online", warmup_steps=1, refresh_every=1, persistence=1, top_k=5)
    >>> policy.rock_ids()
    []
    ```
    """

    config_class = RockOnlineConfig

    def __init__(
        self,
        top_k: int = RockOnlineConfig.top_k,
        min_count: int = RockOnlineConfig.min_count,
        exclude_top_frequent: int = RockOnlineConfig.exclude_top_frequent,
        warmup_steps: int = RockOnlineConfig.warmup_steps,
        refresh_every: int = RockOnlineConfig.refresh_every,
        window: int = RockOnlineConfig.window,
        ema_decay: float | None = RockOnlineConfig.ema_decay,
        persistence: int = RockOnlineConfig.persistence,
        stagnation_tol: float = RockOnlineConfig.stagnation_tol,
        weight: float = RockOnlineConfig.weight,
        allow_special_tokens: bool = RockOnlineConfig.allow_special_tokens,
        *,
        config: RockOnlineConfig | None = None,
    ):
        # Defaults and checks live in RockOnlineConfig only; the keywords stay for `RockOnlinePolicy(top_k=50)`.
        self.config = resolve_config(
            RockOnlineConfig,
            config,
            top_k=top_k,
            min_count=min_count,
            exclude_top_frequent=exclude_top_frequent,
            warmup_steps=warmup_steps,
            refresh_every=refresh_every,
            window=window,
            ema_decay=ema_decay,
            persistence=persistence,
            stagnation_tol=stagnation_tol,
            weight=weight,
            allow_special_tokens=allow_special_tokens,
        )
        self.top_k = self.config.top_k
        self.min_count = self.config.min_count
        self.exclude_top_frequent = self.config.exclude_top_frequent
        self.warmup_steps = self.config.warmup_steps
        self.refresh_every = self.config.refresh_every
        self.window = self.config.window
        self.ema_decay = self.config.ema_decay
        self.persistence = self.config.persistence
        self.stagnation_tol = self.config.stagnation_tol
        self.weight = self.config.weight
        self.allow_special_tokens = self.config.allow_special_tokens
        self.vocab_size: int | None = None

    def setup(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)
        self._totals = TokenStatistics(vocab_size)  # over the window (or EMA)
        self._pending = TokenStatistics(vocab_size)  # the step being computed
        self._window: deque[tuple[torch.Tensor, torch.Tensor]] = deque()  # (ids, (3, n) values) per past step
        self._last_mean = torch.full((vocab_size,), math.nan, dtype=torch.float64)
        self._history: deque[dict[int, float]] = deque(maxlen=self.persistence)
        self._step: int | None = None
        self._rocks: list[int] = []
        self._rock_mask = torch.zeros(vocab_size, dtype=torch.bool)
        self._candidates: list[int] = []
        self._jaccard: float | None = None
        self._refreshes = 0

    def _ensure_setup(self, batch: TokenBatch) -> None:
        if self.vocab_size is None:
            raise RuntimeError("RockOnlinePolicy.setup(vocab_size) must be called before use (the trainer does it).")

    # -- statistics ---------------------------------------------------------------------------------------------
    def _commit_pending(self) -> None:
        delta = self._pending.data
        if self.ema_decay is not None:
            self._totals.data.mul_(self.ema_decay).add_(delta)
        else:
            ids = torch.nonzero(delta[0] > 0).flatten()
            self._window.append((ids, delta[:, ids].clone()))
            self._totals.data.add_(delta)
            while len(self._window) > self.window:
                old_ids, old_values = self._window.popleft()
                self._totals.data[:, old_ids] -= old_values
                # Float64 round-off can leave -1e-16 behind; counts are integers.
                self._totals.data[0, old_ids] = self._totals.data[0, old_ids].round()
        self._pending = TokenStatistics(self.vocab_size)

    def _advance(self, step: int) -> None:
        if self._step is None:
            self._step = step
            return
        if step == self._step:
            return
        self._commit_pending()
        self._step = step
        if step >= self.warmup_steps and (step - self.warmup_steps) % self.refresh_every == 0:
            self._refresh()

    def _refresh(self) -> None:
        measured = self._totals.divergence_count > 0
        window_mean = self._totals.mean_divergence()
        self._last_mean = torch.where(measured, window_mean, self._last_mean)
        candidates, scores = select_rock_tokens(
            self._totals.count, self._last_mean, self.top_k, self.min_count, self.exclude_top_frequent,
            exclude_ids=() if self.allow_special_tokens else self.special_ids,
        )
        self._scores = scores
        self._history.append({i: float(self._last_mean[i]) for i in candidates})
        self._candidates = candidates
        rocks = []
        if len(self._history) == self.persistence:
            first = self._history[0]
            for i in candidates:
                if not all(i in h for h in self._history):
                    continue
                start, now = first[i], self._history[-1][i]
                if start <= 0 or (start - now) / start <= self.stagnation_tol:
                    rocks.append(i)
        previous = set(self._rocks)
        union = previous | set(rocks)
        self._jaccard = len(previous & set(rocks)) / len(union) if union else None
        self._rocks = rocks
        self._rock_mask = _expand_ids_mask(rocks, self.vocab_size)
        self._refreshes += 1

    # -- policy interface ---------------------------------------------------------------------------------------
    def weights(self, batch: TokenBatch) -> torch.Tensor:
        self._ensure_setup(batch)
        if batch.training:
            self._advance(batch.step)
        return _set_weights(batch, self._rock_mask, self.weight)

    def update(self, batch: TokenBatch, weights: torch.Tensor) -> None:
        if not batch.training:
            return
        self._ensure_setup(batch)
        self._pending.data += TokenStatistics.from_batch(batch, self.vocab_size).data

    def rock_ids(self) -> list[int]:
        return list(self._rocks) if self.vocab_size is not None else []

    def rock_table(self) -> list[dict[str, Any]]:
        if self.vocab_size is None:
            return []
        total = float(self._totals.count.sum()) or 1.0
        rows = []
        for i in self._rocks:
            m = float(self._last_mean[i])
            c = float(self._totals.count[i])
            rows.append(
                {
                    "token_id": int(i),
                    "count": int(c),
                    "frequency": c / total,
                    "mean_divergence": None if math.isnan(m) else m,
                    "rock_score": None if math.isnan(m) else c * m,
                }
            )
        # Best first by R(v) as it stands now (the window has moved since the refresh ranked them); unmeasured last.
        rows.sort(key=lambda row: -math.inf if row["rock_score"] is None else row["rock_score"], reverse=True)
        return rows

    def metrics(self) -> dict[str, float]:
        out = {"set_size": float(len(self._rocks)) if self.vocab_size is not None else 0.0}
        if self.vocab_size is not None:
            out["candidates"] = float(len(self._candidates))
            if self._jaccard is not None:
                out["jaccard_prev"] = float(self._jaccard)
        return out

    def state_dict(self) -> dict[str, Any]:
        if self.vocab_size is None:
            return {}
        return {
            "vocab_size": self.vocab_size,
            "totals": self._totals.data.clone(),
            "pending": self._pending.data.clone(),
            "window_ids": [ids.clone() for ids, _ in self._window],
            "window_values": [values.clone() for _, values in self._window],
            "last_mean": self._last_mean.clone(),
            "history": [{str(k): v for k, v in h.items()} for h in self._history],
            "step": self._step,
            "rocks": list(self._rocks),
            "candidates": list(self._candidates),
            "jaccard": self._jaccard,
            "refreshes": self._refreshes,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        if self.vocab_size is None:
            self.setup(int(state["vocab_size"]))
        if int(state["vocab_size"]) != self.vocab_size:
            raise ValueError(
                f"The saved rock_online state was made for a vocabulary of {state['vocab_size']} tokens, but the "
                f"model's has {self.vocab_size}."
            )
        self._totals = TokenStatistics(self.vocab_size, state["totals"].clone())
        self._pending = TokenStatistics(self.vocab_size, state["pending"].clone())
        self._window = deque(zip(state["window_ids"], state["window_values"], strict=True))
        self._last_mean = state["last_mean"].clone()
        self._history = deque(
            ({int(k): float(v) for k, v in h.items()} for h in state["history"]), maxlen=self.persistence
        )
        self._step = state["step"]
        self._rocks = [int(i) for i in state["rocks"]]
        self._rock_mask = _expand_ids_mask(self._rocks, self.vocab_size)
        self._candidates = [int(i) for i in state["candidates"]]
        self._jaccard = state["jaccard"]
        self._refreshes = int(state["refreshes"])

