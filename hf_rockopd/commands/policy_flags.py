"""A token policy's options as flags: `--rock_policy rock_online --policy.top_k 50 --policy.warmup_steps 6`.

Each registered policy with a typed options dataclass (`hf_rockopd.policies.policy_config_class`) gets one
`--policy.NAME` flag per field, listed in `--help` with the field's help. A flag's text is read with the field's type
(YAML syntax: `50`, `0.5`, `true`, `[1, 2]`; `str` fields as given) and merged over `--rock_policy_kwargs` (a dict in
the YAML file or a JSON object string), flags winning. The merged dict is validated once, by `RockOPDConfig`. A YAML
`--config` may set them too (`policy.top_k: 50`). A policy without an options class (a third-party one registered
without it) takes its options through `--rock_policy_kwargs` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from ..policies import available_policies

try:
    from ..policies import policy_config_class
except ImportError:  # before the typed policy configs: every policy takes --rock_policy_kwargs only

    def policy_config_class(name: str) -> type | None:
        """No policy has a typed options class yet."""
        return None


__all__ = ["PREFIX", "add_policy_options", "policy_options", "pop_policy_options"]

PREFIX = "policy."


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def add_policy_options(parser: argparse.ArgumentParser) -> None:
    """Add `--policy.NAME` for each option of each registered policy that has a typed options class.

    A name shared by several policies is one flag; its help says which policy means what by it.
    """
    owners: dict[str, list[tuple[str, dataclasses.Field]]] = {}
    for policy in available_policies():
        cls = policy_config_class(policy)
        if cls is not None:
            for name, f in _fields(cls).items():
                owners.setdefault(name, []).append((policy, f))
    if not owners:
        return
    group = parser.add_argument_group(
        "token-policy options",
        "Options of the --rock_policy chosen, one flag per field (read as YAML: 50, 0.5, true, [1, 2]); merged over "
        "--rock_policy_kwargs, the flags winning.",
    )
    for name, users in sorted(owners.items()):
        described = "; ".join(f"{policy}: {f.metadata.get('help', f.name)}" for policy, f in users)
        group.add_argument(
            f"--{PREFIX}{name}", dest=PREFIX + name, default=argparse.SUPPRESS, metavar=name.upper(), help=described
        )


def pop_policy_options(namespace: argparse.Namespace) -> dict[str, Any]:
    """Remove the `--policy.NAME` values from a parsed namespace and return them by NAME.

    Example:
    ```python
    >>> import argparse
    >>> from hf_rockopd.commands.policy_flags import pop_policy_options
    >>> namespace = argparse.Namespace(**{"rock_policy": "rock_online", "policy.top_k": "50"})
    >>> pop_policy_options(namespace), vars(namespace)
    ({'top_k': '50'}, {'rock_policy': 'rock_online'})
    ```
    """
    found = {key[len(PREFIX):]: value for key, value in vars(namespace).items() if key.startswith(PREFIX)}
    for name in found:
        delattr(namespace, PREFIX + name)
    return found


def _read(value: Any, hint: Any) -> Any:
    if not isinstance(value, str):
        return value  # already typed (a YAML file)
    args = set(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, types.UnionType) else {hint}
    if args <= {str, type(None)}:
        return value
    try:
        read = yaml.safe_load(value)
    except yaml.YAMLError:
        return value  # the options class says what is wrong with it
    if float in args and isinstance(read, int) and not isinstance(read, bool):
        read = float(read)
    return read


def policy_options(policy: str, flags: Mapping[str, Any]) -> dict[str, Any]:
    """Typed values of `--policy.NAME` flags for `policy` (each read with its field's type).

    Raises `ValueError` naming the flag when `policy` has no such option.
    """
    cls = policy_config_class(policy)
    if cls is None:
        raise ValueError(
            f"rock_policy {policy!r} has no typed options, so --{PREFIX}{next(iter(flags))} cannot set one; pass its "
            "options with --rock_policy_kwargs (a JSON object)."
        )
    fields = _fields(cls)
    unknown = [name for name in flags if name not in fields]
    if unknown:
        raise ValueError(
            f"--{PREFIX}{unknown[0]} is not an option of rock_policy {policy!r}; its options: "
            + ", ".join(f"--{PREFIX}{name}" for name in fields)
            + "."
        )
    hints = typing.get_type_hints(cls)
    return {name: _read(value, hints[name]) for name, value in flags.items()}
