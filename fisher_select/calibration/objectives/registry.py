"""Objective types by recipe name: each type's config dataclass and the builder of its objective.

Reading, checking and explaining a recipe needs only the config dataclasses (``config``, no
torch); the built-in objectives' modules need torch, so their builders are named here as
``module:function`` and imported by ``build_objective`` when an objective is built.
"""

from __future__ import annotations

import importlib
from typing import Callable

from fisher_select.calibration.objectives.config import OPDFullConfig, OPDPGConfig, RLConfig, SFTConfig

_HERE = "fisher_select.calibration.objectives"
# type name -> (config dataclass, builder(config, recipe_dir) -> Objective, or its "module:function")
OBJECTIVE_TYPES: dict[str, tuple[type, Callable | str]] = {
    "rl": (RLConfig, f"{_HERE}.rl:build_rl"),
    "opd-pg": (OPDPGConfig, f"{_HERE}.distill:build_opd_pg"),
    "opd-full": (OPDFullConfig, f"{_HERE}.distill:build_opd_full"),
    "sft": (SFTConfig, f"{_HERE}.sft:build_sft"),
}


def type_of(cfg) -> str:
    """The type name of an objective config."""
    for name, (cls, _) in OBJECTIVE_TYPES.items():
        if isinstance(cfg, cls):
            return name
    raise AssertionError(f"unregistered objective config {type(cfg).__name__}")


def build_objective(cfg, base_dir=None):
    """The objective of a config (relative paths in it relative to ``base_dir``)."""
    builder = OBJECTIVE_TYPES[type_of(cfg)][1]
    if isinstance(builder, str):
        module, name = builder.split(":")
        builder = getattr(importlib.import_module(module), name)
    return builder(cfg, base_dir)
