"""Which modules an adapter method (LoRA, SHiRA) targets: Linear-like modules ranked by a module mass.

Targets are Linear-like modules (a 2-D ``.weight``; input embeddings and the output head are
excluded), named by their **full** module names. PEFT matches a ``target_modules`` entry as the
full name or a ``.``-suffix of it, so a full name picks exactly one module; ``check_unambiguous``
makes sure no other module of the run ends with ``.<target>``, so the match is one-to-one.

Modules rank by one of two masses (``settings.RANKINGS``), never confused: the **bound mass**, the sum of
sqrt(F) over the module (the sum of its bounds up to sqrt(S)), which tracks how much training
moves a module, and the **Fisher mass**, the sum of F, dominated by a few huge coordinates
(docs/VALIDATION.md measures both). The default is the bound mass.

With ``experts=True`` (LoRA), the 3-D fused expert weights of an MoE model (``stats.experts``) are
candidates too, as **parameter** targets named by their full parameter name (PEFT's
``target_parameters``): they have no Linear module. Their masses are the tensor's sums over every
expert (what a target covers); ``Target.rank_mass`` divides by the number of experts, since PEFT gives
every expert of the tensor an adapter of the same rank. Their 2-D biases (gpt-oss) are not targets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fisher_select.engine import rules
from fisher_select.errors import FisherSelectError
from fisher_select.models import check_fingerprint
from fisher_select.run.load import Run
from fisher_select.run.schema import ModuleEntry
from fisher_select.stats.bounds import module_masses
from fisher_select.stats.experts import fused_experts

# Input embeddings / output heads by name, only for reports that record neither the rules' roles
# (``coverage["embeddings"]``, written by calibrate) nor come with the model.
_EMBEDDING_NAME = re.compile(r"(^|\.)(lm_head|embed_out|wte|wpe|[^.]*embed[^.]*)$")
# PEFT's own layer-index pattern (check_target_module_exists, layers_pattern=None).
_LAYER_INDEX = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")


@dataclass
class Target:
    """A candidate module with both of its masses."""

    name: str
    bound_mass: float  # sum of sqrt(F) over the module's parameters
    fisher_mass: float  # sum of F
    shape: tuple[int, int]  # weight shape as stored in the run (out, in) for nn.Linear
    kind: str | None  # class name, when known
    num_experts: int | None = None  # a fused expert weight (a PEFT target_parameters entry); shape is one expert's

    def mass(self, ranking: str) -> float:
        return self.bound_mass if ranking == "bound_mass" else self.fisher_mass

    def rank_mass(self, ranking: str) -> float:
        """The mass a rank is allocated by: per expert for a fused expert weight (one rank for every expert)."""
        return self.mass(ranking) / (self.num_experts or 1)

    @property
    def lora_parameters(self) -> int:
        """LoRA parameters per unit of rank: in + out, times the experts for a fused expert weight."""
        return sum(self.shape) * (self.num_experts or 1)


def eligible(run: Run, *, module_types, model, layers, modules, experts: bool = False) -> list[Target]:
    """Linear-like modules of the run (and with ``experts`` its fused expert weights), filtered by type (None:
    any), layer index and ``modules``."""
    if model is not None:
        check_fingerprint(run.fingerprint, model, f"run {run.run_id}")
    heads = set() if model is None else {id(m) for m in rules.embeddings_and_heads(model)}
    found = []
    for entry in run.report.modules:
        weight = run.fisher.get(f"{entry.name}.weight")
        if weight is None or weight.dim() != 2:
            continue
        kind, linear, is_head = _describe(entry, run, model, heads)
        if is_head or not linear or (module_types is not None and kind not in module_types):
            continue
        if layers is not None and layer_index(entry.name) not in layers:
            continue
        found.append(Target(entry.name, float(entry.bound_mass), float(entry.fisher_mass), tuple(weight.shape), kind))
    if experts:
        found += [t for t in expert_targets(run) if (module_types is None or t.kind in module_types)
                  and (layers is None or layer_index(t.name) in layers)]
    found = _restrict(found, modules, run)
    if not found:
        raise FisherSelectError(
            f"run {run.run_id} has no eligible Linear-like module (types {list(module_types or ['any'])}, "
            f"layers {layers}); widen --layers / --modules"
        )
    return found


def expert_targets(run: Run) -> list[Target]:
    """The run's 3-D fused expert weights as parameter targets (kind: the experts module's recorded class)."""
    kinds = {e.name: e.type for e in run.report.modules}
    out = []
    for name, fused in fused_experts({n: tuple(f.shape) for n, f in run.fisher.items()}).items():
        if len(fused.shape) != 3:
            continue  # an (E, X) bias: PEFT would adapt it as one (E x X) Linear, which it is not
        mass = module_masses({name: run.fisher[name]})[fused.module]
        out.append(Target(name, mass.bound_mass, mass.fisher_mass, fused.shape[1:], kinds.get(fused.module),
                          fused.num_experts))
    return out


def _describe(entry: ModuleEntry, run: Run, model, heads: set[int]) -> tuple[str | None, bool, bool]:
    """(class name or None, Linear-like, input embedding / output head) of one report entry.

    Asked of the layer rules: on the model's own module when the model is given, else as the
    rules recorded them at calibration (``coverage``). Reports recording neither (hand-made or
    migrated ones) fall back to the recorded class name and the module name.
    """
    name = entry.name
    if model is not None:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise FisherSelectError(
                f"run lists module {name}, which the model does not have; load the model of the run"
            ) from None
        return type(module).__name__, rules.is_linear_like(module), id(module) in heads
    recorded = run.report.coverage
    if "linear_like" in recorded and "embeddings" in recorded:
        return entry.type, name in recorded["linear_like"], name in recorded["embeddings"]
    linear = entry.type is None or entry.type in rules.linear_like_names()
    return entry.type, linear, bool(_EMBEDDING_NAME.search(name))


def layer_index(name: str) -> int | None:
    match = _LAYER_INDEX.match(name)
    return int(match.group("idx")) if match else None


def _restrict(found: list[Target], modules, run: Run) -> list[Target]:
    """Keep modules named (full name or ``.``-suffix, as PEFT matches) in ``modules``."""
    if not modules:
        return found
    for wanted in modules:
        if not any(_matches(m.name, wanted) for m in found):
            raise FisherSelectError(
                f"no eligible module of run {run.run_id} is named {wanted!r} "
                "(full name or suffix such as 'q_proj'); check the names in its report"
            )
    return [m for m in found if any(_matches(m.name, w) for w in modules)]


def _matches(name: str, wanted: str) -> bool:
    return name == wanted or name.endswith("." + wanted)


def choose(found: list[Target], coverage, top_n, ranking: str) -> tuple[list[Target], float]:
    """Targets by decreasing ``ranking`` mass: the first ``top_n``, or the fewest reaching ``coverage``.

    Coverage is a share of the eligible modules' total mass. Returns (targets, share covered).
    """
    if coverage is not None and top_n is not None:
        raise FisherSelectError("pass either --coverage or --top-n, not both")
    order = sorted(found, key=lambda m: (-m.mass(ranking), m.name))
    total = sum(m.mass(ranking) for m in order)
    if total <= 0:
        raise FisherSelectError("eligible modules carry no Fisher mass; recalibrate the run")
    if top_n is not None:
        if not 1 <= int(top_n) <= len(order) or int(top_n) != top_n:
            raise FisherSelectError(f"--top-n {top_n} must be an integer in [1, {len(order)}]")
        chosen = order[: int(top_n)]
    else:
        coverage = float(coverage)
        if not 0.0 < coverage <= 1.0:
            raise FisherSelectError(f"--coverage {coverage} is outside (0, 1]; pass e.g. 0.9")
        chosen, running = [], 0.0
        for m in order:  # the same summation order as ``total``, so coverage=1 reaches it
            chosen.append(m)
            running += m.mass(ranking)
            if running >= coverage * total:
                break
    return chosen, sum(m.mass(ranking) for m in chosen) / total


def check_unambiguous(targets: list[Target], run: Run, model) -> None:
    """No other module name may end in ``.<target>`` (PEFT would match it too)."""
    names = {e.name for e in run.report.modules}
    if model is not None:
        names.update(name for name, _ in model.named_modules())
    for t in targets:
        clash = sorted(n for n in names if n.endswith("." + t.name))
        if clash:
            raise FisherSelectError(
                f"target {t.name} is also a suffix of {clash[0]}; PEFT would adapt both, "
                "so fisher_select cannot name it unambiguously"
            )
