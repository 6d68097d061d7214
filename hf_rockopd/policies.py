"""Token policies: who decides how much each completion token counts in the distillation loss.

A policy sees a [`TokenBatch`] — for every loss position, the id of the token that position *predicts* (its label),
the validity mask and the step — and returns non-negative weights shaped like the mask. After the loss it may update
its statistics from the measured divergences. Policies never see the trainer: the trainer hands them tensors, and
they hand back tensors.

The weight of a position is decided by its label, never by the token at the input position. The paper's released
code indexed the mask by input tokens, which freezes the prediction *after* each rock token instead of the rock
itself.

Built-in policies (see `available_policies()`): `uniform`, `rock_freeze`, `rock_online`, `random_matched`,
`loss_quantile`, `entropy`. Register your own with [`register_policy`].
"""

from __future__ import annotations

import inspect
import json
import math
import os
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from transformers.utils import logging

from .rock_set import (
    NotEnoughControlIdsError,
    frequency_matched_ids,
    load_rock_set,
    select_rock_tokens,
    validate_token_ids,
)


logger = logging.get_logger(__name__)


__all__ = [
    "EntropyPolicy",
    "LossQuantilePolicy",
    "RandomMatchedPolicy",
    "RockFreezePolicy",
    "RockOnlinePolicy",
    "TokenBatch",
    "TokenPolicy",
    "TokenStatistics",
    "UniformPolicy",
    "available_policies",
    "get_policy",
    "register_policy",
]


@dataclass
class TokenBatch:
    """What a policy sees of one micro-batch, one entry per loss position `(B, T)`.

    Position `t` of row `b` is the prediction of the token `token_ids[b, t]`, the label, from the context before it.

    Attributes:
        token_ids (`torch.LongTensor`): id of the token each position predicts; arbitrary where `mask` is False.
        mask (`torch.BoolTensor`): valid completion positions (prompt and padding are False).
        step (`int`): the optimizer step being computed (`trainer.state.global_step`).
        divergence (`torch.Tensor`, *optional*): detached per-token divergence, where `scored` is True (0 elsewhere).
            Present before `weights()` only for policies with `needs_divergence` or `needs_entropy`; always present
            in `update()`.
        student_entropy, teacher_entropy (`torch.Tensor`, *optional*): detached entropies (nats), like `divergence`.
        logit_grad_norm (`torch.Tensor`, *optional*): norm of the divergence's gradient w.r.t. the student logits.
        scored (`torch.BoolTensor`, *optional*): positions where the four tensors above were measured.
        training (`bool`): False during evaluation; policies must not learn from evaluation batches.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.policies import TokenBatch, get_policy
    >>> batch = TokenBatch(token_ids=torch.tensor([[5, 7, 0]]), mask=torch.tensor([[True, True, False]]), step=0)
    >>> get_policy("rock_freeze", token_ids=[7]).weights(batch).tolist()
    [[1.0, 0.0, 0.0]]
    ```
    """

    token_ids: torch.Tensor
    mask: torch.Tensor
    step: int
    divergence: torch.Tensor | None = None
    student_entropy: torch.Tensor | None = None
    teacher_entropy: torch.Tensor | None = None
    logit_grad_norm: torch.Tensor | None = None
    scored: torch.Tensor | None = None
    training: bool = True

    def __post_init__(self):
        if self.token_ids.shape != self.mask.shape:
            raise ValueError(
                f"token_ids and mask must have the same shape, got {tuple(self.token_ids.shape)} and "
                f"{tuple(self.mask.shape)}."
            )
        self.mask = self.mask.bool()


