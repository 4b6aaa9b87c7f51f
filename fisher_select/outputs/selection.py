"""Coordinate masks from a run: the coordinates fine-tuning is likely to move.

``select_masks`` applies exactly one rule to a run's per-coordinate values:

- ``top=F``: the ``k = max(1, floor(F * N + 1/2))`` coordinates with the largest bound, N = number
  of coordinates (or of units, see ``structured``). Exactly k, also when values tie. The bound
  ``sqrt(S) * sqrt(F_i)`` is increasing in F_i, so coordinates are ranked by F itself: the same
  order without the rounding of the product, and still defined when S is 0 or unknown.
- ``mass=Q``: the smallest set of coordinates whose Fisher mass ``sum F_i`` reaches ``Q`` times
  the total: coordinates in decreasing F until the running sum reaches ``Q * total``.
- ``threshold=TAU``: the coordinates whose bound ``sqrt(F_i * S)`` exceeds TAU, i.e. those *not*
  guaranteed ``|g_i| <= TAU``. Needs the objective's signal scale S.

Ties are broken deterministically: among equal values, the coordinate that comes first in
*canonical order* wins: parameters sorted by name, then row-major (flat) index inside each.

``per_module=True`` applies the budget (top / mass) within each parameter tensor instead of over
the whole model. ``structured="rows"|"columns"`` makes whole rows / columns of 2-D weights the
unit: a unit's value is its summed Fisher ``F_u`` and its bound ``sqrt(S * F_u)`` bounds the
Euclidean norm of that row's (column's) expected gradient (Cauchy-Schwarz per coordinate, summed).
Parameters that are not 2-D (norm weights, biases) fall back to single coordinates as units, and
``top`` then counts units, not coordinates.

The selection never sorts the model: an exact radix select over the fp32/fp64 bit patterns
(non-negative floats order like their bit patterns) finds the boundary value in four (eight for
fp64) histogram passes, so 135M coordinates cost a few linear passes and no giant sort.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from fisher_select.errors import FisherSelectError
from fisher_select.caveats import MASK_CAVEAT as CAVEAT
from fisher_select.atomic import refuse_existing, write_file
from fisher_select.rundir import Run, load_run, save_tensors

MASK_FORMAT = "fisher_select.masks/1"  # the mask file format, not a module path
META_KEY = "fisher_select"
# The project's one-line caveat (report.py), plus how to make a mask more than advisory.
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
    mass: float | None = None,
    threshold: float | None = None,
    per_module: bool = False,
    structured: str | None = None,
    objective: str | None = None,
) -> MaskSet:
    """Select coordinates of ``run`` by exactly one of ``top``, ``mass``, ``threshold``.

    See the module docstring for the rules, tie-breaking and ``structured`` units. Raises
    ``FisherSelectError`` for a missing/duplicate rule, a value out of range, a threshold
    without a known signal scale, or non-finite Fisher values.
    """
    run = load_run(run)
    rule, value = _check_rule(top, mass, threshold)
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
            "know; use --top or --mass (they only need the ranking), or calibrate with a known S"
        )
    warnings = _degenerate_scale(run, rule, scale, objective)
    units = _unit_values(run, rule, structured, scale, objective)
    chosen = _choose_units(units, rule, value, per_module)
    masks = {name: _expand(chosen[name], run.fisher[name], structured) for name in units}
    meta = _meta(run, masks, rule, value, per_module, structured, objective, scale)
    meta["warnings"] = warnings
    return MaskSet(masks=masks, meta=meta)


def _degenerate_scale(run, rule: str, scale: float | None, objective: str | None) -> list[str]:
    """S = 0: every bound is 0. A threshold would select nothing; a ranking falls back to F alone."""
    if scale != 0.0:
        return []
    name = run.objective(objective).name
    why = (f"objective {name!r} of run {run.run_id} has signal scale S = 0: no sampled response carried "
           "signal (e.g. every reward of a prompt was equal), so every bound sqrt(F S) is 0")
    if rule == "threshold":
        raise FisherSelectError(f"{why} and --threshold would select nothing; calibrate with prompts whose "
                                "rewards vary (or more samples per prompt), or use --top / --mass, which rank by F")
    return [f"{why}; --{rule} ranks by F alone, which says where the model's score is large, not where this "
            "objective pushes: calibrate with prompts whose rewards vary for a meaningful selection"]


def _check_rule(top, mass, threshold) -> tuple[str, float]:
    given = {k: v for k, v in (("top", top), ("mass", mass), ("threshold", threshold)) if v is not None}
    if len(given) != 1:
        raise FisherSelectError(
            f"pass exactly one of --top, --mass, --threshold (got {', '.join(given) or 'none'})"
        )
    (rule, value), = given.items()
    value = float(value)
    if rule in ("top", "mass") and not 0.0 < value <= 1.0:
        raise FisherSelectError(
            f"--{rule} {value} is outside (0, 1]; pass a fraction such as 0.05"
        )
    if rule == "threshold" and not (math.isfinite(value) and value >= 0.0):
        raise FisherSelectError(f"--threshold {value} must be a finite number >= 0")
    return rule, value


# ---------------------------------------------------------------------------
# Units and their values


def _unit_values(run, rule, structured, scale, objective) -> dict[str, torch.Tensor]:
    """Per parameter, a 1-D tensor of unit values, non-negative and finite.

    Unstructured: one unit per coordinate; the bound (fp32, from ``run.bound``) for threshold,
    F for top and mass. Structured: summed F per row/column (fp64) for top and mass, the unit
    bound ``sqrt(S * F_u)`` for threshold.
    """
    for name, f in run.fisher_for(objective).items():
        if not torch.isfinite(f).all():
            raise FisherSelectError(
                f"run {run.run_id}: Fisher of {name} holds NaN/inf values; recalibrate this run"
            )
    if structured is None:
        source = run.bound(objective) if rule == "threshold" else run.fisher_for(objective)
        return {name: _nonnegative(t.detach().float().reshape(-1)) for name, t in source.items()}
    units = {name: _unit_sums(f, structured) for name, f in run.fisher_for(objective).items()}
    if rule == "threshold":
        root = math.sqrt(scale)
        units = {name: u.sqrt() * root for name, u in units.items()}
    return units


def _nonnegative(values: torch.Tensor) -> torch.Tensor:
    """``values`` clamped at +0.0 (a copy only when needed), as ``Run.bound`` clamps F.

    -0.0 must become +0.0 too: the radix select needs bit patterns that order like the values.
    """
    return values.clamp_min(0).abs() if torch.signbit(values).any() else values


def _unit_sums(fisher: torch.Tensor, structured: str) -> torch.Tensor:
    """Summed F per row (dim 1 summed) or column (dim 0 summed) of a 2-D tensor, in fp64.

    Other shapes fall back to one unit per coordinate.
    """
    f = _nonnegative(fisher.detach().double())
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


def _choose_units(units, rule, value, per_module) -> dict[str, torch.Tensor]:
    """Apply the rule globally or per parameter; returns 1-D bool unit masks."""
    if rule == "threshold":
        return {name: u > value for name, u in units.items()}
    groups = [{name: units[name]} for name in sorted(units)] if per_module else [units]
    chosen: dict[str, torch.Tensor] = {}
    for group in groups:
        chosen.update(_apply_budget(group, rule, value))
    return chosen


def _apply_budget(units, rule, value) -> dict[str, torch.Tensor]:
    if rule == "top":
        n = sum(u.numel() for u in units.values())
        return _top_units(units, float(top_count(value, n)), weighted=False)
    total = sum(float(u.sum(dtype=torch.float64)) for u in units.values())
    if total <= 0.0:
        if len(units) == 1:  # per parameter: a parameter without Fisher mass needs nothing
            return {name: torch.zeros_like(u, dtype=torch.bool) for name, u in units.items()}
        raise FisherSelectError("the run has no Fisher mass at all (F = 0 everywhere); recalibrate")
    return _top_units(units, value * total, weighted=True)


def top_count(fraction: float, n: int) -> int:
    """Coordinates kept by ``top=fraction`` out of ``n``: round half up, at least one."""
    return min(n, max(1, math.floor(fraction * n + 0.5)))


def top_k_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the ``k`` largest entries of a non-negative tensor; ties go to lower flat index."""
    if not 0 <= k <= values.numel():
        raise FisherSelectError(f"cannot select {k} of {values.numel()} coordinates")
    if k == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    flat = _nonnegative(values.detach().float().reshape(-1))
    if not torch.isfinite(flat).all():
        raise FisherSelectError("values hold NaN/inf; recalibrate the run")
    return _top_units({"x": flat}, float(k), weighted=False)["x"].reshape(values.shape)


