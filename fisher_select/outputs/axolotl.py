"""axolotl's ``unfrozen_parameters`` from a run: the modules with the most bound mass, one pattern per parameter.

axolotl (and Spectrum's output, which axolotl reads) takes a YAML list under ``unfrozen_parameters:``.
axolotl (``src/axolotl/utils/freeze.py``, ``freeze_layers_except``) freezes every parameter of
``model.named_parameters()`` and unfreezes those a pattern matches: it compiles each pattern after
escaping every ``.`` not followed by ``+`` (``re.sub(r"\\.(?!\\+)", "\\\\.", p)``) and tests
``re.match`` (anchored at the start only). So a pattern here is ``^<name>$`` with its dots left bare
(axolotl escapes them; an escaped ``\\.`` would be escaped twice) and any other regex character
escaped: it matches exactly one parameter name. Spectrum writes module prefixes
(``model.layers.3.mlp.down_proj``), which also match any longer name with the same start; exact
parameter names cannot. axolotl's ``[start:end]`` range suffix is never emitted: it only zeroes
gradients, so weight decay still moves the "frozen" rows (axolotl's own schema says so); a
coordinate mask needs ``FisherMaskCallback``.

Modules are chosen by **bound mass**, the sum over a module's coordinates of ``sqrt(F_i)`` (the
bound ``sqrt(F_i S)`` up to the objective's constant ``sqrt(S)``): the fewest modules holding a
share ``bound_mass`` of the model's total, or the ``top_modules`` largest. The Fisher mass (sum of
F) is dominated by a few huge coordinates and ranks modules badly (docs/TRAPS.md, "Module
aggregates"). Every pattern is checked before anything is written to match at least one
parameter the run recorded (and of the model, when one is given), matched the way axolotl
matches (compile-and-``re.match``): a pattern that silently matches nothing is the commonest
complaint in its tracker.

**MoE experts.** A fused expert tensor (``model.layers.0.mlp.experts.gate_up_proj``, experts along
dim 0, ``stats.experts``) is one parameter: a pattern unfreezes all of its experts or none. axolotl's
range suffix ``[3:4]`` applies to dim 0, i.e. to experts, but only zeroes the other experts' gradients
(weight decay still moves them), so it is not emitted either. The export unfreezes the fused tensor
and names, in the comments and in ``modules[i]["experts"]``, the experts by index with their share of
the module's bound mass: the fewest carrying ``EXPERT_COVER`` of it, and those with F = 0. A
per-expert selection that holds needs ``select --per-module`` masks with ``FisherMaskCallback``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from fisher_select.atomic import write_file
from fisher_select.caveats import MASK_CAVEAT as CAVEAT
from fisher_select.errors import FisherSelectError
from fisher_select.models import check_fingerprint
from fisher_select.outputs.lora import refuse_unmatched
from fisher_select.outputs.config import DEFAULT_BOUND_MASS
from fisher_select.outputs.config import UnfreezeConfig  # noqa: F401  (its former home: imports still work)
from fisher_select.run.load import Run, load_run
from fisher_select.stats.bounds import module_masses
from fisher_select.stats.experts import expert_masses, experts_by_module, fused_experts

AXOLOTL_KEY = "unfrozen_parameters"
EXPERT_COVER = 0.9  # an experts module's comment names the fewest experts holding this share of its bound mass
EXPERT_NOTE = ("a fused MoE expert tensor is unfrozen whole: a pattern cannot select one expert's slice (axolotl's "
               "[start:end] suffix would only zero the other experts' gradients, and weight decay still moves them); "
               "its comment names the experts that carry the mass. For a per-expert selection use fisher-select select "
               "--per-module with FisherMaskCallback")
_RANGE_SUFFIX = re.compile(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$")  # axolotl's LayerNamePattern range syntax
_SHOWN = 5  # names listed in an error before "... and N more"


# ---------------------------------------------------------------------------
# axolotl's pattern semantics (replicated: axolotl pins its own torch / transformers / peft / trl)


def axolotl_pattern(name: str) -> str:
    """The pattern that matches exactly parameter ``name`` under axolotl's rules (module docstring)."""
    return "^" + re.escape(name).replace(r"\.", ".") + "$"


def axolotl_regex(pattern: str) -> re.Pattern:
    """``pattern`` compiled as axolotl's ``LayerNamePattern`` compiles it (its range suffix dropped)."""
    ranged = _RANGE_SUFFIX.match(pattern)
    base = ranged.group(1) if ranged else pattern
    return re.compile(re.sub(r"\.(?!\+)", "\\.", base))


def match_patterns(patterns: list[str], names: list[str]) -> dict[str, list[str]]:
    """Pattern -> the names it unfreezes, tested as axolotl tests them (``re.match``)."""
    compiled = {p: axolotl_regex(p) for p in patterns}
    return {p: [n for n in names if rx.match(n)] for p, rx in compiled.items()}


