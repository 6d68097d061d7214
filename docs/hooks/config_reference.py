"""MkDocs hook: the configuration reference, generated at build time from the dataclasses themselves.

A page writes a directive as an HTML comment on its own line, and this hook replaces it with a Markdown table of
the dataclass's fields: name, type, default (a `default_factory` is called) and `metadata["help"]`. Nothing in the
tables is written by hand, so a field added, renamed or re-documented in the code is in the next build.

    <!-- config-fields: hf_rockopd.distill.DistillArguments -->
        every field of the class (inherited ones included);
    <!-- config-fields: hf_rockopd.trainers.RockOPDConfig from=hf_rockopd.trainers.fields.RockTokenArguments own -->
        only the fields declared by the classes after `from=` (comma-separated) and, with `own`, those the class
        declares in its own body (for the TRL configs: their rock-token fields and changed defaults, not the 150
        fields of `TrainingArguments`); defaults are the named class's;
    <!-- policy-configs -->
        one table per registered token policy (`hf_rockopd.policies.available_policies()`), from its `config_class`;
    <!-- commands -->
        every `hf-rockopd` subcommand (`hf_rockopd.cli.commands()`) with links to the tables of its option classes.

A command option class that no `config-fields` directive of the page renders is a warning, so `mkdocs build
--strict` fails when a new command or option class is not documented here.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import logging
import re


log = logging.getLogger("mkdocs.hooks.config_reference")

DIRECTIVE = re.compile(r"^<!--\s*(config-fields|policy-configs|commands)\s*:?\s*(.*?)\s*-->\s*$", re.M)


def _import(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def anchor(cls: type) -> str:
    """The id of a class's heading on the reference page (its name, lowercased)."""
    return cls.__name__.lower()


def _type_name(tp) -> str:
    if isinstance(tp, str):
        text = tp
    elif isinstance(tp, type):
        text = tp.__name__
    else:
        text = str(tp)
    return text.replace("typing.", "").replace("NoneType", "None")


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "*required*"
    if hasattr(value, "value") and type(value).__module__ != "builtins":  # enums, e.g. TrainingArguments' strategies
        value = value.value
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return _code(text)


def _code(text: str) -> str:
    """A Markdown code span that holds any text (backticks included) inside a table cell."""
    ticks = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _cell(text: str) -> str:
    """Help text as one table cell: one line, pipes escaped, raw `<...>` shown as text outside code spans."""
    text = " ".join(str(text).split())
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: show the text as is
        parts = [text]
    for i in range(0, len(parts), 2):
        parts[i] = html.escape(parts[i], quote=False)
    return "`".join(parts).replace("|", "\\|")


def _own_names(cls: type) -> set[str]:
    return set(vars(cls).get("__annotations__", {}))


def field_rows(cls: type, only: set[str] | None = None) -> list[dataclasses.Field]:
    """The fields of `cls` to document: all of them, or those named in `only`, in the class's field order."""
    return [f for f in dataclasses.fields(cls) if only is None or f.name in only]


def fields_table(cls: type, only: set[str] | None = None) -> str:
    rows = field_rows(cls, only)
    if not rows:
        return "*No options.*\n"
    lines = ["| option | type | default | what it does |", "| --- | --- | --- | --- |"]
    for f in rows:
        help_text = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        if choices:
            help_text = f"{help_text} Choices: {', '.join(map(str, choices))}."
        lines.append(f"| {_code(f.name)} | {_code(_type_name(f.type))} | {_default(f)} | {_cell(help_text)} |")
    return "\n".join(lines) + "\n"


def _config_fields(arguments: str, rendered: set[type]) -> str:
    words = arguments.split()
    if not words:
        raise ValueError("config-fields needs a dotted class name")
    cls = _import(words[0])
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"config-fields: {words[0]} is not a dataclass")
    only: set[str] | None = None
    for word in words[1:]:
        if word.startswith("from="):
            only = only or set()
            for name in word[len("from="):].split(","):
                only |= {f.name for f in dataclasses.fields(_import(name))}
        elif word == "own":
            only = (only or set()) | _own_names(cls)
        else:
            raise ValueError(f"config-fields: unknown option {word!r}")
    rendered.add(cls)
    source = f"`{cls.__module__}.{cls.__qualname__}`"
    note = "" if only is None else " (the fields listed below; the others are the base class's)"
    return f"Fields of {source}{note}:\n\n{fields_table(cls, only)}"


def _policy_configs(rendered: set[type]) -> str:
    from hf_rockopd.policies import available_policies
    from hf_rockopd.policies.base import policy_config_class

    out = []
    for name in available_policies():
        config = policy_config_class(name)
        out.append(f"### `{name}`\n")
        if config is None:
            out.append("No options dataclass: its keyword arguments are checked against its constructor.\n")
            continue
        rendered.add(config)
        doc = (config.__doc__ or "").strip().split("\n\n")[0]
        out.append(f"{_cell(doc)}\n\n`rock_policy_kwargs` keys, or `--policy.NAME` flags, or "
                   f"`config={config.__name__}(...)`; `{config.__module__}.{config.__name__}`:\n")
        out.append(fields_table(config))
    return "\n".join(out)


def _commands(text: str) -> str:
    from hf_rockopd.cli import commands

    lines = ["| command | what it does | options (tables below) |", "| --- | --- | --- |"]
    for name, command in sorted(commands().items()):
        links = ", ".join(f"[`{cls.__name__}`](#{anchor(cls)})" for cls in command.arguments)
        positionals = " ".join(f"{p.upper()}" for p in command.positionals)
        usage = f"hf-rockopd {name}" + (f" {positionals}" if positionals else "")
        lines.append(f"| {_code(usage)} | {_cell(command.help)} | {links} |")
    return "\n".join(lines) + "\n"


def _check_commands_documented(page_path: str, rendered: set[type]) -> None:
    from hf_rockopd.cli import commands

    for name, command in sorted(commands().items()):
        for cls in command.arguments:
            if cls not in rendered:
                log.warning(
                    "%s: `hf-rockopd %s` takes %s.%s, which no config-fields directive of the page renders",
                    page_path, name, cls.__module__, cls.__qualname__,
                )


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if not DIRECTIVE.search(markdown):
        return markdown
    rendered: set[type] = set()
    has_commands = False

    def replace(match: re.Match) -> str:
        nonlocal has_commands
        kind, arguments = match.group(1), match.group(2)
        if kind == "config-fields":
            return _config_fields(arguments, rendered)
        if kind == "policy-configs":
            return _policy_configs(rendered)
        has_commands = True
        return _commands(markdown)

    markdown = DIRECTIVE.sub(replace, markdown)
    if has_commands:
        _check_commands_documented(page.file.src_path, rendered)
    return markdown
