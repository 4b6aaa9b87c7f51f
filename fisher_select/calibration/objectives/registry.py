"""Objective types by recipe name. Each objective file registers itself when it is imported."""

from __future__ import annotations

from typing import Callable

# type name -> (config dataclass, builder(config, recipe_dir) -> Objective)
OBJECTIVE_TYPES: dict[str, tuple[type, Callable]] = {}


def register_objective(type_name: str, config_cls: type, builder: Callable) -> None:
    OBJECTIVE_TYPES[type_name] = (config_cls, builder)
