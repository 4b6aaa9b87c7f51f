"""Per-layer Fisher rules, one file per layer family, each registering itself.

A rule turns one module call's captured input and its output gradient into per-sample
gradients of the module's own parameters (``Contribution`` objects; see ``base.py``). Each rule
file registers its rule next to the class (``@register(nn.Linear)``, see ``registry.py``), and
every module of this package is imported here, so a new layer family is one new file (plus its
test). Rules are looked up along the module's class hierarchy (``type(module).__mro__``), so a
subclass of ``nn.Linear`` resolves to the Linear rule unless a more specific rule is registered
(bitsandbytes' ``Linear4bit`` is) or it overrides ``forward`` (then it computes something the
Linear rule does not model, and goes to the engine's exact per-sample fallback). Model-specific normalisation classes that do not derive
from a torch norm (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ...) resolve by class name to the
functional norm rule, which differentiates the module's own forward per sample.

The layer questions (``is_linear_like``, ``fisher_shape`` / ``parameter_shapes`` for packed
weights, ``embeddings_and_heads``, ``check_model`` / ``guard_model``) are answered here too.
"""

from __future__ import annotations

import importlib
import pkgutil

from fisher_select.engine.rules.base import Contribution, Rule, RowSparse
from fisher_select.engine.rules.registry import (
    Lazy,
    check_model,
    embeddings_and_heads,
    fisher_shape,
    guard_model,
    is_linear_like,
    linear_like_names,
    lookup,
    parameter_shapes,
    register,
    register_fallback,
    same_computation,
)

for _info in pkgutil.iter_modules(__path__):  # each rule file registers its rules on import
    importlib.import_module(f"{__name__}.{_info.name}")

__all__ = [
    "Contribution",
    "Lazy",
    "RowSparse",
    "Rule",
    "check_model",
    "embeddings_and_heads",
    "fisher_shape",
    "guard_model",
    "is_linear_like",
    "linear_like_names",
    "lookup",
    "parameter_shapes",
    "register",
    "register_fallback",
    "same_computation",
]
