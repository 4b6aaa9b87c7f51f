"""Configs for other trainers from a run: axolotl's ``unfrozen_parameters``, PEFT adapter directories.

**axolotl** (and Spectrum's output, which axolotl reads): a YAML list under ``unfrozen_parameters:``.
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
share ``mass`` of the model's total, or the ``top_modules`` largest. The sum of F itself is
dominated by a few huge coordinates and ranks modules badly (PITFALLS.md, "Module aggregates").

**PEFT**: a directory holding ``adapter_config.json`` (LoraConfig fields only, so
``LoraConfig.from_pretrained(dir)`` loads it without an unknown-key warning) and
``fisher_select_provenance.json`` beside it (run id, model fingerprint, targets, ranks); see
``peft_hints.save_lora_config``.

Both are checked before anything is written: every pattern or target must match at least one
parameter / module the run recorded (and of the model, when one is given), matched the way the
consumer matches (axolotl's compile-and-``re.match``; PEFT's own ``check_target_module_exists``).
A pattern that silently matches nothing is the commonest complaint in both tools' trackers.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fisher_select.atomic import write_file
from fisher_select.errors import FisherSelectError
from fisher_select.models import check_fingerprint
from fisher_select.outputs.selection import CAVEAT
from fisher_select.report.statistics import module_of
from fisher_select.rundir import Run, load_run

AXOLOTL_KEY = "unfrozen_parameters"
FORMATS = ("axolotl", "peft")
_RANGE_SUFFIX = re.compile(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$")  # axolotl's LayerNamePattern range syntax
_SHOWN = 5  # names listed in an error before "... and N more"


@dataclass
class UnfreezeSettings:
    """How ``fisher-select export --format axolotl`` chooses the modules to train."""

    mass: float | None = field(default=None, metadata={
        "help": "the fewest modules holding this share of the model's bound mass (sum of sqrt(F)); "
                "default 0.5 when --top-modules is not given"})
    top_modules: int | None = field(default=None, metadata={
        "help": "the N modules with the most bound mass", "min": 1})


DEFAULT_MASS = 0.5


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
    _refuse_unmatched([p for p, hits in matched.items() if not hits], where, "pattern")
    return matched


def _refuse_unmatched(missing: list[str], where: str, what: str) -> None:
    if not missing:
        return
    shown = ", ".join(missing[:_SHOWN]) + (f" ... and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else "")
    raise FisherSelectError(
        f"{len(missing)} {what}(s) match nothing in {where}: {shown}; the run and the model differ "
        "(recalibrate on this model, or export for the model the run was computed on)"
    )


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
            lines.extend(f"- {_yaml_scalar(axolotl_pattern(p))}" for p in module["parameters"])
        return "\n".join(lines) + "\n"

    def _header(self) -> list[str]:
        prov = self.provenance
        rule = (f"top {self.selection['top_modules']} modules" if self.selection["top_modules"] is not None
                else f"fewest modules holding {self.selection['mass']:g} of the bound mass")
        return [
            "axolotl unfrozen_parameters written by fisher-select export --format axolotl",
            f"run {prov['run_id']}, model {prov['model']['name']} (fingerprint {prov['model']['fingerprint'].get('id')})",
            f"objective {self.selection['objective'] or '(primary)'}; {rule} (bound mass = sum of sqrt(F))",
            f"{len(self.modules)} modules, {self.covered:.1%} of the bound mass; {self.trainable:,} of "
            f"{self.numel:,} parameters trainable ({self.trainable / self.numel:.2%})",
            "each pattern is ^name$ over model.named_parameters(); axolotl escapes the dots itself",
            *_wrap(prov["caveat"]),
        ]


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
    mass: float | None = None,
    top_modules: int | None = None,
    objective: str | None = None,
    model=None,
) -> UnfrozenParameters:
    """axolotl patterns for the modules of ``run`` with the most bound mass (module docstring).

    Exactly one of ``mass`` (share in (0, 1], default 0.5) and ``top_modules``. Every module with
    a parameter is a candidate (embeddings, norms and heads included, as in Spectrum). ``model``,
    when given, is fingerprint-checked and its ``named_parameters()`` must be matched too.
    """
    run = load_run(run)
    if mass is not None and top_modules is not None:
        raise FisherSelectError("pass --mass or --top-modules, not both")
    if mass is None and top_modules is None:
        mass = DEFAULT_MASS
    units = _module_bound_mass(run, objective)
    total = math.fsum(u["bound_mass"] for u in units)
    if not total > 0:
        raise FisherSelectError(f"run {run.run_id} has no Fisher mass at all (F = 0 everywhere); recalibrate")
    chosen = _choose(units, total, mass, top_modules)
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
    return UnfrozenParameters(
        patterns=patterns, modules=modules, trainable=sum(sizes[n] for n in unfrozen), numel=sum(sizes.values()),
        covered=math.fsum(u["bound_mass"] for u in chosen) / total,
        selection={"mass": mass, "top_modules": top_modules, "objective": objective},
        provenance=run.provenance(CAVEAT),
    )


def _module_bound_mass(run: Run, objective: str | None) -> list[dict]:
    """Per module (parameters grouped by dotted prefix, as the report groups them): sum of sqrt(F)."""
    table: dict[str, dict] = {}
    for name, f in run.fisher_for(objective).items():
        if not bool(f.isfinite().all()):
            raise FisherSelectError(f"run {run.run_id}: Fisher of {name} holds NaN/inf values; recalibrate this run")
        unit = table.setdefault(module_of(name), {"name": module_of(name), "parameters": [], "numel": 0, "parts": []})
        unit["parameters"].append(name)
        unit["numel"] += f.numel()
        unit["parts"].append(float(f.double().clamp_min(0).sqrt().sum()))
    for unit in table.values():
        unit["parameters"].sort()
        unit["bound_mass"] = math.fsum(unit.pop("parts"))  # exact: independent of parameter order
    return sorted(table.values(), key=lambda u: (-u["bound_mass"], u["name"]))


def _choose(units: list[dict], total: float, mass: float | None, top_modules: int | None) -> list[dict]:
    if top_modules is not None:
        if int(top_modules) != top_modules or not 1 <= top_modules <= len(units):
            raise FisherSelectError(f"--top-modules {top_modules} must be an integer in [1, {len(units)}]")
        return units[: int(top_modules)]
    if not 0.0 < float(mass) <= 1.0:
        raise FisherSelectError(f"--mass {mass} is outside (0, 1]; pass a share such as 0.5")
    chosen, running = [], 0.0
    for unit in units:  # fsum-exact total, running sum in the same order: mass=1 takes every module
        chosen.append(unit)
        running = math.fsum(u["bound_mass"] for u in chosen)
        if running >= mass * total:
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


# ---------------------------------------------------------------------------
# PEFT export


@dataclass
class LoraExport:
    """A checked LoRA hint and what its adapters train."""

    hints: dict  # lora_hints(...)
    trainable: int  # LoRA parameters: sum of r * (in + out) over the targets
    numel: int  # parameters of the base model (the run's)
    matched: dict[str, list[str]]  # target -> module names PEFT's own matcher adapts


def lora_export(run: "Run | str | os.PathLike", *, model=None, **hint_kwargs) -> LoraExport:
    """``lora_hints(run, **hint_kwargs)``, checked with PEFT's matcher against the run's (and model's) modules."""
    # Imported here: PEFT (and through it bitsandbytes) is slow to import for the axolotl path.
    from fisher_select.outputs.peft_hints import lora_config_from_hints, lora_hints

    run = load_run(run)
    hints = lora_hints(run, model=model, **hint_kwargs)
    config = lora_config_from_hints(hints)
    names = sorted({module_of(n) for n in run.fisher} | {e.name for e in run.report.modules})
    matched = check_lora_targets(config, names, f"the modules of run {run.run_id}")
    if model is not None:
        matched = check_lora_targets(config, [n for n, _ in model.named_modules()],
                                     f"the model's named_modules() ({type(model).__name__})")
    ranks = {t["name"]: t["rank"] for t in hints["fisher_select"]["targets"]}
    trainable = sum(r * sum(run.fisher[f"{name}.weight"].shape) for name, r in ranks.items())
    return LoraExport(hints=hints, trainable=trainable, numel=sum(t.numel() for t in run.fisher.values()),
                      matched=matched)


def check_lora_targets(config, names: list[str], where: str) -> dict[str, list[str]]:
    """Target -> module names PEFT adapts (``check_target_module_exists``); refuses unmatched targets.

    Also refuses a ``rank_pattern`` / ``alpha_pattern`` key that PEFT would give no adapted module.
    """
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    adapted = [n for n in names if check_target_module_exists(config, n)]
    targets = list(config.target_modules)
    matched = {t: [n for n in adapted if n == t or n.endswith("." + t)] for t in targets}
    _refuse_unmatched([t for t, hits in matched.items() if not hits], where, "LoRA target")
    for patterns, what in ((config.rank_pattern, "rank_pattern"), (config.alpha_pattern, "alpha_pattern")):
        used = {get_pattern_key(list(patterns), n) for n in adapted}
        _refuse_unmatched([k for k in patterns if k not in used], where, f"{what} key")
    return matched