def check_patterns(patterns: list[str], names: list[str], where: str) -> dict[str, list[str]]:
    """``match_patterns``, refusing any pattern that matches no name of ``where``."""
    matched = match_patterns(patterns, names)
    refuse_unmatched([p for p, hits in matched.items() if not hits], where, "pattern")
    return matched


# ---------------------------------------------------------------------------
# axolotl export


@dataclass
class UnfrozenParameters:
    """An axolotl ``unfrozen_parameters`` list and what it trains."""

    patterns: list[str]  # one per parameter, modules in decreasing bound mass
    modules: list[dict]  # name, bound_share, numel, parameters (chosen modules, same order)
    trainable: int  # parameters the patterns unfreeze (tied weights once, as named_parameters lists them)
    numel: int  # all parameters of the run
    covered: float  # share of the bound mass the chosen modules hold
    selection: dict
    provenance: dict

    def yaml_text(self) -> str:
        """The YAML file: provenance as comments, then ``unfrozen_parameters:`` and its list."""
        lines = [f"# {line}" for line in self._header()]
        lines.append(f"{AXOLOTL_KEY}:")
        for module in self.modules:
            lines.append(f"# {module['name']}: {module['bound_share']:.4f} of the bound mass, "
                         f"{module['numel']:,} parameters")
            if "experts" in module:
                lines.extend(f"#   {line}" for line in _wrap(_experts_comment(module["experts"])))
            lines.extend(f"- {_yaml_scalar(axolotl_pattern(p))}" for p in module["parameters"])
        return "\n".join(lines) + "\n"

    def _header(self) -> list[str]:
        prov = self.provenance
        rule = (f"top {self.selection['top_modules']} modules" if self.selection["top_modules"] is not None
                else f"fewest modules holding {self.selection['bound_mass']:g} of the bound mass")
        return [
            "axolotl unfrozen_parameters written by fisher-select export --format axolotl",
            f"run {prov['run_id']}, model {prov['model']['name']} (fingerprint {prov['model']['fingerprint'].get('id')})",
            f"objective {self.selection['objective'] or '(primary)'}; {rule} (bound mass = sum of sqrt(F))",
            f"{len(self.modules)} modules, {self.covered:.1%} of the bound mass; {self.trainable:,} of "
            f"{self.numel:,} parameters trainable ({self.trainable / self.numel:.2%})",
            "each pattern is ^name$ over model.named_parameters(); axolotl escapes the dots itself",
            *(_wrap(EXPERT_NOTE) if any("experts" in m for m in self.modules) else []),
            *_wrap(prov["caveat"]),
        ]


def _experts_comment(experts: dict) -> str:
    shares = ", ".join(f"{e['expert']}={e['bound_share']:.1%}" for e in experts["by_mass"])
    zero = ", ".join(map(str, experts["zero"])) or "none"
    return (f"experts by index, fewest holding {EXPERT_COVER:.0%} of this module's bound mass: "
            f"{', '.join(map(str, experts['carrying']))}; all by share: {shares}; F = 0: {zero}")


def _name_experts(modules: list[dict], fisher: dict) -> None:
    """Add ``experts`` (per expert index: share of the module's bound mass; the fewest carrying EXPERT_COVER;
    those with F = 0) to every chosen module holding fused expert tensors."""
    grouped = experts_by_module(fused_experts({n: tuple(f.shape) for n, f in fisher.items()}))
    for module in modules:
        if module["name"] not in grouped:
            continue
        bound, _ = expert_masses(fisher, grouped[module["name"]])
        total = math.fsum(bound) or 1.0
        order = sorted(range(len(bound)), key=lambda e: (-bound[e], e))
        carrying, running = [], 0.0
        for e in order:
            if running >= EXPERT_COVER * total or bound[e] == 0.0:
                break
            carrying.append(e)
            running += bound[e]
        module["experts"] = {"by_mass": [{"expert": e, "bound_share": bound[e] / total} for e in order],
                             "carrying": carrying, "zero": [e for e in range(len(bound)) if bound[e] == 0.0]}


def _yaml_scalar(text: str) -> str:
    """``text`` as a YAML list item: plain when YAML reads it back unchanged, else double-quoted (JSON)."""
    try:
        if yaml.safe_load(text) == text:
            return text
    except yaml.YAMLError:
        pass
    return json.dumps(text)


def _wrap(text: str, width: int = 96) -> list[str]:
    words, lines, line = text.split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + ([line] if line else [])