class TokenPolicy(ABC):
    """Base class of token-weighting policies.

    Subclasses implement [`weights`]; stateful ones also [`update`], [`state_dict`] and [`load_state_dict`].

    Class attributes:
        name (`str`): the registered name.
        needs_divergence (`bool`): `weights()` needs this step's per-token divergence, so every valid position must be
            projected first. Policies that leave it False let the trainer skip zero-weight positions entirely.
        needs_entropy (`bool`): `weights()` needs this step's entropies (implies projecting every valid position).

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.policies import TokenPolicy, register_policy, get_policy
    >>> @register_policy("halve_digits_demo", overwrite=True)
    ... class HalveDigits(TokenPolicy):
    ...     def __init__(self, digit_ids=(15, 16)):
    ...         self.digit_ids = torch.tensor(list(digit_ids))
    ...     def weights(self, batch):
    ...         w = torch.where(torch.isin(batch.token_ids, self.digit_ids), 0.5, 1.0)
    ...         return w * batch.mask
    >>> type(get_policy("halve_digits_demo")).__name__
    'HalveDigits'
    ```
    """

    name: ClassVar[str] = ""
    needs_divergence: ClassVar[bool] = False
    needs_entropy: ClassVar[bool] = False

    def setup(self, vocab_size: int) -> None:  # noqa: B027 - optional hook
        """Called once by the trainer with the shared vocabulary size; validate ids and allocate statistics here."""

    @abstractmethod
    def weights(self, batch: TokenBatch) -> torch.Tensor:
        """Non-negative float weights shaped like `batch.mask` (values at invalid positions are ignored)."""

    def update(self, batch: TokenBatch, weights: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Learn from a training batch after its loss; `batch.divergence` is filled where `batch.scored`."""

    def rock_ids(self) -> list[int] | None:
        """The token ids this policy currently treats as rocks, or None if it has no fixed set."""
        return None

    def rock_table(self) -> list[dict[str, Any]]:
        """One dict per rock id (`token_id`, `count`, `mean_divergence`, `rock_score`), best first."""
        ids = self.rock_ids()
        return [{"token_id": int(i)} for i in ids] if ids else []

    def metrics(self) -> dict[str, float]:
        """Policy-specific scalars, logged with the `rock/` prefix."""
        ids = self.rock_ids()
        return {} if ids is None else {"set_size": float(len(ids))}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume; tensors, numbers, strings, lists and dicts only."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore what [`state_dict`] returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


PolicyT = TypeVar("PolicyT", bound=type[TokenPolicy])
_REGISTRY: dict[str, type[TokenPolicy]] = {}


def register_policy(name: str, cls: type[TokenPolicy] | None = None, *, overwrite: bool = False) -> Callable:
    """Register a [`TokenPolicy`] subclass under `name`; usable as a decorator or a plain call.

    Example:
    ```python
    >>> from hf_rockopd.policies import UniformPolicy, register_policy, available_policies
    >>> _ = register_policy("my_uniform", UniformPolicy, overwrite=True)
    >>> "my_uniform" in available_policies()
    True
    ```
    """

    def decorator(policy_cls: PolicyT) -> PolicyT:
        if not (isinstance(policy_cls, type) and issubclass(policy_cls, TokenPolicy)):
            raise TypeError(f"register_policy({name!r}) needs a TokenPolicy subclass, got {policy_cls!r}.")
        if not isinstance(name, str) or not name:
            raise ValueError(f"Policy names must be non-empty strings, got {name!r}.")
        if name in _REGISTRY and _REGISTRY[name] is not policy_cls and not overwrite:
            raise ValueError(
                f"A policy named {name!r} is already registered ({_REGISTRY[name].__name__}). Pick another name or "
                "pass overwrite=True."
            )
        _REGISTRY[name] = policy_cls
        # `name` must be the class's own: a subclass inheriting its parent's name would be saved and logged as the
        # parent policy.
        if not vars(policy_cls).get("name"):
            policy_cls.name = name
        return policy_cls

    return decorator(cls) if cls is not None else decorator


def available_policies() -> list[str]:
    """Sorted names of the registered policies.

    Example:
    ```python
    >>> from hf_rockopd.policies import available_policies
    >>> {"uniform", "rock_freeze", "rock_online"} <= set(available_policies())
    True
    ```
    """
    return sorted(_REGISTRY)


def _policy_class(name: str) -> type[TokenPolicy]:
    if name not in _REGISTRY:
        raise ValueError(f"Unknown rock_policy {name!r}. Available policies: {', '.join(available_policies())}.")
    return _REGISTRY[name]


def check_policy_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    """Raise `ValueError` if `name` is unknown or its constructor does not take one of `kwargs`."""
    cls = _policy_class(name)
    # A class without its own `__init__` reports `object.__init__(self, *args, **kwargs)`, yet takes no arguments.
    params = {} if cls.__init__ is object.__init__ else inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [p for p in params if p != "self"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"rock_policy {name!r} does not take {', '.join(map(repr, unknown))}. Accepted keyword arguments: "
            f"{', '.join(accepted) if accepted else 'none'}."
        )


def get_policy(name: str, **kwargs: Any) -> TokenPolicy:
    """Instantiate the policy registered as `name` with `kwargs`.

    Example:
    ```python
    >>> from hf_rockopd.policies import get_policy
    >>> get_policy("rock_online", top_k=10).top_k
    10
    ```
    """
    check_policy_kwargs(name, kwargs)
    return _policy_class(name)(**kwargs)


def parse_policy_kwargs(value: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """Accept a dict, a JSON object string, or None (no kwargs)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"rock_policy_kwargs is not valid JSON: {value!r} ({err}).") from err
    if not isinstance(value, Mapping):
        raise ValueError(f"rock_policy_kwargs must be a dict or a JSON object, got {type(value).__name__}: {value!r}.")
    return dict(value)


