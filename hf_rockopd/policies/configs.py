"""The built-in policies' options as typed dataclasses, each field with a `help` text, checked once in `__post_init__`.

Every way of building a built-in policy goes through these: the policy constructors (`RockOnlinePolicy(top_k=50)`
builds a `RockOnlineConfig`), `get_policy`, and `RockOPDConfig(rock_policy_kwargs=...)` (through
`build_policy_options`). A bad value raises `ValueError` naming the field and the value. The `help` metadata is what
`transformers.HfArgumentParser` shows, so a command line can expose a policy's options as flags.

The annotations are real types (no `from __future__ import annotations`), as `HfArgumentParser` and the command
line's `--policy.NAME` flags read them with `typing.get_type_hints`.
"""

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from .rock_set import validate_token_ids


__all__ = [
    "EntropyConfig",
    "LossQuantileConfig",
    "PolicyConfig",
    "RandomMatchedConfig",
    "RockFreezeConfig",
    "RockOnlineConfig",
    "UniformConfig",
]


def _check_weight(weight: float, name: str = "weight") -> float:
    weight = float(weight)
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {weight}.")
    return weight


def _check_int(value: int, name: str, minimum: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def _check_required(value: Any, name: str, policy: str, what: str) -> None:
    if value is None:
        raise ValueError(f"{name} is required by the {policy} policy: {what}; got None.")


@dataclass
class PolicyConfig:
    """Base of the built-in policies' option dataclasses.

    Example:
    ```python
    >>> from hf_rockopd.policies import LossQuantileConfig
    >>> LossQuantileConfig(quantile=0.75).to_dict()
    {'quantile': 0.75, 'weight': 0.0}
    ```
    """

    def to_dict(self) -> dict[str, Any]:
        """The options as keyword arguments of the policy (shallow: lists are shared, not copied)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


ConfigT = TypeVar("ConfigT", bound=PolicyConfig)


def resolve_config(config_class: type[ConfigT], config: ConfigT | None, **options: Any) -> ConfigT:
    """The options a policy constructor runs on: `config` if given (the keyword options must then be left at their
    defaults), else a `config_class` built, and so checked, from the keyword options.

    Example:
    ```python
    >>> from hf_rockopd.policies.configs import EntropyConfig, resolve_config
    >>> resolve_config(EntropyConfig, None, keep_fraction=0.5, weight=0.0).keep_fraction
    0.5
    >>> resolve_config(EntropyConfig, EntropyConfig(keep_fraction=0.3), keep_fraction=0.2, weight=0.0).keep_fraction
    0.3
    ```
    """
    if config is None:
        return config_class(**options)
    if not isinstance(config, config_class):
        raise TypeError(f"config must be a {config_class.__name__}, got {type(config).__name__}.")
    defaults = {f.name: f.default for f in fields(config_class)}
    given = sorted(k for k, v in options.items() if not (v is defaults[k] or v == defaults[k]))
    if given:
        raise TypeError(
            f"Pass the options either as config= or as keyword arguments, not both (got config and {', '.join(given)})."
        )
    return config


@dataclass
class UniformConfig(PolicyConfig):
    """Options of the `uniform` policy: none (every valid completion token has weight 1).

    Example:
    ```python
    >>> from hf_rockopd.policies import UniformConfig
    >>> UniformConfig().to_dict()
    {}
    ```
    """


@dataclass
class RockFreezeConfig(PolicyConfig):
    """Options of the `rock_freeze` policy: a fixed set of token ids gets `weight`, all other tokens 1.

    Example:
    ```python
    >>> from hf_rockopd.policies import RockFreezeConfig
    >>> RockFreezeConfig(token_ids=[5, 3], weight=0.25)
    RockFreezeConfig(token_ids=[5, 3], weight=0.25)
    >>> RockFreezeConfig(token_ids=[5], weight=-1)
    Traceback (most recent call last):
    ...
    ValueError: weight must be a finite number >= 0, got -1.0.
    ```
    """

    token_ids: list[int] | str | os.PathLike | None = field(
        default=None,
        metadata={
            "help": "The rock ids (a list of distinct integers), or the path of a rock-set JSON file with token_ids "
            "(the lab's rock_set.json or a run's rock_tokens.json). Required."
        },
    )
    weight: float = field(
        default=0.0, metadata={"help": "Weight of rock positions (0 freezes them); soft values >= 0 are allowed."}
    )

    def __post_init__(self):
        self.weight = _check_weight(self.weight)
        _check_required(self.token_ids, "token_ids", "rock_freeze", "a list of token ids or a rock-set JSON file")
        # A file is read by the policy (with the vocabulary at setup), not here: a config stays a value.
        if not isinstance(self.token_ids, (str, os.PathLike)):
            self.token_ids = validate_token_ids(self.token_ids, None, source="rock_freeze")


@dataclass
class RockOnlineConfig(PolicyConfig):
    """Options of the `rock_online` policy, which finds rock tokens during training (see `RockOnlinePolicy`).

    Example:
    ```python
    >>> from hf_rockopd.policies import RockOnlineConfig
    >>> RockOnlineConfig(top_k=50.0).top_k
    50
    >>> RockOnlineConfig(ema_decay=1.0)
    Traceback (most recent call last):
    ...
    ValueError: ema_decay must be in (0, 1) or None, got 1.0.
    ```
    """

    top_k: int = field(default=100, metadata={"help": "Candidates kept per refresh, ranked by Rock Score."})
    min_count: int = field(default=2, metadata={"help": "Ids seen fewer times in the window are never candidates."})
    exclude_top_frequent: int = field(
        default=5, metadata={"help": "The most frequent ids in the window, excluded from the candidates."}
    )
    warmup_steps: int = field(
        default=20, metadata={"help": "Optimizer steps of uniform weights before the first refresh."}
    )
    refresh_every: int = field(default=10, metadata={"help": "Optimizer steps between refreshes of the rock set."})
    window: int = field(default=50, metadata={"help": "Optimizer steps of statistics kept (ignored with ema_decay)."})
    ema_decay: float | None = field(
        default=None,
        metadata={"help": "If set, in (0, 1): statistics decay by this factor per step instead of a window."},
    )
    persistence: int = field(
        default=2, metadata={"help": "Consecutive refreshes an id must stay a candidate to become a rock."}
    )
    stagnation_tol: float = field(
        default=0.1,
        metadata={"help": "Largest relative fall of an id's mean divergence over those refreshes for it to be a rock."},
    )
    weight: float = field(default=0.0, metadata={"help": "Weight of rock positions (0 freezes them)."})
    allow_special_tokens: bool = field(
        default=False,
        metadata={"help": "Let stop and control tokens (eos, pad, the chat template's) become rocks; for research "
                  "only: freezing the stop token removes the signal that teaches the student when to stop."},
    )

    def __post_init__(self):
        self.top_k = _check_int(self.top_k, "top_k", 1)
        self.min_count = _check_int(self.min_count, "min_count", 1)
        self.exclude_top_frequent = _check_int(self.exclude_top_frequent, "exclude_top_frequent", 0)
        if not isinstance(self.allow_special_tokens, bool):
            raise ValueError(f"allow_special_tokens must be true or false, got {self.allow_special_tokens!r}.")
        self.warmup_steps = _check_int(self.warmup_steps, "warmup_steps", 0)
        self.refresh_every = _check_int(self.refresh_every, "refresh_every", 1)
        self.window = _check_int(self.window, "window", 1)
        if self.ema_decay is not None and not 0.0 < float(self.ema_decay) < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1) or None, got {self.ema_decay}.")
        self.ema_decay = None if self.ema_decay is None else float(self.ema_decay)
        self.persistence = _check_int(self.persistence, "persistence", 1)
        if not math.isfinite(float(self.stagnation_tol)) or self.stagnation_tol < 0:
            raise ValueError(f"stagnation_tol must be a finite number >= 0, got {self.stagnation_tol}.")
        self.stagnation_tol = float(self.stagnation_tol)
        self.weight = _check_weight(self.weight)


@dataclass
class RandomMatchedConfig(PolicyConfig):
    """Options of the `random_matched` control: a random id set frequency-matched to a rock set gets `weight`.

    Example:
    ```python
    >>> from hf_rockopd.policies import RandomMatchedConfig
    >>> RandomMatchedConfig(rock_set=[1, 2], num_bins=0)
    Traceback (most recent call last):
    ...
    ValueError: num_bins must be an integer >= 1, got 0.
    ```
    """

    rock_set: list[int] | str | os.PathLike | None = field(
        default=None,
        metadata={"help": "The rock ids to match, or a rock-set JSON file (checked against the vocabulary at setup)."},
    )
    reference_counts: dict[int, int] | str | os.PathLike | None = field(
        default=None,
        metadata={
            "help": "Token frequencies to match on: a dict of id -> count, or a JSON file with one (at top level or "
            "under 'counts'). Without it the policy counts the first warmup_steps steps' completion tokens."
        },
    )
    warmup_steps: int = field(
        default=20, metadata={"help": "Steps counted before drawing the control, when reference_counts is not given."}
    )
    num_bins: int = field(default=10, metadata={"help": "Quantile bins of log-frequency to match within."})
    seed: int = field(default=0, metadata={"help": "Seed of the draw (the same on every process)."})
    weight: float = field(default=0.0, metadata={"help": "Weight of the control ids (0 freezes them)."})

    def __post_init__(self):
        _check_required(self.rock_set, "rock_set", "random_matched", "the rock ids or a rock-set JSON file")
        self.warmup_steps = _check_int(self.warmup_steps, "warmup_steps", 0)
        self.num_bins = _check_int(self.num_bins, "num_bins", 1)
        self.seed = int(self.seed)
        self.weight = _check_weight(self.weight)


@dataclass
class LossQuantileConfig(PolicyConfig):
    """Options of the `loss_quantile` baseline: positions above the batch's divergence quantile get `weight`.

    Example:
    ```python
    >>> from hf_rockopd.policies import LossQuantileConfig
    >>> LossQuantileConfig(quantile=1)
    Traceback (most recent call last):
    ...
    ValueError: quantile must be in (0, 1), got 1.
    ```
    """

    quantile: float = field(default=0.9, metadata={"help": "Quantile of the batch's divergences, in (0, 1)."})
    weight: float = field(default=0.0, metadata={"help": "Weight of the positions above it (0 freezes them)."})

    def __post_init__(self):
        if not 0.0 < float(self.quantile) < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {self.quantile}.")
        self.quantile = float(self.quantile)
        self.weight = _check_weight(self.weight)


@dataclass
class EntropyConfig(PolicyConfig):
    """Options of the `entropy` policy: only the highest-entropy `keep_fraction` of positions keeps weight 1.

    Example:
    ```python
    >>> from hf_rockopd.policies import EntropyConfig
    >>> EntropyConfig(keep_fraction=0)
    Traceback (most recent call last):
    ...
    ValueError: keep_fraction must be in (0, 1], got 0.
    ```
    """

    keep_fraction: float = field(
        default=0.2,
        metadata={"help": "Fraction of valid positions, by student entropy, that keep weight 1; in (0, 1]."},
    )
    weight: float = field(default=0.0, metadata={"help": "Weight of the other positions (0 freezes them)."})

    def __post_init__(self):
        if not 0.0 < float(self.keep_fraction) <= 1.0:
            raise ValueError(f"keep_fraction must be in (0, 1], got {self.keep_fraction}.")
        self.keep_fraction = float(self.keep_fraction)
        self.weight = _check_weight(self.weight)