def unfrozen_parameters(
    run: "Run | str | os.PathLike",
    *,
    bound_mass: float | None = None,
    top_modules: int | None = None,
    objective: str | None = None,
    model=None,
) -> UnfrozenParameters:
    """axolotl patterns for the modules of ``run`` with the most bound mass (module docstring).

    Exactly one of ``bound_mass`` (share in (0, 1], default 0.5) and ``top_modules``. Every module with
    a parameter is a candidate (embeddings, norms and heads included, as in Spectrum). ``model``,
    when given, is fingerprint-checked and its ``named_parameters()`` must be matched too.
    """
    run = load_run(run)
    if bound_mass is not None and top_modules is not None:
        raise FisherSelectError("pass --bound-mass or --top-modules, not both")
    if bound_mass is None and top_modules is None:
        bound_mass = DEFAULT_BOUND_MASS
    units = _module_bound_mass(run, objective)
    total = math.fsum(u["bound_mass"] for u in units)
    if not total > 0:
        raise FisherSelectError(f"run {run.run_id} has no bound mass at all (F = 0 everywhere); recalibrate")
    chosen = _choose(units, total, bound_mass, top_modules)
    if model is not None:
        check_fingerprint(run.fingerprint, model, f"run {run.run_id}")
    patterns = [axolotl_pattern(p) for u in chosen for p in u["parameters"]]
    matched = check_patterns(patterns, list(run.fisher), f"the parameters of run {run.run_id}")
    if model is not None:
        model_names = [n for n, _ in model.named_parameters()]
        matched = check_patterns(patterns, model_names, f"the model's named_parameters() ({type(model).__name__})")
        sizes = {n: p.numel() for n, p in model.named_parameters()}
    else:
        sizes = {n: t.numel() for n, t in run.fisher.items()}
    unfrozen = {n for hits in matched.values() for n in hits}
    intended = {p for u in chosen for p in u["parameters"]}
    if unfrozen != intended:  # a pattern reaching past its own parameter: a bug in axolotl_pattern
        raise FisherSelectError(f"patterns unfreeze {sorted(unfrozen ^ intended)[:_SHOWN]} beyond the chosen "
                                "parameters; please report this")
    modules = [{"name": u["name"], "bound_share": u["bound_mass"] / total, "numel": u["numel"],
                "parameters": u["parameters"]} for u in chosen]
    _name_experts(modules, run.fisher_for(objective))
    return UnfrozenParameters(
        patterns=patterns, modules=modules, trainable=sum(sizes[n] for n in unfrozen), numel=sum(sizes.values()),
        covered=math.fsum(u["bound_mass"] for u in chosen) / total,
        selection={"bound_mass": bound_mass, "top_modules": top_modules, "objective": objective},
        provenance=run.provenance(CAVEAT),
    )


def _module_bound_mass(run: Run, objective: str | None) -> list[dict]:
    """Per module (parameters grouped by dotted prefix, as the report groups them): sum of sqrt(F)."""
    fisher = run.fisher_for(objective)
    for name, f in fisher.items():
        if not bool(f.isfinite().all()):
            raise FisherSelectError(f"run {run.run_id}: Fisher of {name} holds NaN/inf values; recalibrate this run")
    units = [{"name": m.name, "parameters": sorted(m.parameters), "numel": m.numel, "bound_mass": m.bound_mass}
             for m in module_masses(fisher).values()]
    return sorted(units, key=lambda u: (-u["bound_mass"], u["name"]))


def _choose(units: list[dict], total: float, share: float | None, top_modules: int | None) -> list[dict]:
    if top_modules is not None:
        if int(top_modules) != top_modules or not 1 <= top_modules <= len(units):
            raise FisherSelectError(f"--top-modules {top_modules} must be an integer in [1, {len(units)}]")
        return units[: int(top_modules)]
    if not 0.0 < float(share) <= 1.0:
        raise FisherSelectError(f"--bound-mass {share} is outside (0, 1]; pass a share such as 0.5")
    chosen, running = [], 0.0
    for unit in units:  # fsum-exact total, running sum in the same order: share 1 takes every module
        chosen.append(unit)
        running = math.fsum(u["bound_mass"] for u in chosen)
        if running >= share * total:
            break
    return chosen


def save_unfrozen_parameters(result: UnfrozenParameters, path: "str | os.PathLike", *,
                             overwrite: bool = False) -> Path:
    """Write ``result.yaml_text()`` atomically; refuses a text YAML would not read back as the list."""
    text = result.yaml_text()
    if yaml.safe_load(text) != {AXOLOTL_KEY: result.patterns}:
        raise FisherSelectError("the axolotl YAML does not read back as its pattern list; please report this")
    return write_file(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"), overwrite=overwrite)


def load_unfrozen_parameters(path: "str | os.PathLike") -> list[str]:
    """The ``unfrozen_parameters`` list of an axolotl config file (as axolotl's YAML loading reads it)."""
    path = Path(path)
    if not path.is_file():
        raise FisherSelectError(f"axolotl config {path} does not exist; pass the --out of `fisher-select export`")
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    patterns = data.get(AXOLOTL_KEY) if isinstance(data, dict) else None
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise FisherSelectError(f"{path} has no {AXOLOTL_KEY}: list of strings; pass an axolotl config")
    return patterns
