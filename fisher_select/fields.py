"""Typed dataclasses from untyped mappings (recipes, objective keys): every problem collected.

Config dataclasses document themselves, in PEFT's style: every field is
``field(default=..., metadata={"help": "..."})`` (required ones without a default). The help
text is what the CLI flag, ``recipes show`` and docs/RECIPES.md print. Two optional metadata
entries are checked by ``build_dataclass`` and shown by the same places: ``"choices"`` (the
allowed values) and ``"min"`` (the smallest allowed number). Only this module reads the keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

_HELP, _CHOICES, _MIN = "help", "choices", "min"


def _type_ok(value: Any, annotation) -> bool:
    """A small runtime check of the annotations used in config dataclasses."""
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is not None:
        annotation = origin
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def type_name(annotation) -> str:
    """``int | None`` rather than ``typing.Optional[int]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _at(where: str, key: str) -> str:
    """``where.key``, or ``key`` at the top level (where == "")."""
    return f"{where}.{key}" if where else key


def _said(where: str, text: str) -> str:
    return f"{where}: {text}" if where else text


# ---------------------------------------------------------------------------
# Field metadata


def field_help(f: dataclasses.Field) -> str:
    """A field's help text ("" where none was written yet)."""
    return f.metadata.get(_HELP, "")


def field_choices(f: dataclasses.Field) -> tuple | None:
    choices = f.metadata.get(_CHOICES)
    return tuple(choices) if choices is not None else None


def field_min(f: dataclasses.Field):
    return f.metadata.get(_MIN)


def is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def field_default(f: dataclasses.Field):
    """The default value (a fresh one for ``default_factory``); MISSING for a required field."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def scalar_type(annotation):
    """int, float, str or bool (also inside ``X | None``); None for mappings, lists and the rest."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    return annotation if annotation in (int, float, str, bool) else None


def _notes(f: dataclasses.Field) -> list[str]:
    """Help, allowed values and bound: what a reader of a flag or a doc table needs."""
    notes = [field_help(f).rstrip(".")]
    if field_choices(f) is not None:
        notes.append("one of " + ", ".join(map(str, field_choices(f))))
    if field_min(f) is not None:
        notes.append(f"at least {field_min(f)}")
    return [n for n in notes if n]


def describe_field(f: dataclasses.Field) -> str:
    """Help, allowed values, bound and default in one sentence (CLI help)."""
    if is_required(f):
        return "; ".join([*_notes(f), "required"])
    default = field_default(f)  # None: unset, which the help says the meaning of
    return "; ".join([*_notes(f), *([] if default is None else [f"default {default!r}"])])


# ---------------------------------------------------------------------------
# Building and checking


def _value_problems(f: dataclasses.Field, value: Any, where: str) -> list[str]:
    """Checks the metadata states (choices, min); None always passes (its type was checked)."""
    if value is None:
        return []
    choices = field_choices(f)
    if choices is not None and value not in choices:
        return [f"{_at(where, f.name)}: expected one of {', '.join(map(str, choices))}, got {value!r}"]
    low = field_min(f)
    if low is not None and value < low:
        return [f"{_at(where, f.name)}: must be at least {low}, got {value!r}"]
    return []


def build_dataclass(cls: type, data: Any, where: str, errors: list[str], also_allowed: tuple[str, ...] = ()):
    """Validate ``data`` against ``cls``'s fields; append problems to ``errors``; return an instance or None.

    ``where`` is the key path of ``data`` ("" at the top level); ``also_allowed`` names keys the
    caller handled before (listed among the allowed keys in the unknown-key message).
    """
    if not isinstance(data, dict):
        errors.append(_said(where, f"expected a mapping, got {type(data).__name__}"))
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    allowed = ", ".join(sorted([*fields, *also_allowed]))
    before = len(errors)
    for key in data:
        if key not in fields:
            errors.append(_said(where, f"unknown key {key!r} (allowed: {allowed})"))
    for name, f in fields.items():
        if name not in data:
            if is_required(f):
                errors.append(_said(where, f"missing required key {name!r}"))
        elif not _type_ok(data[name], hints[name]):
            errors.append(f"{_at(where, name)}: expected {type_name(hints[name])}, got {data[name]!r}")
        else:
            errors.extend(_value_problems(f, data[name], where))
    return cls(**data) if len(errors) == before else None


# ---------------------------------------------------------------------------
# Command-line flags and reference tables


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def add_dataclass_arguments(parser, cls: type, include: tuple[str, ...] | None = None,
                            keep_defaults: bool = False) -> list[str]:
    """One ``--flag-name`` per scalar field of ``cls`` (or the ``include``d ones), typed, with its help.

    ``keep_defaults`` False: a flag not given is None (it overrides nothing; values, choices
    included, are checked where the flags are merged, with the rest); True: it is the field's
    default. Returns the destinations (field names) added.
    """
    hints = typing.get_type_hints(cls)
    added = []
    for f in dataclasses.fields(cls):
        kind = scalar_type(hints[f.name])
        if kind is None or (include is not None and f.name not in include):
            continue
        default = field_default(f) if keep_defaults else None
        text = describe_field(f).removesuffix("; required").replace("%", "%%")  # argparse %-formats help
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=default, metavar=_METAVARS[kind], help=text)
        added.append(f.name)
    return added


def fields_table(cls: type, prefix: str = "") -> list[str]:
    """A Markdown table of ``cls``'s fields: key, type, default, description."""
    hints = typing.get_type_hints(cls)
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        default = "required" if is_required(f) else f"`{field_default(f)!r}`"
        cells = [f"`{prefix}{f.name}`", f"`{type_name(hints[f.name])}`", default, "; ".join(_notes(f))]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")  # a | inside a cell
    return lines
