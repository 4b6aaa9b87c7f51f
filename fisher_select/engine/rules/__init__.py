"""Per-layer Fisher rules, one file per layer family, one registry.

A rule turns one module call's captured input and its output gradient into per-sample
gradients of the module's own parameters (``Contribution`` objects; see ``base.py``).
Rules are looked up along the module's class hierarchy (``type(module).__mro__``), so a
subclass of ``nn.Linear`` resolves to the Linear rule unless a more specific rule is registered
(bitsandbytes' ``Linear4bit`` is). Model-specific normalisation classes that do not derive
from a torch norm (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ...) resolve by class name to the
functional norm rule, which differentiates the module's own forward per sample.
"""

from __future__ import annotations

from torch import nn

from fisher_select.engine.rules.base import Contribution, Rule, RowSparse
from fisher_select.engine.rules.conv1d import Conv1DRule
from fisher_select.engine.rules.embedding import EmbeddingRule
from fisher_select.engine.rules.linear import LinearRule
from fisher_select.engine.rules.norm import FunctionalNormRule, LayerNormRule, RMSNormRule

_REGISTRY: dict[type, Rule] = {}


def register(cls: type, rule: Rule) -> None:
    """Register ``rule`` for modules whose class is ``cls`` or derives from it."""
    _REGISTRY[cls] = rule


def lookup(module: nn.Module) -> Rule | None:
    """The rule for ``module``: nearest registered class in its MRO, then norm-by-name."""
    if type(module).__module__.startswith("bitsandbytes"):
        _register_bnb_once()
    for cls in type(module).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    if type(module).__name__.endswith("Norm") and FunctionalNormRule.accepts(module):
        return FUNCTIONAL_NORM
    return None


FUNCTIONAL_NORM = FunctionalNormRule()
register(nn.Linear, LinearRule())
register(nn.Embedding, EmbeddingRule())
register(nn.LayerNorm, LayerNormRule())
register(nn.RMSNorm, RMSNormRule())


def _register_transformers() -> None:
    from transformers.pytorch_utils import Conv1D

    register(Conv1D, Conv1DRule())


_BNB_DONE: list[bool] = []


def _register_bnb_once() -> None:
    """bitsandbytes is imported only when a model actually holds one of its layers."""
    if not _BNB_DONE:
        from fisher_select.engine.rules.bnb import register_bnb

        register_bnb(register)
        _BNB_DONE.append(True)


_register_transformers()

__all__ = ["Contribution", "RowSparse", "Rule", "lookup", "register"]
