"""Typed dataclasses from untyped mappings (recipes, objective keys): every problem collected."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


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


def _type_name(annotation) -> str:
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


def build_dataclass(cls: type, data: Any, where: str, errors: list[str]):
    """Validate ``data`` against ``cls``'s fields; append problems to ``errors``; return an instance or None."""
    if not isinstance(data, dict):
        errors.append(f"{where}: expected a mapping, got {type(data).__name__}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    ok = True
    for key in data:
        if key not in fields:
            errors.append(f"{where}: unknown key {key!r} (allowed: {', '.join(sorted(fields))})")
            ok = False
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in data:
            if required:
                errors.append(f"{where}: missing required key {name!r}")
                ok = False
            continue
        if not _type_ok(data[name], hints[name]):
            errors.append(f"{where}.{name}: expected {_type_name(hints[name])}, got {data[name]!r}")
            ok = False
    return cls(**data) if ok else None
