"""Options declared once: a frozen config dataclass's fields are its command-line flags.

A field made with :func:`option` carries its help text (and, where needed, its flag's
spelling, choices and parser) in its metadata. From the fields alone come:

- the flags of every command that takes the config (:func:`add_options`), their types,
  defaults and help;
- the config built from parsed flags (:func:`from_args`);
- the flags ``dsmesh up`` forwards to the processes it starts, only those the user gave
  (:func:`given_flags`);
- the options table in the docs (:func:`options_table`).

So removing a field removes its flag from every command, from what ``dsmesh up`` forwards and
from the docs. A field's type annotation picks the flag's form: ``bool`` is a ``--x/--no-x``
switch, ``int``/``float``/``str`` take a value, ``X | None`` takes an ``X`` whose absence means
None (for options whose default is derived at start-up).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

_KEY = "dsmesh.option"


@dataclasses.dataclass(frozen=True)
class Option:
    """What a field needs to become a flag."""

    help: str
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # the flag's parser; default: the field's type
    cli: bool = True  # False: set by the program, not a flag (still a documented field)
    forward: bool = True  # ``dsmesh up`` passes it on to the processes it starts, when given
    default_text: str | None = None  # how the help shows the default (e.g. "derived")


def option(
    default: Any,
    help: str,
    *,
    choices: Iterable[Any] | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    cli: bool = True,
    forward: bool = True,
    default_text: str | None = None,
) -> Any:
    """A dataclass field that is also a flag (module docstring)."""
    meta = Option(
        help=help,
        choices=tuple(choices) if choices is not None else None,
        metavar=metavar,
        parse=parse,
        cli=cli,
        forward=forward,
        default_text=default_text,
    )
    return dataclasses.field(default=default, metadata={_KEY: meta})


@dataclasses.dataclass(frozen=True)
class OptionField:
    """One option of a config class, resolved: name, flag, value type, default, metadata."""

    name: str
    flag: str
    kind: type  # bool, int, float or str
    optional: bool  # ``X | None``
    default: Any
    meta: Option

    @property
    def is_switch(self) -> bool:
        return self.kind is bool


def option_fields(cls: type) -> list[OptionField]:
    """The fields of ``cls`` declared with :func:`option`, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_KEY)
        if meta is None:
            continue
        kind, optional = _value_type(hints[f.name], f"{cls.__name__}.{f.name}")
        out.append(
            OptionField(f.name, "--" + f.name.replace("_", "-"), kind, optional, f.default, meta)
        )
    return out


def _value_type(hint: Any, where: str) -> tuple[type, bool]:
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"{where}: an option is X or X | None, got {hint}")
        return _value_type(rest[0], where)[0], True
    if hint not in (bool, int, float, str):
        raise TypeError(f"{where}: an option's type is bool, int, float or str, got {hint}")
    return hint, False


def _help(field: OptionField, default: Any) -> str:
    meta = field.meta
    if meta.default_text is not None:
        shown = meta.default_text
    elif default is None:
        return meta.help
    elif field.is_switch:
        shown = "on" if default else "off"
    else:
        shown = str(default)
    return f"{meta.help} (default: {shown})"


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    defaults: Mapping[str, Any] | None = None,
    skip: Iterable[str] = (),
    not_given: bool = False,
) -> None:
    """Add a flag for each option field of ``cls``. ``defaults`` overrides a field's default
    for this command; ``not_given``: every flag defaults to None, so that the parsed values
    tell which flags were given (``dsmesh up``, which forwards only those)."""
    defaults = defaults or {}
    skipped = set(skip)
    for field in option_fields(cls):
        if not field.meta.cli or field.name in skipped:
            continue
        default = defaults.get(field.name, field.default)
        kwargs: dict[str, Any] = {
            "dest": field.name,
            "default": None if not_given else default,
            "help": _help(field, default),
        }
        if field.is_switch:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = field.meta.parse or field.kind
            if field.meta.choices is not None:
                kwargs["choices"] = field.meta.choices
            if field.meta.metavar is not None:
                kwargs["metavar"] = field.meta.metavar
        parser.add_argument(field.flag, **kwargs)


def from_args(cls: type, args: argparse.Namespace, **fixed: Any) -> Any:
    """``cls`` built from the parsed flags of its options (absent ones keep the field's
    default) and ``fixed`` values for the rest."""
    values = {
        f.name: getattr(args, f.name)
        for f in option_fields(cls)
        if f.meta.cli and hasattr(args, f.name)
    }
    return cls(**{**values, **fixed})


def given_flags(
    cls: type, args: argparse.Namespace, *, forward_only: bool = True
) -> tuple[str, ...]:
    """The flags of ``cls``'s options that were given (parsed with ``not_given``), spelled
    for the command line of another process that takes them."""
    out: list[str] = []
    for field in option_fields(cls):
        if not field.meta.cli or (forward_only and not field.meta.forward):
            continue
        value = getattr(args, field.name, None)
        if value is None:
            continue
        if field.is_switch:
            out.append(field.flag if value else f"--no-{field.flag[2:]}")
        else:
            out += [field.flag, str(value)]
    return tuple(out)


def options_table(cls: type, *, defaults: Mapping[str, Any] | None = None) -> str:
    """A Markdown table of ``cls``'s flags: flag, default, meaning (the docs' option table)."""
    defaults = defaults or {}
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for field in option_fields(cls):
        if not field.meta.cli:
            continue
        default = defaults.get(field.name, field.default)
        if field.meta.default_text is not None:
            shown = field.meta.default_text
        elif field.is_switch:
            shown = f"`{field.flag}`" if default else f"`--no-{field.flag[2:]}`"
        else:
            shown = "-" if default is None else f"`{default}`"
        flag = f"`{field.flag}`" + (
            f" {{{','.join(map(str, field.meta.choices))}}}" if field.meta.choices else ""
        )
        text = field.meta.help.replace("|", "\\|")
        rows.append(f"| {flag} | {shown} | {text} |")
    return "\n".join(rows)
