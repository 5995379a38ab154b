"""Options declared once: a frozen config dataclass's fields are its command-line flags.

A field made with :func:`option` carries its help text (and, where needed, its flag's
spelling, choices, parser, help group and environment variable) in its metadata; a field made
with :func:`nested` holds another such config whose options are flags of the same command. From
the fields alone come:

- the flags of every command that takes the config (:func:`add_options`), their types,
  defaults and help;
- the config built from parsed flags and the environment (:func:`from_args`);
- the flags ``dsmesh up`` forwards to the processes it starts, only those the user gave
  (:func:`given_flags`), and the service options it offers itself (:func:`up_fields`);
- the option tables in the docs (:func:`options_table`).

So removing a field removes its flag from every command, from what ``dsmesh up`` forwards and
from the docs. A field's type annotation picks the flag's form: ``bool`` is a ``--x/--no-x``
switch, ``int``/``float``/``str`` take a value, ``X | None`` takes an ``X`` whose absence means
None (for options whose default is derived at start-up), ``tuple[str, ...]`` is a repeatable
flag; any other type needs ``parse``. The flag is the field's name with dashes, less a
trailing ``_s`` (seconds: ``handoff_timeout_s`` is ``--handoff-timeout``), unless ``flag``
spells it; the parsed value lands under the flag's name (``args.handoff_timeout``). A field with
no default is a flag that must be given.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dsmesh.options import parse as argtypes

_KEY = "dsmesh.option"
_NESTED = "dsmesh.nested"
REQUIRED: Any = dataclasses.MISSING  # ``option(REQUIRED, ...)``: the flag must be given


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True)
class Option:
    """What a field needs to become a flag."""

    help: str
    flag: str | None = None  # default: from the field's name (module docstring)
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # the flag's parser; default: the field's type
    group: str | None = None  # the help group; default: the enclosing config's, else none
    cli: bool = True  # False: set by the program, not a flag (still a documented field)
    forward: bool = True  # ``dsmesh up`` passes it on to the processes it starts, when given
    # ``dsmesh up`` offers this option of a service and forwards it to that service when
    # given: True under the same flag, or up's own spelling of it
    up: bool | str = False
    env: str | None = None  # the environment variable read when the flag is not given
    cli_default: Any = _UNSET  # the flag's default where it differs from the field's
    default_text: str | None = None  # how the help shows the default (e.g. "derived")


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: Iterable[Any] | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    group: str | None = None,
    cli: bool = True,
    forward: bool = True,
    up: bool | str = False,
    env: str | None = None,
    cli_default: Any = _UNSET,
    default_text: str | None = None,
    repr: bool = True,
) -> Any:
    """A dataclass field that is also a flag (module docstring); ``repr=False`` keeps a
    secret out of the config's repr."""
    meta = Option(
        help=help,
        flag=flag,
        choices=tuple(choices) if choices is not None else None,
        metavar=metavar,
        parse=parse,
        group=group,
        cli=cli,
        forward=forward,
        up=up,
        env=env,
        cli_default=cli_default,
        default_text=default_text,
    )
    return dataclasses.field(default=default, repr=repr, metadata={_KEY: meta})


@dataclasses.dataclass(frozen=True)
class Nested:
    """A field that holds another config class whose options are flags of the command."""

    cls: type
    group: str | None  # the help group of its options that name none


def nested(
    cls: type, *, group: str | None = None, default_factory: Callable[[], Any] | None = None
) -> Any:
    """A dataclass field holding a ``cls`` (by default ``cls()``) whose options are flags too."""
    return dataclasses.field(
        default_factory=default_factory or cls, metadata={_NESTED: Nested(cls, group)}
    )


@dataclasses.dataclass(frozen=True)
class OptionField:
    """One option of a config class, resolved: name, flag, value type, default, metadata."""

    name: str
    flag: str
    kind: Any  # bool, int, float, str, or what ``parse`` returns
    optional: bool  # ``X | None``
    many: bool  # ``tuple[X, ...]``: a repeatable flag
    default: Any  # the command line's default; dataclasses.MISSING: the flag must be given
    meta: Option
    owner: type  # the class that declares the field

    @property
    def dest(self) -> str:
        """Where the parsed value lands in the namespace: the flag's name."""
        return self.flag[2:].replace("-", "_")

    @property
    def is_switch(self) -> bool:
        return self.kind is bool and not self.many

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


def flag_of(name: str) -> str:
    """The flag a field named ``name`` gets: dashes for underscores, less a trailing ``_s``."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def _owner(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO that declares field ``name`` (nearest first)."""
    return next(k for k in cls.__mro__ if name in inspect.get_annotations(k))