def _top_units(units: dict[str, torch.Tensor], target: float, weighted: bool) -> dict[str, torch.Tensor]:
    """Units in decreasing value until their weight reaches ``target``.

    A unit weighs 1 (``weighted=False``: ``target`` is a count) or its own value (``weighted=True``:
    ``target`` is a mass). Returns 1-D bool masks. Exact: the boundary value is found by radix
    select, every unit above it is taken, and the units equal to it are taken in canonical order
    (sorted names, then flat index) until the target is met.
    """
    if target <= 0 or not any(u.numel() for u in units.values()):
        return {name: torch.zeros_like(u, dtype=torch.bool) for name, u in units.items()}
    boundary, above = _radix_boundary(units, target, weighted)
    dtype = next(iter(units.values())).dtype
    need = _ties_needed(target - above, _key_value(boundary, dtype), weighted)
    chosen = {}
    for name in sorted(units):
        keys = _keys(units[name])
        mask = keys > boundary
        if need > 0:
            ties = (keys == boundary).nonzero().reshape(-1)[:need]  # canonical order
            mask[ties] = True
            need -= ties.numel()
        chosen[name] = mask
    return chosen


def _keys(values: torch.Tensor) -> torch.Tensor:
    """Integer view of non-negative floats; it orders exactly like the values (no copy)."""
    if values.dtype == torch.float32:
        return values.view(torch.int32)
    if values.dtype == torch.float64:
        return values.view(torch.int64)
    raise TypeError(f"unit values must be fp32 or fp64, got {values.dtype}")


