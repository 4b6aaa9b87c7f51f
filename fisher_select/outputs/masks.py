"""Coordinate masks from a run: choose them and store them (the mask file format).

``select_masks`` applies exactly one rule to a run's per-coordinate values:

- ``top=F``: the ``k = max(1, floor(F * N + 1/2))`` coordinates with the largest bound, N = number
  of coordinates (or of units, see ``structured``). Exactly k, also when values tie. The bound
  ``sqrt(S) * sqrt(F_i)`` is increasing in F_i, so coordinates are ranked by F itself: the same
  order without the rounding of the product, and still defined when S is 0 or unknown.
- ``fisher_mass=Q``: the smallest set of coordinates whose **Fisher mass** ``sum F_i`` reaches
  ``Q`` times the total: coordinates in decreasing F until the running sum reaches ``Q * total``.
- ``bound_mass=Q``: the same with the **bound mass** ``sum sqrt(F_i)`` (the bounds' sum, up to the
  objective's constant ``sqrt(S)``). F is dominated by a few huge coordinates, so Q of the Fisher
  mass is far fewer coordinates than Q of the bound mass.
- ``threshold=TAU``: the coordinates whose bound ``sqrt(F_i * S)`` exceeds TAU, i.e. those *not*
  guaranteed ``|g_i| <= TAU``. Needs the objective's signal scale S.

Ties are broken deterministically: among equal values, the coordinate that comes first in
*canonical order* wins: parameters sorted by name, then row-major (flat) index inside each.

``per_module=True`` applies the budget (top / fisher_mass / bound_mass) within each parameter tensor instead of over
the whole model; a fused MoE expert tensor (``stats.experts``) counts as one tensor per expert: the budget
applies within each expert's slice (``experts.3.gate_up_proj``), as a dense model's per-expert Linears
would get it. ``structured="rows"|"columns"`` makes whole rows / columns of 2-D weights the
unit: a unit's value is its summed Fisher ``F_u`` and its bound ``sqrt(S * F_u)`` bounds the
Euclidean norm of that row's (column's) expected gradient (Cauchy-Schwarz per coordinate, summed).
Parameters that are not 2-D (norm weights, biases) fall back to single coordinates as units, and
``top`` then counts units, not coordinates.

The selection never sorts the model: ``stats.ranking``'s exact radix select finds the boundary
value in a few histogram passes.

Training with a mask enforced (``apply_masks``, ``FisherMaskCallback``, sparse deltas) is
``fisher_select.training``; this module chooses masks and reads and writes their files.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from fisher_select.atomic import refuse_existing, write_file
from fisher_select.caveats import MASK_CAVEAT as CAVEAT
from fisher_select.errors import FisherSelectError
from fisher_select.outputs.config import SCORES
from fisher_select.run.io import save_tensors
from fisher_select.run.load import Run, load_run
from fisher_select.run.names import MASK_FORMAT, sidecar_path
from fisher_select.stats.experts import FusedExperts, fused_experts
from fisher_select.stats.naming import module_of
from fisher_select.stats.ranking import nonnegative, top_count, top_units
from fisher_select.stats.topk import coarse_histogram, threshold_keys

META_KEY = "fisher_select"
STRUCTURES = ("rows", "columns")


@dataclass
class MaskSet:
    """Boolean masks (True = selected: likely to move) plus what produced them."""

    masks: dict[str, torch.Tensor]  # parameter name -> bool tensor of the parameter's shape
    meta: dict  # run id, model fingerprint, rule, densities, caveat (the JSON sidecar)

    @property
    def selected(self) -> int:
        return self.meta["selected"]

    @property
    def numel(self) -> int:
        return self.meta["numel"]

    @property
    def density(self) -> float:
        return self.meta["density"]


# ---------------------------------------------------------------------------
# Public entry point


def select_masks(
    run: "Run | str | os.PathLike",
    *,
    top: float | None = None,
    fisher_mass: float | None = None,
    bound_mass: float | None = None,
    threshold: float | None = None,
    per_module: bool = False,
    structured: str | None = None,
    objective: str | None = None,
    score: str = "bound",
) -> MaskSet:
    """Select coordinates of ``run`` by exactly one of ``top``, ``fisher_mass``, ``bound_mass``, ``threshold``.

    ``score="grad_estimate"`` ranks ``top`` by the objective's |g_hat| instead of the bound (see
    ``SCORES``). See the module docstring for the rules, tie-breaking and ``structured`` units. Raises
    ``FisherSelectError`` for a missing/duplicate rule, a value out of range, a threshold
    without a known signal scale, or non-finite Fisher values.
    """
    run = load_run(run)
    rule, value = _check_rule(top, fisher_mass, bound_mass, threshold)
    _check_score(score, rule, structured)
    if structured not in (None, *STRUCTURES):
        raise FisherSelectError(
            f"unknown structure {structured!r}; pass structured='rows' or 'columns' (or none)"
        )
    if per_module and rule == "threshold":
        raise FisherSelectError(
            "--per-module has no meaning for --threshold (it is already per coordinate); drop one"
        )
    scale = run.signal_scale_of(objective)
    if rule == "threshold" and scale is None:
        raise FisherSelectError(
            f"--threshold needs the objective's signal scale S, which run {run.run_id} does not "
            "know; use --top, --fisher-mass or --bound-mass (they only need the ranking), or calibrate with a known S"
        )
    warnings = _degenerate_scale(run, rule, scale, objective)
    units = (_unit_values(run, rule, structured, scale, objective) if score == "bound"
             else {name: g.detach().float().abs().reshape(-1) for name, g in run.grad_estimate_of(objective).items()})
    experts = _expert_groups(run, structured) if per_module else {}
    chosen = _choose_units(units, rule, value, per_module, experts)
    masks = {name: _expand(chosen[name], run.fisher[name], structured) for name in units}
    meta = _meta(run, masks, rule, value, per_module, structured, objective, scale)
    if experts:  # which tensors got one budget per expert
        meta["rule"]["per_expert"] = sorted(experts)
    meta["rule"]["score"] = score
    meta["warnings"] = warnings + _oversized(meta, units, rule, scale)
    return MaskSet(masks=masks, meta=meta)


def _check_score(score: str, rule: str, structured: str | None) -> None:
    if score not in SCORES:
        raise FisherSelectError(f"unknown score {score!r}; pass one of {', '.join(SCORES)}")
    if score != "bound" and (rule != "top" or structured is not None):
        raise FisherSelectError(f"--score {score} ranks single coordinates for --top only; drop --{_flag(rule)}"
                                f"{' and --structured' if structured else ''}, or use --score bound")


OVERSIZED = 0.5  # a selection above this share of the model is no longer "the few parameters that matter"
SUGGESTED_SHARES = (0.01, 0.10)


def _oversized(meta: dict, units: dict[str, torch.Tensor], rule: str, scale: float | None) -> list[str]:
    """A selection above half the model: say so, with the thresholds that would select 1% and 10%."""
    if meta["density"] <= OVERSIZED:
        return []
    said = f"the selection holds {meta['density']:.1%} of the model ({meta['selected']:,} of {meta['numel']:,})"
    if rule != "threshold" or scale is None or not math.isfinite(scale):
        return [f"{said}: more than half, which is hardly a selection; pass a smaller --{_flag(rule)}, e.g. "
                f"--top {SUGGESTED_SHARES[0]:g}"]
    cuts = [f"--threshold {value} for about {share:.0%}" for share, value in zip(SUGGESTED_SHARES, _thresholds(units))]
    return [f"{said}: more than half, so --threshold {meta['rule']['value']:g} leaves almost nothing out; "
            f"try {' or '.join(cuts)}"]


def _thresholds(units: dict[str, torch.Tensor]) -> list[str]:
    """Per share of SUGGESTED_SHARES, a value whose ``units > value`` selects about that share: between the k-th
    and the (k+1)-th largest unit values (the radix select of ``stats.topk``: histogram passes, no sort)."""
    fp32 = {name: u.float() for name, u in units.items()}
    n = sum(u.numel() for u in fp32.values())
    ks = [k + j for k in (top_count(share, n) for share in SUGGESTED_SHARES) for j in (0, 1)]
    cuts = threshold_keys(fp32, coarse_histogram(fp32)[0], [min(k, n) for k in ks])
    values = [float(torch.tensor(key, dtype=torch.int32).view(torch.float32)) for key in cuts]
    return [_between(values[i + 1], values[i]) for i in range(0, len(values), 2)]


def _between(low: float, high: float) -> str:
    """The shortest printed number in [low, high) (so ``> it`` keeps the higher value and leaves the lower)."""
    for digits in range(2, 10):
        text = f"{(low + high) / 2:.{digits}g}"
        if low <= float(text) < high:
            return text
    return repr(low)


def _degenerate_scale(run, rule: str, scale: float | None, objective: str | None) -> list[str]:
    """S = 0: every bound is 0. A threshold would select nothing; a ranking falls back to F alone."""
    if scale != 0.0:
        return []
    name = run.objective(objective).name
    why = (f"objective {name!r} of run {run.run_id} has signal scale S = 0: no sampled response carried "
           "signal (e.g. every reward of a prompt was equal), so every bound sqrt(F S) is 0")
    if rule == "threshold":
        raise FisherSelectError(f"{why} and --threshold would select nothing; calibrate with prompts whose "
                                "rewards vary (or more samples per prompt), or use --top / --fisher-mass / --bound-mass, which rank by F")
    return [f"{why}; --{_flag(rule)} ranks by F alone, which says where the model's score is large, not where this "
            "objective pushes: calibrate with prompts whose rewards vary for a meaningful selection"]


RULES = ("top", "fisher_mass", "bound_mass", "threshold")
BUDGETS = ("fisher_mass", "bound_mass")  # rules that accumulate a mass rather than count coordinates


def _flag(rule: str) -> str:
    return rule.replace("_", "-")


def _check_rule(top, fisher_mass, bound_mass, threshold) -> tuple[str, float]:
    given = {k: v for k, v in zip(RULES, (top, fisher_mass, bound_mass, threshold)) if v is not None}
    if len(given) != 1:
        raise FisherSelectError(
            "pass exactly one of --top, --fisher-mass, --bound-mass, --threshold "
            f"(got {', '.join('--' + _flag(k) for k in given) or 'none'})"
        )
    (rule, value), = given.items()
    value = float(value)
    if rule != "threshold" and not 0.0 < value <= 1.0:
        raise FisherSelectError(
            f"--{_flag(rule)} {value} is outside (0, 1]; pass a fraction such as 0.05"
        )
    if rule == "threshold" and not (math.isfinite(value) and value >= 0.0):
        raise FisherSelectError(f"--threshold {value} must be a finite number >= 0")
    return rule, value


# ---------------------------------------------------------------------------
# Units and their values


def _unit_values(run, rule, structured, scale, objective) -> dict[str, torch.Tensor]:
    """Per parameter, a 1-D tensor of unit values, non-negative and finite.

    Unstructured: one unit per coordinate; the bound (fp32, from ``run.bound``) for threshold,
    sqrt(F) for bound_mass, F for top and fisher_mass. Structured: summed F per row/column (fp64)
    for top and fisher_mass, its square root for bound_mass, the unit bound ``sqrt(S * F_u)`` for
    threshold.
    """
    for name, f in run.fisher_for(objective).items():
        if not torch.isfinite(f).all():
            raise FisherSelectError(
                f"run {run.run_id}: Fisher of {name} holds NaN/inf values; recalibrate this run"
            )
    if structured is None:
        source = run.bound(objective) if rule == "threshold" else run.fisher_for(objective)
        units = {name: nonnegative(t.detach().float().reshape(-1)) for name, t in source.items()}
        return {name: u.sqrt() for name, u in units.items()} if rule == "bound_mass" else units
    units = {name: _unit_sums(f, structured) for name, f in run.fisher_for(objective).items()}
    if rule in ("threshold", "bound_mass"):
        root = math.sqrt(scale) if rule == "threshold" else 1.0
        units = {name: u.sqrt() * root for name, u in units.items()}
    return units


def _unit_sums(fisher: torch.Tensor, structured: str) -> torch.Tensor:
    """Summed F per row (dim 1 summed) or column (dim 0 summed) of a 2-D tensor, in fp64.

    Other shapes fall back to one unit per coordinate.
    """
    f = nonnegative(fisher.detach().double())
    if f.dim() != 2:
        return f.reshape(-1)
    return f.sum(dim=1 if structured == "rows" else 0)  # (out,) for rows, (in,) for columns


def _expand(units: torch.Tensor, fisher: torch.Tensor, structured: str | None) -> torch.Tensor:
    """Unit mask -> parameter-shaped bool mask."""
    if structured is None or fisher.dim() != 2:
        return units.reshape(fisher.shape)
    if structured == "rows":
        return units[:, None].expand(fisher.shape).clone()  # (out, in)
    return units[None, :].expand(fisher.shape).clone()  # (out, in)


# ---------------------------------------------------------------------------
# Rules over units


def _choose_units(units, rule, value, per_module, experts=None) -> dict[str, torch.Tensor]:
    """Apply the rule globally, or per parameter (per expert slice of a fused tensor in ``experts``);
    returns 1-D bool unit masks."""
    if rule == "threshold":
        return {name: u > value for name, u in units.items()}
    if not per_module:
        return _apply_budget(units, rule, value)
    chosen: dict[str, torch.Tensor] = {}
    for name in sorted(units):
        fused = (experts or {}).get(name)
        if fused is None:
            chosen.update(_apply_budget({name: units[name]}, rule, value))
            continue
        slices = {fused.slice_name(e): u for e, u in enumerate(fused.split_units(units[name]))}  # expert order
        picked = [_apply_budget({key: u}, rule, value)[key] for key, u in slices.items()]
        chosen[name] = torch.cat(picked)
    return chosen


def _expert_groups(run, structured: str | None) -> dict[str, FusedExperts]:
    """The run's fused expert tensors whose units split by expert: all of them but a 2-D tensor's columns
    (a column of an (E, X) bias crosses every expert). 3-D tensors have coordinates as units (see ``structured``)."""
    fused = fused_experts({name: tuple(f.shape) for name, f in run.fisher.items()})
    return {name: f for name, f in fused.items() if not (structured == "columns" and len(f.shape) == 2)}


def _apply_budget(units, rule, value) -> dict[str, torch.Tensor]:
    if rule == "top":
        n = sum(u.numel() for u in units.values())
        return top_units(units, float(top_count(value, n)), weighted=False)
    total = sum(float(u.sum(dtype=torch.float64)) for u in units.values())
    if total <= 0.0:
        if len(units) == 1:  # per parameter: a parameter without mass needs nothing
            return {name: torch.zeros_like(u, dtype=torch.bool) for name, u in units.items()}
        raise FisherSelectError("the run has no Fisher mass at all (F = 0 everywhere); recalibrate")
    return top_units(units, value * total, weighted=True)


# ---------------------------------------------------------------------------
# Metadata


def _meta(run, masks, rule, value, per_module, structured, objective, scale) -> dict:
    """The JSON sidecar: provenance, rule, per-module and overall density, caveats."""
    counts = {name: (int(m.sum()), m.numel()) for name, m in masks.items()}
    selected = sum(c[0] for c in counts.values())
    numel = sum(c[1] for c in counts.values())
    return {
        "format": MASK_FORMAT,
        **run.provenance(CAVEAT),
        "rule": {
            "name": rule,
            "value": value,
            "per_module": per_module,
            "structured": structured,
            "objective": objective or run.objectives[0].name,
            "signal_scale": scale,
        },
        "selected": selected,
        "numel": numel,
        "density": selected / numel if numel else 0.0,
        "modules": _module_counts(run, counts),
    }


def _module_counts(run, counts: dict[str, tuple[int, int]]) -> list[dict]:
    """Selected / numel / density per module, in the report's order (bound mass, largest first).

    A parameter the report does not list under a module counts under its dotted prefix.
    """
    owner = {}
    for entry in run.report.modules:
        for param in entry.parameters:
            owner.setdefault(param, entry.name)
    totals: dict[str, list[int]] = {entry.name: [0, 0] for entry in run.report.modules}
    for name in sorted(counts):
        module = owner.get(name, module_of(name))
        total = totals.setdefault(module, [0, 0])
        total[0] += counts[name][0]
        total[1] += counts[name][1]
    return [
        {"name": name, "selected": s, "numel": n, "density": s / n}
        for name, (s, n) in totals.items()
        if n
    ]


# ---------------------------------------------------------------------------
# Files


def save_masks(maskset: MaskSet, path: "str | os.PathLike", *, overwrite: bool = False) -> Path:
    """Write bool masks as safetensors (metadata embedded) plus the ``<path>.json`` sidecar.

    Each file is written to a temporary name and renamed into place, so neither is ever seen
    half-written. The embedded metadata is authoritative; ``load_masks`` refuses a sidecar
    that belongs to another mask file.
    """
    path, sidecar = Path(path), sidecar_path(path)
    refuse_existing([path, sidecar], overwrite)
    text = json.dumps(maskset.meta, indent=2) + "\n"
    embedded = {META_KEY: json.dumps(maskset.meta)}
    write_file(path, lambda tmp: save_tensors(tmp, maskset.masks, embedded), overwrite=True)
    write_file(sidecar, lambda tmp: tmp.write_text(text), overwrite=True)
    return path


def load_masks(path: "str | os.PathLike") -> tuple[dict[str, torch.Tensor], dict]:
    """Read a mask file written by ``save_masks``: ``(masks, meta)``."""
    path = Path(path)
    if not path.is_file():
        raise FisherSelectError(
            f"mask file {path} does not exist; pass the --out file of `fisher-select select`"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            masks = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own error types for foreign files
        raise FisherSelectError(f"{path} is not a safetensors file ({err}); pass a mask file") from err
    if META_KEY not in metadata:
        raise FisherSelectError(f"{path} is not a fisher_select mask file (no metadata); pass a mask file")
    meta = json.loads(metadata[META_KEY])
    if meta.get("format") != MASK_FORMAT:
        raise FisherSelectError(f"{path} has mask format {meta.get('format')!r}, expected {MASK_FORMAT}")
    bad = [name for name, m in masks.items() if m.dtype != torch.bool]
    if bad:
        raise FisherSelectError(f"{path}: masks {bad[:3]} are not boolean; regenerate the mask file")
    _check_sidecar(path, meta)
    return masks, meta


def _check_sidecar(path: Path, meta: dict) -> None:
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        return
    side = json.loads(sidecar.read_text())
    if (side.get("run_id"), side.get("selected")) != (meta["run_id"], meta["selected"]):
        raise FisherSelectError(
            f"sidecar {sidecar} describes another mask file than {path}; "
            "regenerate the mask with `fisher-select select ... --overwrite`"
        )