def _check_weight(weight: float, field: str = "weight") -> float:
    weight = float(weight)
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"{field} must be a finite number >= 0, got {weight}.")
    return weight


def _check_int(value: int, field: str, minimum: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ValueError(f"{field} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


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


def _expand_ids_mask(ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    if len(ids):
        mask[torch.as_tensor(list(ids), dtype=torch.long)] = True
    return mask


def _set_weights(batch: TokenBatch, id_mask: torch.Tensor, weight: float) -> torch.Tensor:
    """1 everywhere valid, `weight` where the *label* is in `id_mask`, 0 where invalid."""
    id_mask = id_mask.to(batch.token_ids.device)
    in_set = id_mask[batch.token_ids.clamp(0, id_mask.numel() - 1)]
    w = torch.where(in_set, weight, 1.0).to(torch.float32)
    return w * batch.mask


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

    def weights(self, batch: TokenBatch) -> torch.Tensor:
        return batch.mask.to(torch.float32)


@register_policy("rock_freeze")
class RockFreezePolicy(TokenPolicy):
    """A fixed set of token ids gets `weight` (0 freezes them), all other tokens 1.

    Args:
        token_ids (`list[int]` or `str`): the rock ids, or the path of a rock-set JSON file with `token_ids` (the lab's
            `rock_set.json` or a run's `rock_tokens.json`).
        weight (`float`, *optional*, defaults to `0.0`): weight of rock positions; soft values are allowed.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.policies import RockFreezePolicy, TokenBatch
    >>> p = RockFreezePolicy(token_ids=[3], weight=0.25); p.setup(vocab_size=10)
    >>> p.weights(TokenBatch(torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.bool), 0)).tolist()
    [[0.25, 1.0]]
    ```
    """

    def __init__(self, token_ids: Sequence[int] | str | os.PathLike, weight: float = 0.0):
        self.weight = _check_weight(weight)
        self.source = token_ids if isinstance(token_ids, (str, os.PathLike)) else None
        if self.source is not None:
            self.token_ids = load_rock_set(self.source)["token_ids"]
        else:
            self.token_ids = validate_token_ids(token_ids, None, source="rock_freeze")
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

    Example:
    ```python
    >>> from hf_rockopd.policies import get_policy
    >>> policy = get_policy("rock_online", warmup_steps=1, refresh_every=1, persistence=1, top_k=5)
    >>> policy.rock_ids()
    []
    ```
    """

    def __init__(
        self,
        top_k: int = 100,
        min_count: int = 2,
        exclude_top_frequent: int = 5,
        warmup_steps: int = 20,
        refresh_every: int = 10,
        window: int = 50,
        ema_decay: float | None = None,
        persistence: int = 2,
        stagnation_tol: float = 0.1,
        weight: float = 0.0,
    ):
        self.top_k = _check_int(top_k, "top_k", 1)
        self.min_count = _check_int(min_count, "min_count", 1)
        self.exclude_top_frequent = _check_int(exclude_top_frequent, "exclude_top_frequent", 0)
        self.warmup_steps = _check_int(warmup_steps, "warmup_steps", 0)
        self.refresh_every = _check_int(refresh_every, "refresh_every", 1)
        self.window = _check_int(window, "window", 1)
        if ema_decay is not None and not 0.0 < float(ema_decay) < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1) or None, got {ema_decay}.")
        self.ema_decay = None if ema_decay is None else float(ema_decay)
        self.persistence = _check_int(persistence, "persistence", 1)
        if not math.isfinite(float(stagnation_tol)) or stagnation_tol < 0:
            raise ValueError(f"stagnation_tol must be a finite number >= 0, got {stagnation_tol}.")
        self.stagnation_tol = float(stagnation_tol)
        self.weight = _check_weight(weight)
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
            self._totals.count, self._last_mean, self.top_k, self.min_count, self.exclude_top_frequent
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


@register_policy("random_matched")
class RandomMatchedPolicy(TokenPolicy):
    """Control for a rock set: freeze a random id set with the *same frequency distribution* as the rocks.

    If `reference_counts` is given, the control is drawn at setup from those counts. Otherwise the policy counts the
    completion tokens of the first `warmup_steps` steps (weights stay 1 meanwhile) and draws then, from the student's
    own token frequencies. Matching is by quantile bins of log-frequency (see `frequency_matched_ids`).

    Args:
        rock_set (`list[int]` or `str`): the rock ids, or a rock-set JSON file.
        reference_counts (`dict[int, int]` or `str`, *optional*): token frequencies to match on (a dict, or a JSON
            file with an object of id → count, at top level or under `"counts"`).
        warmup_steps (`int`, defaults to 20): steps counted before drawing, when `reference_counts` is None.
        num_bins (`int`, defaults to 10): frequency bins.
        seed (`int`, defaults to 0): seed of the draw (same on every process).
        weight (`float`, defaults to 0.0): weight of the control ids.

    Example:
    ```python
    >>> from hf_rockopd.policies import RandomMatchedPolicy
    >>> counts = {0: 1000, 1: 990, 2: 5, 3: 4, 4: 3, 5: 2}  # id 1 is the only other id in the top third
    >>> p = RandomMatchedPolicy(rock_set=[0], reference_counts=counts, num_bins=3); p.setup(vocab_size=6)
    >>> p.rock_ids()
    [1]
    ```
    """

    def __init__(
        self,
        rock_set: Sequence[int] | str | os.PathLike,
        reference_counts: Mapping[int, int] | str | os.PathLike | None = None,
        warmup_steps: int = 20,
        num_bins: int = 10,
        seed: int = 0,
        weight: float = 0.0,
    ):
        self.rock_source = rock_set
        self.reference_counts = reference_counts
        self.warmup_steps = _check_int(warmup_steps, "warmup_steps", 0)
        self.num_bins = _check_int(num_bins, "num_bins", 1)
        self.seed = int(seed)
        self.weight = _check_weight(weight)
        self.vocab_size: int | None = None
        self._matched: list[int] | None = None

    def _load_reference(self) -> torch.Tensor:
        ref = self.reference_counts
        if isinstance(ref, (str, os.PathLike)):
            try:
                with open(ref, encoding="utf-8") as f:
                    ref = json.load(f)
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"reference_counts file {os.fspath(ref)!r} could not be read as JSON: {err}") from err
            ref = ref.get("counts", ref) if isinstance(ref, dict) else ref
        if not isinstance(ref, Mapping):
            raise ValueError("reference_counts must map token ids to counts.")
        counts = torch.zeros(self.vocab_size, dtype=torch.float64)
        for k, v in ref.items():
            i = int(k)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"reference_counts has id {i} outside the vocabulary [0, {self.vocab_size}).")
            counts[i] = float(v)
        return counts

    def setup(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)
        if isinstance(self.rock_source, (str, os.PathLike)):
            self.rock_token_ids = load_rock_set(self.rock_source, vocab_size=vocab_size)["token_ids"]
        else:
            self.rock_token_ids = validate_token_ids(self.rock_source, vocab_size, source="random_matched rock_set")
        self._counts = TokenStatistics(vocab_size)
        self._id_mask = torch.zeros(vocab_size, dtype=torch.bool)
        self._postponed_warning = False
        if self.reference_counts is not None:
            self._draw(self._load_reference())

    def _draw(self, counts: torch.Tensor) -> None:
        self._matched = frequency_matched_ids(self.rock_token_ids, counts, num_bins=self.num_bins, seed=self.seed)
        self._id_mask = _expand_ids_mask(self._matched, self.vocab_size)
        self._reference = counts

    def weights(self, batch: TokenBatch) -> torch.Tensor:
        if self.vocab_size is None:
            raise RuntimeError("RandomMatchedPolicy.setup(vocab_size) must be called before use (the trainer does it).")
        if self._matched is None and batch.training and batch.step >= self.warmup_steps:
            try:
                self._draw(self._counts.count.clone())
            except NotEnoughControlIdsError as err:
                # Too few non-rock ids seen yet to match every rock: keep counting (weights stay 1 meanwhile) and
                # draw at a later step, instead of stopping the training run.
                if not self._postponed_warning:
                    logger.warning(
                        f"random_matched: the control is not drawn yet after {batch.step} steps ({err}); it is drawn "
                        "once enough token ids are seen. Give `reference_counts` to draw it at the start."
                    )
                    self._postponed_warning = True
        return _set_weights(batch, self._id_mask, self.weight)

    def update(self, batch: TokenBatch, weights: torch.Tensor) -> None:
        if batch.training and self._matched is None:
            self._counts.data += TokenStatistics.from_batch(batch, self.vocab_size).data

    def rock_ids(self) -> list[int]:
        return list(self._matched or [])

    def metrics(self) -> dict[str, float]:
        out = {"set_size": float(len(self._matched or []))}
        if self._matched:
            # Two-sample KS distance between the log-frequencies of the rocks and of their control: near 0 = matched.
            from scipy.stats import ks_2samp

            ref = self._reference
            a = torch.log1p(ref[self.rock_token_ids]).numpy()
            b = torch.log1p(ref[self._matched]).numpy()
            out["match_ks"] = float(ks_2samp(a, b).statistic)
        return out

    def state_dict(self) -> dict[str, Any]:
        if self.vocab_size is None:
            return {}
        return {
            "counts": self._counts.data.clone(),
            "matched": None if self._matched is None else list(self._matched),
            "reference": None if self._matched is None else self._reference.clone(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        self._counts = TokenStatistics(self.vocab_size, state["counts"].clone())
        if state["matched"] is not None:
            self._matched = [int(i) for i in state["matched"]]
            self._id_mask = _expand_ids_mask(self._matched, self.vocab_size)
            self._reference = state["reference"].clone()


@register_policy("loss_quantile")
class LossQuantilePolicy(TokenPolicy):
    """Per batch, positions whose divergence is above the `quantile` of the batch's valid positions get `weight`.

    A loss-based baseline: it needs this step's divergence, so every valid position is projected.

    Args:
        quantile (`float`, defaults to 0.9): in (0, 1).
        weight (`float`, defaults to 0.0): weight of the positions above it.

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

    def __init__(self, quantile: float = 0.9, weight: float = 0.0):
        if not 0.0 < float(quantile) < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}.")
        self.quantile = float(quantile)
        self.weight = _check_weight(weight)

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

    def __init__(self, keep_fraction: float = 0.2, weight: float = 0.0):
        if not 0.0 < float(keep_fraction) <= 1.0:
            raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}.")
        self.keep_fraction = float(keep_fraction)
        self.weight = _check_weight(weight)

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
