"""The rule registry: which rule covers a module, and the layer questions only rules can answer.

Each rule file registers its rule next to the class (``@register(nn.Linear)``). A module resolves
to the rule of the nearest registered class in ``type(module).__mro__``; failing that, to the
first ``register_fallback`` predicate that matches its class and whose rule accepts it (the
functional norm rule for model-specific ``*Norm`` classes).

Classes of optional packages are registered as ``Lazy`` references (module path + attribute) and
imported only when a model holds a layer whose class comes from that package, so a model without
bitsandbytes layers never imports bitsandbytes.

The layer questions other modules ask (is this Linear-like, what is this parameter's logical
shape, which modules are the input embeddings / output head, keep layers differentiable) are
answered here, from the rules, so no other module lists layer classes.
"""

from __future__ import annotations

import importlib
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from fisher_select.engine.rules.base import Rule


@dataclass(frozen=True)
class Lazy:
    """A class named by its module path and attribute, imported on first need."""

    module: str  # e.g. "bitsandbytes.nn"
    attribute: str  # e.g. "Linear4bit"

    @property
    def package(self) -> str:
        return self.module.split(".")[0]

    def resolve(self) -> type | None:
        try:
            return getattr(importlib.import_module(self.module), self.attribute, None)
        except Exception:  # not installed, or no usable backend: no such layers to cover
            return None


_BY_CLASS: dict[type, Rule] = {}
_PENDING: list[tuple[Lazy, Rule]] = []  # lazy classes not imported yet
_FALLBACKS: list[tuple[Callable[[type], bool], Rule]] = []


def register(*classes: "type | Lazy"):
    """Class decorator: one instance of the decorated ``Rule`` covers modules of ``classes``.

    Modules of subclasses resolve to it too, unless a more specific class is registered.
    """

    def decorate(rule_cls: type[Rule]) -> type[Rule]:
        rule = rule_cls()  # rules hold no state: one instance serves every module
        for cls in classes:
            if isinstance(cls, Lazy):
                _PENDING.append((cls, rule))
            else:
                _BY_CLASS[cls] = rule
        return rule_cls

    return decorate


def register_fallback(matches: Callable[[type], bool]):
    """Class decorator: the rule covers modules no registered class does, when ``matches(type)``."""

    def decorate(rule_cls: type[Rule]) -> type[Rule]:
        _FALLBACKS.append((matches, rule_cls()))
        return rule_cls

    return decorate


def _resolve_pending(mro: tuple[type, ...]) -> None:
    """Import the lazy classes of the modules (or their subpackages) this module's classes come from, once each.

    By module path, not just package: a transformers layer does not import every model file that
    holds a registered class (the MoE rules name four).
    """
    modules = {c.__module__ for c in mro}

    def due_for(lazy: Lazy) -> bool:
        return any(m == lazy.module or m.startswith(lazy.module + ".") for m in modules)

    due = [entry for entry in _PENDING if due_for(entry[0])]
    for entry in due:
        _PENDING.remove(entry)
        cls = entry[0].resolve()
        if cls is not None:
            _BY_CLASS[cls] = entry[1]


def lookup(module: nn.Module) -> Rule | None:
    """The rule for ``module``: nearest registered class in its MRO, then the fallbacks."""
    mro = type(module).__mro__
    if _PENDING:
        _resolve_pending(mro)
    for cls in mro:
        if cls in _BY_CLASS:
            return _BY_CLASS[cls]
    for matches, rule in _FALLBACKS:
        if matches(type(module)) and rule.accepts(module):
            return rule
    return None


# ---------------------------------------------------------------------------
# Layer questions


def is_linear_like(module: nn.Module) -> bool:
    """Whether ``module`` computes ``X W^T + b`` with a 2-D weight (what LoRA can target)."""
    rule = lookup(module)
    return rule is not None and rule.linear_like


def linear_like_names() -> frozenset[str]:
    """Class names of the registered Linear-like classes (lazy ones too, without importing them).

    Only for records that name a module's class but not its rule (older run reports).
    """
    names = {cls.__name__ for cls, rule in _BY_CLASS.items() if rule.linear_like}
    return frozenset(names | {lazy.attribute for lazy, rule in _PENDING if rule.linear_like})


def fisher_shape(module: nn.Module, local: str, param: torch.Tensor) -> tuple[int, ...]:
    """The Fisher's shape for ``module``'s parameter ``local``: packed weights get their logical shape."""
    rule = lookup(module)
    return tuple(param.shape) if rule is None else rule.fisher_shape(module, local, param)


def parameter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Logical shape of every parameter (``named_parameters()`` names, tied ones once)."""
    names = {id(p): n for n, p in model.named_parameters()}
    shapes: dict[str, tuple[int, ...]] = {}
    for module in model.modules():
        for local, p in module.named_parameters(recurse=False):
            shapes.setdefault(names[id(p)], fisher_shape(module, local, p))
    return {n: shapes[n] for n in names.values()}


def embeddings_and_heads(model: nn.Module) -> list[nn.Module]:
    """The model's input embeddings and output head, by identity (``get_*_embeddings``)."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):  # not a transformers model, or no such layer
            continue
        if module is not None and all(module is not m for m in found):
            found.append(module)
    return found


def _rule_modules(model: nn.Module) -> Iterator[tuple[nn.Module, Rule]]:
    for module in model.modules():
        rule = lookup(module)
        if rule is not None:
            yield module, rule


def check_model(model: nn.Module) -> None:
    """Raise ``FisherSelectError`` if some layer cannot be differentiated in its current state."""
    for module, rule in _rule_modules(model):
        rule.check(module)


@contextmanager
def guard_model(model: nn.Module):
    """Keep every layer differentiable while running inference (sampling) on ``model``."""
    with ExitStack() as stack:
        for module, rule in _rule_modules(model):
            stack.enter_context(rule.guard(module))
        yield
