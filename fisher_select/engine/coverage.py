"""Which rule covers which parameter, and the exact fallback for the rest (``plan_coverage``).

A parameter is rule-covered only when every module holding it has a rule; everything else goes
to the engine's exact per-sample fallback (``scoring``), never skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from fisher_select.engine import rules
from fisher_select.errors import FisherSelectError


@dataclass
class _User:
    """One module holding a covered parameter directly."""

    module: nn.Module
    rule: rules.Rule
    local: str  # the parameter's name inside the module


@dataclass
class Coverage:
    """Which rule covers which parameter; the rest go to the exact fallback."""

    users: dict[str, list[_User]] = field(default_factory=dict)  # full name -> users
    fallback: dict[str, nn.Parameter] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    params: dict[str, nn.Parameter] = field(default_factory=dict)

    module_types: dict[str, str] = field(default_factory=dict)  # module name -> class name
    # What the rules say about the model's modules, recorded so a run answers without the model:
    linear_like: list[str] = field(default_factory=list)  # module names LoRA can target
    embeddings: list[str] = field(default_factory=list)  # input embeddings and output head

    def summary(self) -> dict:
        by_rule: dict[str, int] = {}
        for users in self.users.values():
            key = type(users[0].rule).__name__
            by_rule[key] = by_rule.get(key, 0) + 1
        return {"rules": by_rule, "fallback": sorted(self.fallback), "module_types": self.module_types,
                "linear_like": self.linear_like, "embeddings": self.embeddings}


def plan_coverage(model: nn.Module) -> Coverage:
    """Assign every parameter (tied ones once) to rules or the fallback, checking nothing is left.

    A parameter is rule-covered only if every module holding it directly has a rule that accepts
    that module; otherwise all of its gradient comes from the exact fallback.
    """
    names = {id(p): n for n, p in model.named_parameters()}  # first name wins (tied once)
    holders: dict[str, list[tuple[nn.Module, str]]] = {}
    cov = Coverage()
    heads = {id(m) for m in rules.embeddings_and_heads(model)}
    for module_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            holders.setdefault(names[id(p)], []).append((module, local))
            cov.module_types.setdefault(module_name, type(module).__name__)
        if rules.is_linear_like(module):
            cov.linear_like.append(module_name)
        if id(module) in heads:
            cov.embeddings.append(module_name)
    for name, p in model.named_parameters():
        cov.params[name] = p
        users = []
        for module, local in holders[name]:
            rule = rules.lookup(module)
            if rule is None or not rule.accepts(module):
                users = None
                break
            users.append(_User(module, rule, local))
        if users:
            cov.users[name] = users
            cov.shapes[name] = rules.fisher_shape(users[0].module, users[0].local, p)  # packed: logical
        else:
            cov.fallback[name] = p
            cov.shapes[name] = tuple(p.shape)  # autograd's gradient has the stored shape
    missing = set(names.values()) - set(cov.shapes)
    if missing:  # cannot happen unless named_parameters is inconsistent; never skip silently
        raise FisherSelectError(f"parameters not covered by any rule or the fallback: {sorted(missing)[:5]}")
    return cov

def _check_fallback(cov: Coverage) -> None:
    """The fallback differentiates with respect to the parameter: a packed (integer) one has no gradient."""
    packed = [n for n, p in cov.fallback.items() if not p.is_floating_point()]
    if packed:
        raise FisherSelectError(
            f"no rule covers {packed[:3]} ({len(packed)} in all) and they are stored packed (dtype "
            f"{cov.fallback[packed[0]].dtype}), so the exact per-sample fallback cannot differentiate them: a "
            "quantized layer whose class overrides its parent's forward needs a rule of its own "
            "(fisher_select.engine.rules.register), or leave these parameters out with params=")


def _restricted(cov: Coverage, params: "set[str] | None") -> Coverage:
    """The coverage of the chosen parameters only; the others stay frozen (``cov.params``)."""
    if params is None:
        return cov
    unknown = set(params) - set(cov.shapes)
    if unknown:
        raise FisherSelectError(f"params names no parameter of the model: {sorted(unknown)[:5]} "
                                "(use the names model.named_parameters() yields)")
    return replace(cov, users={n: u for n, u in cov.users.items() if n in params},
                   fallback={n: p for n, p in cov.fallback.items() if n in params},
                   shapes={n: s for n, s in cov.shapes.items() if n in params})