def option_fields(cls: type) -> list[OptionField]:
    """The fields of ``cls`` (its own and inherited) declared with :func:`option`, in
    declaration order; not those of its nested configs (:func:`nested_fields`)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_KEY)
        if meta is None:
            continue
        where = f"{cls.__name__}.{f.name}"
        kind, optional, many = _value_type(hints[f.name], where, meta.parse is not None)
        default = f.default if meta.cli_default is _UNSET else meta.cli_default
        flag = meta.flag or flag_of(f.name)
        out.append(
            OptionField(f.name, flag, kind, optional, many, default, meta, _owner(cls, f.name))
        )
    return out


def nested_fields(cls: type) -> list[tuple[str, Nested]]:
    """The fields of ``cls`` made with :func:`nested`: name and what they hold."""
    return [(f.name, f.metadata[_NESTED]) for f in dataclasses.fields(cls) if _NESTED in f.metadata]


def all_option_fields(cls: type) -> list[tuple[OptionField, str | None]]:
    """Every option of ``cls`` and of its nested configs (depth first), each with its help
    group: its own, else the nearest enclosing :func:`nested` field's."""
    return _flat(cls, None)


def _flat(cls: type, group: str | None) -> list[tuple[OptionField, str | None]]:
    out = [(f, f.meta.group or group) for f in option_fields(cls)]
    for _, inner in nested_fields(cls):
        out += _flat(inner.cls, inner.group or group)
    return out


def _value_type(hint: Any, where: str, parsed: bool) -> tuple[Any, bool, bool]:
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"{where}: an option is X or X | None, got {hint}")
        return _value_type(rest[0], where, parsed)[0], True, False
    repeated = typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis
    if repeated and args[0] in (int, float, str):
        return args[0], False, True
    if parsed:
        return hint, False, False
    if hint not in (bool, int, float, str):
        raise TypeError(
            f"{where}: an option's type is bool, int, float, str or tuple[X, ...] "
            f"(else give parse=), got {hint}"
        )
    return hint, False, False


def _help(field: OptionField, default: Any) -> str:
    meta = field.meta
    text = meta.help
    if meta.env is not None:
        text += f" (env {meta.env})"
    if meta.default_text is not None:
        shown = meta.default_text
    elif default in (None, "", (), dataclasses.MISSING):
        return text
    elif field.is_switch:
        shown = "on" if default else "off"
    else:
        shown = str(default)
    return f"{text} (default: {shown})"


def option_group(parser: Any, title: str | None) -> Any:
    """The help group titled ``title`` of ``parser`` (made on first use); ``parser`` itself
    when no title, or when ``parser`` is a group already."""
    if title is None or isinstance(parser, argparse._ArgumentGroup):
        return parser
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    defaults: Mapping[str, Any] | None = None,
    skip: Iterable[str] = (),
    only: Iterable[str] | None = None,
    not_given: bool = False,
) -> None:
    """Add a flag for each option field of ``cls`` and of its nested configs, each in its
    help group. ``defaults`` overrides a field's default for this command; ``skip`` leaves
    fields out by name; ``only`` adds just the fields named, even ones marked ``cli=False``;
    ``not_given``: every flag defaults to None, so that the parsed values tell which flags
    were given (``dsmesh up``, which forwards only those)."""
    defaults = defaults or {}
    skipped = set(skip)
    wanted = set(only) if only is not None else None
    for field, title in all_option_fields(cls):
        if wanted is not None:
            if field.name not in wanted:
                continue
        elif not field.meta.cli or field.name in skipped:
            continue
        add_flag(
            option_group(parser, title), field, defaults.get(field.name, field.default), not_given
        )


def add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    field: OptionField,
    default: Any,
    not_given: bool = False,
    flag: str | None = None,
    help: str | None = None,
) -> None:
    """Add ``field``'s flag (spelled ``flag`` when given, with ``help`` when given)."""
    flag = flag or field.flag
    kwargs: dict[str, Any] = {
        "dest": flag[2:].replace("-", "_"),
        "help": help or _help(field, default),
    }
    if default is dataclasses.MISSING and not not_given:
        kwargs["required"] = True
    else:
        # unset: None, and from_args falls back to the environment, then the field's default
        unset = not_given or field.meta.env is not None or field.many
        kwargs["default"] = None if unset else default
    if field.is_switch:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = field.meta.parse or field.kind
        if field.many:
            kwargs["action"] = "append"
        if field.meta.choices is not None:
            kwargs["choices"] = field.meta.choices
        if field.meta.metavar is not None:
            kwargs["metavar"] = field.meta.metavar
    parser.add_argument(flag, **kwargs)


