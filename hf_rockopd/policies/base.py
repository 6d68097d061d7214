"""What every token policy shares: the batch it sees ([`TokenBatch`]), the interface it implements ([`TokenPolicy`]),
and the registry that builds one from a name and its options ([`register_policy`], [`get_policy`],
[`build_policy_options`]).

A policy sees a [`TokenBatch`] — for every loss position, the id of the token that position *predicts* (its label),
the validity mask and the step — and returns non-negative weights shaped like the mask. After the loss it may update
its statistics from the measured divergences. Policies never see the trainer: the trainer hands them tensors, and
they hand back tensors.

The weight of a position is decided by its label, never by the token at the input position. The paper's released
code indexed the mask by input tokens, which freezes the prediction *after* each rock token instead of the rock
itself.
"""

import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import torch


__all__ = [
    "TokenBatch",
    "TokenPolicy",
    "available_policies",
    "build_policy_options",
    "get_policy",
    "parse_policy_kwargs",
    "policy_config_class",
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
        config_class (`type`, *optional*): the dataclass of the constructor's options (see the built-ins' in
            `hf_rockopd.policies.configs`). With one, options are checked by it and the constructor receives
            `config=`; without, keyword arguments are checked against the constructor's signature.

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
    # The dataclass of the constructor's options, if it has one: `get_policy` and `RockOPDConfig` then check options
    # with it (see `policy_config_class`) and pass them as `config=`.
    config_class: ClassVar[type | None] = None

    # The tokenizer's stop and control ids (`modeling.special_token_ids`), set by the trainer before `setup`: a
    # selecting policy never picks them as rocks unless its options allow it (freezing eos unteaches stopping).
    special_ids: tuple[int, ...] = ()

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


def policy_summary(name: str) -> str | None:
    """What the registered policy `name` does, in one line: the first line of its class's own docstring (None for a
    name not registered in this process, such as a custom policy whose module was not imported, or a class without
    a docstring).

    The model card states it, so that a reader learns what the run's policy did without reading the code.

    Example:
    ```python
    >>> from hf_rockopd.policies import policy_summary
    >>> policy_summary("uniform")
    'Plain on-policy distillation: every valid completion token has weight 1.'
    >>> policy_summary("not_registered") is None
    True
    ```
    """
    # The class's own docstring: one inherited from TokenPolicy would describe the interface, not this policy.
    doc = _REGISTRY[name].__dict__.get("__doc__") if name in _REGISTRY else None
    return inspect.cleandoc(doc).splitlines()[0] if doc and doc.strip() else None


def _policy_class(name: str) -> type[TokenPolicy]:
    if name not in _REGISTRY:
        raise ValueError(f"Unknown rock_policy {name!r}. Available policies: {', '.join(available_policies())}.")
    return _REGISTRY[name]


def policy_config_class(name: str) -> type | None:
    """The options dataclass of the policy registered as `name`, or None for a policy without one.

    It is the `config_class` declared by the class whose `__init__` the policy runs: a subclass that writes its own
    constructor without declaring one gets None (its keyword arguments are then checked against its signature), one
    that inherits a built-in's constructor inherits its options.

    Example:
    ```python
    >>> from hf_rockopd.policies import policy_config_class
    >>> policy_config_class("rock_online").__name__
    'RockOnlineConfig'
    ```
    """
    cls = _policy_class(name)
    owner = next(klass for klass in cls.__mro__ if "__init__" in vars(klass))
    return vars(owner).get("config_class")


def _check_signature(name: str, cls: type[TokenPolicy], kwargs: Mapping[str, Any]) -> None:
    """A policy without an options dataclass: its constructor must take every keyword."""
    # A class without its own `__init__` reports `object.__init__(self, *args, **kwargs)`, yet takes no arguments.
    params = {} if cls.__init__ is object.__init__ else inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    _reject_unknown(name, kwargs, [p for p in params if p != "self"])


def _reject_unknown(name: str, kwargs: Mapping[str, Any], accepted: Sequence[str]) -> None:
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"rock_policy {name!r} does not take {', '.join(map(repr, unknown))}. Accepted keyword arguments: "
            f"{', '.join(accepted) if accepted else 'none'}. (Options a --config file set for another policy stay "
            "unless replaced: add --rock_policy_kwargs '{}' or this policy's own.)"
        )


def _options(name: str, options: Mapping[str, Any] | str | None) -> tuple[type[TokenPolicy], Any, dict[str, Any]]:
    """`(policy class, checked options object or None, keyword arguments)`: the one place options are checked."""
    cls = _policy_class(name)
    kwargs = parse_policy_kwargs(options)
    config_class = policy_config_class(name)
    if config_class is None:
        _check_signature(name, cls, kwargs)
        return cls, None, kwargs
    _reject_unknown(name, kwargs, [f.name for f in fields(config_class)])
    config = config_class(**kwargs)
    # The given options only, as the checked values (e.g. `top_k=3.0` becomes 3): defaults stay implicit.
    return cls, config, {k: getattr(config, k) for k in kwargs}


def build_policy_options(name: str, options: Mapping[str, Any] | str | None = None) -> dict[str, Any]:
    """Check the options of the policy registered as `name` and return them as keyword arguments.

    `options` is a dict, a JSON object string (as `--rock_policy_kwargs` gives it) or None. A built-in policy's options
    are checked by its options dataclass (`policy_config_class(name)`): an unknown name or a bad value raises
    `ValueError` naming it. A third-party policy without one has its keywords checked against its constructor.

    Example:
    ```python
    >>> from hf_rockopd.policies import build_policy_options
    >>> build_policy_options("rock_online", '{"top_k": 50.0, "weight": 0}')
    {'top_k': 50, 'weight': 0.0}
    >>> build_policy_options("rock_online", {"topk": 50})
    Traceback (most recent call last):
    ...
    ValueError: rock_policy 'rock_online' does not take 'topk'. Accepted keyword arguments: top_k, ...
    ```
    """
    return _options(name, options)[2]


def check_policy_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    """Raise `ValueError` if `name` is unknown or `kwargs` are not valid options of it (see [`build_policy_options`]).

    Example:
    ```python
    >>> from hf_rockopd.policies import check_policy_kwargs
    >>> check_policy_kwargs("entropy", {"keep_fraction": 0.5})
    ```
    """
    build_policy_options(name, kwargs)


def get_policy(name: str, **kwargs: Any) -> TokenPolicy:
    """Instantiate the policy registered as `name` with `kwargs` (checked once, see [`build_policy_options`]).

    Example:
    ```python
    >>> from hf_rockopd.policies import get_policy
    >>> get_policy("rock_online", top_k=10).top_k
    10
    ```
    """
    cls, config, kwargs = _options(name, kwargs)
    return cls(**kwargs) if config is None else cls(config=config)


def parse_policy_kwargs(value: Mapping[str, Any] | str | None, name: str = "rock_policy_kwargs") -> dict[str, Any]:
    """Accept a dict, a JSON object string, or None (no kwargs); errors name the option `name`.

    Example:
    ```python
    >>> from hf_rockopd.policies import parse_policy_kwargs
    >>> parse_policy_kwargs('{"top_k": 3}'), parse_policy_kwargs(None)
    ({'top_k': 3}, {})
    ```
    """
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name} is not valid JSON: {value!r} ({err}).") from err
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict or a JSON object, got {type(value).__name__}: {value!r}.")
    return dict(value)


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

