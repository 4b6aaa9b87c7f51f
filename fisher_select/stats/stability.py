"""Split-half stability of a Fisher estimate: do two disjoint halves of the prompts agree?

The verdict ``stable`` needs both stated thresholds: Spearman of the halves' module rankings
(sums of sqrt(F)) at least ``STABLE_SPEARMAN`` and Jaccard of their top-10% coordinate masks at
least ``STABLE_JACCARD``. Each message states the numbers it saw beside the thresholds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fisher_select.stats.bounds import module_masses
from fisher_select.stats.correlation import mask_jaccards, spearman
from fisher_select.stats.naming import module_of

TOP_FRACTIONS = (0.01, 0.1)  # split-half Jaccard of the top 1% and top 10% coordinate masks
STABLE_SPEARMAN = 0.9  # split halves agree on the module ranking at least this well: stable ...
STABLE_JACCARD = 0.5  # ... and their top-10% masks overlap at least this much
STABLE = "stable"
MORE_PROMPTS = "more prompts needed"


@dataclass
class SplitHalf:
    """F from two disjoint halves of the prompts (even / odd prompt index), compared."""

    prompts: list[int]  # [half A, half B]
    samples: list[int]
    spearman_bound_mass: float | None  # module sums of sqrt(F): the ranking the tables use
    spearman_fisher_mass: float | None  # module sums of F
    top_fractions: list[float]
    jaccard: list[float]  # of the halves' top-fraction coordinate masks, one per top fraction
    verdict: str
    prompts_suggested: int | None  # total prompts for the halves to meet both thresholds (``suggested_prompts``)
    message: str
    module_bound_mass: list[list[float]] = field(default_factory=list)  # per module: [half A, half B]
    modules: list[str] = field(default_factory=list)


def compare_halves(squares_a: dict[str, torch.Tensor], squares_b: dict[str, torch.Tensor], samples: list[int],
                   prompts: list[int]) -> SplitHalf:
    """``squares_*``: sums of h^2 over each half's samples (ranks and masks ignore the scale; the module
    masses shown are divided by each half's samples)."""
    modules = sorted({module_of(n) for n in squares_a})
    scale_a, scale_b = 1 / max(1, samples[0]), 1 / max(1, samples[1])
    masses_a, masses_b = module_masses(squares_a), module_masses(squares_b)
    sqrt_a = [masses_a[m].bound_mass * math.sqrt(scale_a) for m in modules]
    sqrt_b = [masses_b[m].bound_mass * math.sqrt(scale_b) for m in modules]
    rho = spearman([masses_a[m].fisher_mass for m in modules], [masses_b[m].fisher_mass for m in modules])
    jaccard = mask_jaccards(squares_a, squares_b, TOP_FRACTIONS)
    out = SplitHalf(list(prompts), list(samples), spearman(sqrt_a, sqrt_b), rho, list(TOP_FRACTIONS), jaccard, STABLE,
                    None, "", [[a, b] for a, b in zip(sqrt_a, sqrt_b)], modules)
    _stability_verdict(out)
    return out


def spearman_brown_prompts(rho: float, prompts: int, target: float = STABLE_SPEARMAN) -> int | None:
    """Total prompts at which halves would agree at ``target``, from halves of prompts / 2 agreeing at rho.

    Spearman-Brown: a half of k times the size agrees at k rho / (1 + (k - 1) rho).
    """
    if rho is None or rho <= 0:
        return None
    if rho >= target:
        return prompts
    k = target * (1 - rho) / (rho * (1 - target))
    return int(math.ceil(k * prompts - 1e-9))  # 9.000000000000002 x 10 prompts is 90


def suggested_prompts(rho: float | None, top10: float, prompts: int) -> int | None:
    """Total prompts at which the halves would meet both thresholds, projected from the split halves.

    Spearman-Brown projects each criterion that falls short: the module ranking (``rho`` to
    ``STABLE_SPEARMAN``) and, as a heuristic (masks overlap like a reliability: more prompts, more
    agreement), the top-10% Jaccard (``top10`` to ``STABLE_JACCARD``). The larger count wins, and it
    exceeds ``prompts`` whenever either criterion falls short. None when one is not positive: no trend
    to project.
    """
    needs = [spearman_brown_prompts(rho, prompts), spearman_brown_prompts(top10, prompts, STABLE_JACCARD)]
    if None in needs:
        return None
    short = rho < STABLE_SPEARMAN or top10 < STABLE_JACCARD
    return max(*needs, prompts + 1) if short else prompts


def _stability_verdict(out: SplitHalf) -> None:
    rho, top10 = out.spearman_bound_mass, out.jaccard[-1]
    total = sum(out.prompts)
    ok = rho is not None and rho >= STABLE_SPEARMAN and top10 >= STABLE_JACCARD
    out.verdict = STABLE if ok else MORE_PROMPTS
    out.prompts_suggested = suggested_prompts(rho, top10, total)
    text = (f"halves of {out.prompts[0]} and {out.prompts[1]} prompts: Spearman of module bound masses (sum sqrt(F)) "
            f"{_fmt(rho)} (Fisher masses, sum F, {_fmt(out.spearman_fisher_mass)}), Jaccard of the top-1% masks {out.jaccard[0]:.3g}, "
            f"top-10% {top10:.3g}")
    if ok:
        out.message = f"{text}: {STABLE}"
    elif out.prompts_suggested is not None and out.prompts_suggested > total:
        out.message = (f"{text}: {MORE_PROMPTS}; by Spearman-Brown about {out.prompts_suggested} prompts "
                       f"({out.prompts_suggested - total} more) would bring the halves to Spearman {STABLE_SPEARMAN} "
                       f"and top-10% Jaccard {STABLE_JACCARD}")
    else:
        out.message = (f"{text}: {MORE_PROMPTS} (needs Spearman >= {STABLE_SPEARMAN} and top-10% Jaccard >= "
                       f"{STABLE_JACCARD}; the coordinate masks converge more slowly than the module ranking)")


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"
