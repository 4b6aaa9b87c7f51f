"""Exact top-k over named tensors: the masks users train with.

``top_units(units, target, weighted)`` takes units in decreasing value until their weight reaches
``target`` (a count, or a mass when ``weighted``). The boundary value is found by an exact radix
select over the fp32/fp64 bit patterns (non-negative floats order like their bit patterns) in
four (eight for fp64) histogram passes, so 135M coordinates cost a few linear passes and no giant
sort.

Ties are broken in one way everywhere in the project (**canonical order**): among equal values,
the coordinate that comes first wins, parameters sorted by name, then row-major (flat) index
inside each.
"""

from __future__ import annotations

import math

import torch

from fisher_select.errors import FisherSelectError


def masked_abs_sum(values: dict, masks: dict) -> float:
    """The fp64 sum of |values[n]| over ``masks[n]`` (name -> bool tensor); a name without values adds 0.
    The lr advice's measure of a mask: the sum of |g_hat_i| over it, or of sqrt(F_i)."""
    return sum(float(values[n][m].double().abs().sum()) for n, m in masks.items() if n in values)


def nonnegative(values: torch.Tensor) -> torch.Tensor:
    """``values`` clamped at +0.0 (a copy only when needed), as ``Run.bound`` clamps F.

    -0.0 must become +0.0 too: the radix select needs bit patterns that order like the values.
    """
    return values.clamp_min(0).abs() if torch.signbit(values).any() else values


def top_count(fraction: float, n: int) -> int:
    """Coordinates kept by ``top=fraction`` out of ``n``: round half up, at least one."""
    return min(n, max(1, math.floor(fraction * n + 0.5)))


def top_k_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the ``k`` largest entries of a non-negative tensor; ties go to lower flat index."""
    if not 0 <= k <= values.numel():
        raise FisherSelectError(f"cannot select {k} of {values.numel()} coordinates")
    if k == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    flat = nonnegative(values.detach().float().reshape(-1))
    if not torch.isfinite(flat).all():
        raise FisherSelectError("values hold NaN/inf; recalibrate the run")
    return top_units({"x": flat}, float(k), weighted=False)["x"].reshape(values.shape)


def top_units(units: dict[str, torch.Tensor], target: float, weighted: bool) -> dict[str, torch.Tensor]:
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


def global_top_masks(scores: dict[str, torch.Tensor], density: float) -> dict[str, torch.Tensor]:
    """Bool masks (parameter-shaped) of the top ``density`` share of all coordinates by score: exactly
    ``top_count(density, N)`` of them, ties in canonical order."""
    units = {n: nonnegative(t.detach().float().reshape(-1).cpu()) for n, t in scores.items()}
    if not all(bool(torch.isfinite(u).all()) for u in units.values()):
        raise FisherSelectError("scores hold NaN/inf; they cannot rank coordinates")
    numel = sum(u.numel() for u in units.values())
    chosen = top_units(units, float(top_count(density, numel)), weighted=False)
    return {n: chosen[n].reshape(scores[n].shape) for n in scores}
