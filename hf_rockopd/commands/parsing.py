"""One command-line dialect for every `hf-rockopd` subcommand: dataclasses parsed by TRL's `TrlParser`.

A subcommand's options are the fields of one or more dataclasses (`field(metadata={"help": ...})`, range checks in
`__post_init__`), so every option comes from a flag spelled like the field (`--max_new_tokens 64`, TRL's style) or
from a YAML file (`--config run.yaml`; flags win). The hyphen spellings of the lab's old argparse
(`--max-new-tokens`) and renamed options (`--use_lora`) still parse for one release, with a `FutureWarning` that
names the new flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from trl import TrlParser

from ..utils.checks import check_at_least, check_range  # re-exported: the options dataclasses' checks

__all__ = ["Command", "CommandParser", "check_at_least", "check_range"]

# Positional fields are parsed into this attribute first, then moved onto the field (see `CommandParser`).
_POSITIONAL = "positional__"


class CommandParser(TrlParser):
    """A `TrlParser` (dataclasses, `--config file.yaml`) with positional fields and deprecated spellings.

    Args:
        dataclass_types: the dataclasses whose fields are the options, parsed in this order.
        positionals: fields that may also be given as positional arguments (`analyze score TABLE`); `--table` and a
            `table:` key in the YAML file work too.
        renamed: old flag -> new flag (e.g. `{"--use_lora": "--use_peft"}`); the old one parses with a
            `FutureWarning`. Every field's hyphen spelling (`--max-new-tokens`) is such an alias.
        prepare: called with the parsed `argparse.Namespace` before the dataclasses are built (to merge options).
        **kwargs: passed to `argparse.ArgumentParser` (`prog`, `description`, ...).

    Example:
    ```python
    >>> from dataclasses import dataclass, field
    >>> from hf_rockopd.commands.parsing import CommandParser
    >>> @dataclass
    ... class Args:
    ...     table: str = field(metadata={"help": "token-table directory"})
    ...     top_k: int = field(default=100, metadata={"help": "rocks kept"})
    >>> CommandParser(Args, positionals=("table",)).parse_args_and_config(["tables/early", "--top_k", "5"])
    (Args(table='tables/early', top_k=5),)
    ```
    """

    def __init__(
        self,
        dataclass_types: type | Iterable[type],
        *,
        positionals: Sequence[str] = (),
        renamed: Mapping[str, str] | None = None,
        prepare: Callable[[argparse.Namespace], None] | None = None,
        **kwargs: Any,
    ):
        super().__init__(dataclass_types, **kwargs)
        self._renamed = dict(renamed or {})
        self._prepare = prepare
        # HfArgumentParser gives every `a_b` field a second flag `--a-b`; one dialect means one spelling in --help, so
        # the hyphen flag leaves the parser and becomes a deprecated alias translated before parsing.
        for action in list(self._actions):
            for option in list(action.option_strings):
                canonical = "--" + option[2:].replace("-", "_")
                if option.startswith("--") and option != canonical and canonical in action.option_strings:
                    action.option_strings.remove(option)
                    del self._option_string_actions[option]
                    self._renamed[option] = canonical
        self._positional_fields: dict[str, bool] = {}
        for name in positionals:
            action = self._option_string_actions[f"--{name}"]
            self._positional_fields[name] = action.required
            action.required = False  # given positionally or by --config; checked after parsing
            self.add_argument(
                _POSITIONAL + name, metavar=name.upper(), nargs="?", default=None, help=f"{action.help} (or --{name})"
            )
        self.add_argument(
            "--config", default=argparse.SUPPRESS, metavar="FILE.yaml",
            help="YAML file of option values (keys are the option names); flags given too win.",
        )
        renames = sorted((old, new) for old, new in self._renamed.items() if "--" + old[2:].replace("-", "_") != new)
        if renames:
            self.epilog = (self.epilog or "") + "Deprecated spellings (removed in the next release): " + ", ".join(
                f"{old} -> {new}" for old, new in renames
            ) + "; and every --hyphen-spelling of an --underscore_option."

    def _translate(self, flag: str) -> str:
        new = self._renamed.get(flag)
        if new is None:
            return flag
        warnings.warn(f"{flag} is deprecated and will be removed in the next release; use {new}.", FutureWarning,
                      stacklevel=4)
        return new

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        """`argparse`'s, after translating deprecated flags; positional fields are moved onto their options."""
        translated = []
        for arg in sys.argv[1:] if args is None else args:
            if isinstance(arg, str) and arg.startswith("--"):
                flag, sep, value = arg.partition("=")
                arg = self._translate(flag) + sep + value
            translated.append(arg)
        namespace, extras = super().parse_known_args(translated, namespace)
        for name, required in self._positional_fields.items():
            value = getattr(namespace, _POSITIONAL + name)
            delattr(namespace, _POSITIONAL + name)
            if value is not None:
                setattr(namespace, name, value)
            if required and getattr(namespace, name, None) is None:
                self.error(f"the following arguments are required: {name.upper()} (or --{name})")
        if self._prepare is not None:
            self._prepare(namespace)
        return namespace, extras

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        """TRL's, with deprecated keys of the YAML file (`use_lora`, `max-new-tokens`) translated."""
        translated = {}
        for key, value in kwargs.items():
            translated[self._translate(f"--{key}")[2:]] = value
        return super().set_defaults_with_config(**translated)


@dataclasses.dataclass(frozen=True)
class Command:
    """One `hf-rockopd` subcommand: the dataclasses of its options and the function that runs it.

    `run` receives the parsed dataclasses in the order of `arguments` (and `argv=` when `with_argv` is set) and returns
    the exit status.

    Example:
    ```python
    >>> from dataclasses import dataclass, field
    >>> from hf_rockopd.commands.parsing import Command
    >>> @dataclass
    ... class Args:
    ...     name: str = field(default="world", metadata={"help": "who to greet"})
    >>> hello = Command("hello", "greet", (Args,), lambda args: print(f"hello {args.name}") or 0)
    >>> hello(["--name", "rocks"])
    hello rocks
    0
    ```
    """

    name: str
    help: str
    arguments: tuple[type, ...]
    run: Callable[..., int]
    positionals: tuple[str, ...] = ()
    renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    prepare: Callable[[argparse.Namespace], None] | None = None
    extend: Callable[[argparse.ArgumentParser], None] | None = None
    with_argv: bool = False

    def parser(self) -> CommandParser:
        """The parser of this subcommand (`--help` lists every option)."""
        parser = CommandParser(
            self.arguments, positionals=self.positionals, renamed=self.renamed, prepare=self.prepare,
            prog=f"hf-rockopd {self.name}", description=self.help,
        )
        parser.set_defaults(**self.defaults)
        if self.extend is not None:
            self.extend(parser)
        return parser

    def parse(self, argv: Sequence[str]) -> tuple[Any, ...]:
        """The dataclasses of `argv` (flags and `--config`); bad values raise `ValueError` naming the field."""
        return tuple(self.parser().parse_args_and_config(list(argv)))

    def __call__(self, argv: Sequence[str]) -> int:
        parsed = self.parse(argv)
        return self.run(*parsed, argv=list(argv)) if self.with_argv else self.run(*parsed)