def _radix_boundary(units, target: float, weighted: bool) -> tuple[int, float]:
    """Bit pattern ``b`` of the boundary value and the weight of units strictly above it.

    Invariant: ``weight(> b) < target <= weight(>= b)`` (up to fp64 rounding of masses). Each pass
    fixes 8 more bits of ``b``: a 256-bin weight histogram of the next digit over the candidates
    (units sharing the bits found so far), scanned from the top digit down. Only the first pass
    reads every unit; the candidates shrink to one histogram bin per pass.
    """
    bits = 8 * next(iter(units.values())).element_size()
    candidates = [(_keys(v), v if weighted else None) for v in units.values()]
    prefix, above = 0, 0.0
    for shift in range(bits - 8, -1, -8):
        if shift + 8 < bits:  # keep only the candidates in the chosen bin of the last pass
            candidates = [_same_prefix(k, v, prefix, shift + 8) for k, v in candidates]
        hist = torch.zeros(256, dtype=torch.float64)
        for keys, values in candidates:
            digits = (keys >> shift) & 0xFF
            weights = values.double() if weighted else None
            hist += torch.bincount(digits, weights=weights, minlength=256).double()
        digit = _pick_digit(hist, above, target)
        above += float(hist[digit + 1 :].sum())
        prefix |= digit << shift
    return prefix, above


def _same_prefix(keys, values, prefix: int, shift: int):
    same = (keys >> shift) == (prefix >> shift)
    return keys[same], (values[same] if values is not None else None)


def _pick_digit(hist: torch.Tensor, above: float, target: float) -> int:
    """Highest digit whose cumulative weight (from the top, plus ``above``) reaches ``target``.

    When rounding leaves the target just out of reach, take every candidate: the lowest digit
    that carries weight.
    """
    reach = above + hist.flip(0).cumsum(0)  # reach[j]: weight of digits >= 255 - j
    hits = (reach >= target).nonzero()
    if hits.numel():
        return 255 - int(hits[0])
    carrying = hist.nonzero()
    return int(carrying[0]) if carrying.numel() else 0


def _ties_needed(missing: float, value: float, weighted: bool) -> int:
    """How many units equal to the boundary ``value`` complete the target."""
    if not weighted:
        return max(0, round(missing))
    return max(0, math.ceil(missing / value)) if value > 0 else 0


def _key_value(key: int, dtype: torch.dtype) -> float:
    """The float of ``dtype`` whose bit pattern is ``key``."""
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int64
    return float(torch.tensor([key], dtype=int_dtype).view(dtype))


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
    """Selected / numel / density per module, in the report's (mass) order.

    A parameter the report does not list under a module counts under its dotted prefix.
    """
    owner = {}
    for entry in run.report.modules:
        for param in entry.parameters:
            owner.setdefault(param, entry.name)
    totals: dict[str, list[int]] = {entry.name: [0, 0] for entry in run.report.modules}
    for name in sorted(counts):
        module = owner.get(name, name.rpartition(".")[0])
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


def sidecar_path(path: "str | os.PathLike") -> Path:
    """``<path>.json``: the human-readable copy of a mask file's metadata."""
    path = Path(path)
    return path.with_name(path.name + ".json")


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
