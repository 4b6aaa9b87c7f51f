"""How well a ranking of coordinates predicts realized movement.

All coordinate metrics are computed on one seeded random subsample of coordinates (``Subsample``:
uniform without replacement over all coordinates of all parameters; every coordinate when the
model has no more than the requested size), the same subsample for every ranking:

- ``auroc``: the ranking's AUROC for "moved more than the q-quantile of realized movement", from
  the Mann-Whitney U statistic (``scipy.stats.mannwhitneyu``): ``U_moved / (n_moved n_rest)``, ties
  counted one half;
- ``precision_at_k`` / ``recall_at_k``: the top-k fraction of the ranking as a mask, against the
  moved set (realized top ``1 - MOVED_Q`` of the subsample): share of the mask that moved, share of
  the moved coordinates in the mask;
- ``jaccard_at_k``: predicted top-k vs realized top-k (same k), ``|A & B| / |A | B|``;
- ``spearman``: ``scipy.stats.spearmanr`` (coordinates on the subsample; modules on full sums).

Ties in a ranking (module-level rules broadcast to coordinates, F = 0) are broken at random
(seeded) when a top-k is taken; AUROC counts them one half.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import stats

from fisher_select.stats.correlation import spearman

QUANTILES = (0.99, 0.9)  # "moved" = above this quantile of realized movement (AUROC)
MOVED_Q = 0.99  # the moved set for precision / recall: the top 1% of realized movement
TOP_K = (0.001, 0.01, 0.1)  # mask densities for precision, recall and Jaccard


class Subsample:
    """A seeded uniform subsample of coordinates over named tensors (in ``shapes`` order)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], size: int | None, seed: int):
        self.names = list(shapes)
        numels = torch.tensor([math.prod(s) for s in shapes.values()], dtype=torch.long)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), numels.cumsum(0)])  # (P+1,)
        self.total = int(self.offsets[-1])
        gen = torch.Generator().manual_seed(seed)
        if size is None or size >= self.total:
            flat = torch.arange(self.total)
        else:
            flat = _sample_without_replacement(self.total, size, gen)
        self.flat = flat  # (M,) sorted global indices
        self.param_of = torch.searchsorted(self.offsets[1:], flat, right=True)  # (M,) parameter index
        self.local = flat - self.offsets[self.param_of]  # (M,) index inside the parameter
        self.starts = torch.searchsorted(self.param_of, torch.arange(len(self.names) + 1))  # (P+1,)

    @property
    def size(self) -> int:
        return self.flat.numel()

    def take(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """(M,) fp32 values of the subsampled coordinates."""
        out = torch.empty(self.size, dtype=torch.float32)
        for j, name in enumerate(self.names):
            a, b = int(self.starts[j]), int(self.starts[j + 1])
            if b > a:
                out[a:b] = tensors[name].detach().reshape(-1)[self.local[a:b].to(tensors[name].device)].float().cpu()
        return out

    def broadcast(self, per_parameter: list[float]) -> torch.Tensor:
        """(M,) the value of each coordinate's parameter (module-level rules as coordinate scores)."""
        return torch.tensor(per_parameter, dtype=torch.float32)[self.param_of]

    def describe(self, seed: int) -> dict:
        return {"coordinates": self.size, "of": self.total, "seed": seed,
                "method": "uniform without replacement over all coordinates (every coordinate when the model "
                          "has no more than the requested size)"}


def _sample_without_replacement(total: int, size: int, gen: torch.Generator) -> torch.Tensor:
    """(size,) sorted distinct indices in [0, total), uniform; no randperm of ``total`` elements."""
    picked = torch.zeros(0, dtype=torch.long)
    while picked.numel() < size:  # draw with replacement, drop repeats, top up (few rounds when size << total)
        extra = torch.randint(0, total, (int((size - picked.numel()) * 1.05) + 16,), generator=gen)
        picked = torch.unique(torch.cat([picked, extra]))
    keep = torch.randperm(picked.numel(), generator=gen)[:size]  # a uniform subset of the distinct draws
    return picked[keep].sort().values


def ranked(scores: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """All indices by decreasing score, ties in uniformly random (seeded) order: ``[:k]`` is a top-k."""
    perm = torch.randperm(scores.numel(), generator=gen)
    return perm[torch.argsort(scores[perm], descending=True, stable=True)]


def count_for(fraction: float, n: int) -> int:
    return min(n, max(1, round(fraction * n)))


def moved_mask(movement: torch.Tensor, q: float) -> torch.Tensor:
    """(M,) bool: movement strictly above its q-quantile (fewer when many coordinates tie there)."""
    threshold = float(np.quantile(movement.double().numpy(), q))
    return movement > threshold


def _first(order: torch.Tensor, k: int) -> torch.Tensor:
    mask = torch.zeros(order.numel(), dtype=torch.bool)
    mask[order[:k]] = True
    return mask


class Realized:
    """One realized movement (M,) and its sets, computed once for every ranking scored against it:
    the moved masks per quantile and the realized top-k at each fraction."""

    def __init__(self, movement: torch.Tensor, fractions, seed: int):
        self.movement, self.n = movement, movement.numel()
        self.moved = {q: moved_mask(movement, q) for q in {*QUANTILES, MOVED_Q}}
        order = ranked(movement, torch.Generator().manual_seed(seed))
        self.top = {f: _first(order, count_for(f, self.n)) for f in {*TOP_K, *fractions}}


def auroc(scores: torch.Tensor, positive: torch.Tensor) -> float | None:
    """AUROC of ``scores`` for the bool labels ``positive`` (Mann-Whitney U, ties one half)."""
    pos, neg = scores[positive].double().numpy(), scores[~positive].double().numpy()
    if len(pos) == 0 or len(neg) == 0:
        return None
    u = stats.mannwhitneyu(pos, neg, alternative="two-sided", method="asymptotic", use_continuity=False).statistic
    return float(u) / (len(pos) * len(neg))


def ranking_metrics(scores: torch.Tensor, realized: Realized, seed: int, fractions=()) -> tuple[dict, list[float]]:
    """Every coordinate metric of one ranking (M,) against one realized movement, and its curve:
    the share of the predicted top-k in the realized top-k at each of ``fractions``."""
    order = ranked(scores, torch.Generator().manual_seed(seed))
    moved = realized.moved[MOVED_Q]
    out = {"auroc": {f"q{q}": auroc(scores, realized.moved[q]) for q in QUANTILES},
           "precision_at_k": {}, "recall_at_k": {}, "jaccard_at_k": {},
           "spearman_coordinates": spearman(scores.numpy(), realized.movement.numpy())}
    for frac in TOP_K:
        k = count_for(frac, realized.n)
        mask, top = _first(order, k), realized.top[frac]
        hit = int((mask & moved).sum())
        out["precision_at_k"][str(frac)] = hit / k
        out["recall_at_k"][str(frac)] = hit / max(1, int(moved.sum()))
        out["jaccard_at_k"][str(frac)] = int((mask & top).sum()) / int((mask | top).sum())
    curve = [float(realized.top[f][order[: count_for(f, realized.n)]].float().mean()) for f in fractions]
    return out, curve


def selection_metrics(selected: torch.Tensor, realized: Realized) -> dict:
    """A fixed selection (bool (M,)) against the moved set: its density, precision and recall."""
    moved = realized.moved[MOVED_Q]
    hit = int((selected & moved).sum())
    return {"density": float(selected.float().mean()), "precision": hit / max(1, int(selected.sum())),
            "recall": hit / max(1, int(moved.sum()))}


def first_step_check(delta: dict, noise: dict, bound: dict, start: dict, lr: float) -> dict:
    """After one SGD step of size ``lr``: how often ``|delta_i| / lr`` (the batch's gradient) exceeds the bound.

    ``noise``: per coordinate, an estimate of the batch gradient's noise with the same variance
    (two halves' difference, scaled): the share where it alone exceeds the bound is the rate that
    noise produces when the expected gradient is 0. ``beyond_rounding`` allows one fp32 ulp of the
    weight, the most rounding can add to a measured step.
    """
    n = above = above_rounding = noise_above = unseen_moved = 0
    worst = 0.0
    for name, d in delta.items():
        b, est = bound[name], d / lr
        ulp = spacing(start[name].abs() + d)
        above += int((est > b).sum())
        above_rounding += int((d > lr * b + ulp).sum())
        noise_above += int((noise[name] > b).sum())
        unseen_moved += int(((b == 0) & (d > ulp)).sum())
        seen = b > 0
        if seen.any():
            worst = max(worst, float((est[seen] / b[seen]).max()))
        n += d.numel()
    return {"violation_rate": above / n, "violation_rate_beyond_rounding": above_rounding / n,
            "noise_violation_rate": noise_above / n, "coordinates": n,
            "moved_with_zero_bound": unseen_moved, "max_ratio_to_bound": worst,
            "meaning": "share of coordinates where |delta_i|/lr (one SGD step on the batch's mean gradient) exceeds "
                       "the bound sqrt(F_i S); noise_violation_rate: the same share for an estimate of the batch "
                       "gradient's noise alone (what sampling noise produces where the expected gradient is 0); "
                       "moved_with_zero_bound: coordinates the calibration samples never touched (F = 0) that moved"}


def spacing(values: torch.Tensor) -> torch.Tensor:
    """One fp32 ulp at each value."""
    v = values.float()
    return (torch.nextafter(v, torch.full_like(v, float("inf"))) - v).abs()