def from_args(
    cls: type, args: argparse.Namespace, *, env: Mapping[str, str] | None = None, **fixed: Any
) -> Any:
    """``cls`` built from the parsed flags of its options, then, for a flag not given, its
    environment variable (``env``, default ``os.environ``), else the field's default; nested
    configs likewise (those whose flags the command has). ``fixed`` gives values for the rest
    (and overrides)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for field in option_fields(cls):
        if field.name in fixed or not field.meta.cli:
            continue
        value = getattr(args, field.dest, None)
        if value is None and field.meta.env is not None:
            value = _from_env(field, env)
        if value is None:
            continue  # not given: the field's default
        if field.many:
            value = tuple(item for item in value if item != "")
        values[field.name] = value
    for name, inner in nested_fields(cls):
        # a command without the nested config's flags keeps the field's default
        parsed = any(hasattr(args, f.dest) for f, _ in all_option_fields(inner.cls))
        if name not in fixed and parsed:
            values[name] = from_args(inner.cls, args, env=env)
    return cls(**{**values, **fixed})


def _from_env(field: OptionField, env: Mapping[str, str]) -> Any:
    var = field.meta.env
    assert var is not None
    text = env.get(var, "").strip()
    if not text:
        return None
    parse = argtypes.switch if field.is_switch else field.meta.parse or field.kind
    try:
        if field.many:
            return tuple(parse(item.strip()) for item in text.split(",") if item.strip())
        return parse(text)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise ValueError(f"{var}: {exc}") from None


def given_flags(
    cls: type, args: argparse.Namespace, *, forward_only: bool = True
) -> tuple[str, ...]:
    """The flags of ``cls``'s options that were given (parsed with ``not_given``), spelled
    for the command line of another process that takes them."""
    out: list[str] = []
    for field in option_fields(cls):
        if not field.meta.cli or (forward_only and not field.meta.forward):
            continue
        out += spell(field, getattr(args, field.dest, None))
    return tuple(out)


def spell(field: OptionField, value: Any) -> list[str]:
    """``field`` set to ``value`` as command-line words (none for None)."""
    if value is None:
        return []
    if field.is_switch:
        return [field.flag if value else f"--no-{field.flag[2:]}"]
    if field.many:
        return [word for item in value for word in (field.flag, str(item))]
    return [field.flag, str(value)]


def up_fields(cls: type) -> list[OptionField]:
    """The options of ``cls`` (not of its nested configs) that ``dsmesh up`` offers."""
    return [f for f in option_fields(cls) if f.meta.up]


def up_flag(field: OptionField) -> str:
    """How ``dsmesh up`` spells an option it offers."""
    return field.meta.up if isinstance(field.meta.up, str) else field.flag


def options_table(
    cls: type,
    *,
    defaults: Mapping[str, Any] | None = None,
    refs: Mapping[type, str] | None = None,
) -> str:
    """A Markdown table of ``cls``'s flags: flag, default, meaning (the docs' option tables).

    A base class or nested config named in ``refs`` (class -> table name) is one row that
    points to its own table; the others' options are rows of this one."""
    refs = refs or {}
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    bases: list[type] = []  # the nearest bases with tables of their own
    for base in cls.__mro__[1:]:
        if base in refs and not any(issubclass(b, base) for b in bases):
            bases.append(base)
            rows.append(f"| *{refs[base]}* | | {_ref_text(base, refs[base])} |")
    for field in option_fields(cls):
        inherited = any(issubclass(b, field.owner) for b in bases)
        if field.meta.cli and not inherited:
            rows.append(_row(field, (defaults or {}).get(field.name, field.default)))
    for name, inner in nested_fields(cls):
        if any(issubclass(b, _owner(cls, name)) for b in bases):
            continue
        if inner.cls in refs:
            text = _ref_text(inner.cls, refs[inner.cls])
            rows.append(f"| *{refs[inner.cls]}* | | `{name}`: {text} |")
        else:
            rows += options_table(inner.cls, refs=refs).splitlines()[2:]
    return "\n".join(rows)


def _ref_text(cls: type, name: str) -> str:
    return f"`{cls.__name__}`, the {name} table"


def _row(field: OptionField, default: Any) -> str:
    if field.meta.default_text is not None:
        shown = field.meta.default_text
    elif field.is_switch:
        shown = f"`{field.flag}`" if default else f"`--no-{field.flag[2:]}`"
    elif field.required:
        shown = "required"
    else:
        shown = "-" if default in (None, "", ()) else f"`{default}`"
    flag = f"`{field.flag}`" + (
        f" {{{','.join(map(str, field.meta.choices))}}}" if field.meta.choices else ""
    )
    if field.many:
        flag += " (repeatable)"
    text = field.meta.help + (f" (env `{field.meta.env}`)" if field.meta.env else "")
    text = text.replace("|", "\\|").replace("<", "&lt;")  # a cell, not HTML
    return f"| {flag} | {shown} | {text} |"
