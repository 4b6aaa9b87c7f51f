"""Agreement between two rankings: Spearman's rank correlation, module sums, top-k mask overlaps."""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats as sps

from fisher_select.stats import topk
from fisher_select.stats.naming import module_of
from fisher_select.stats.ranking import top_count


def spearman(x, y) -> float | None:
    """Spearman's rank correlation (None when either side is constant or shorter than 3)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 3 or np.all(x == x[0]) or np.all(y == y[0]):
        return None
    return float(sps.spearmanr(x, y).statistic)


def module_sums(f: dict[str, torch.Tensor], modules: list[str], sqrt: bool) -> list[float]:
    sums = dict.fromkeys(modules, 0.0)
    for name, t in f.items():
        t = t.detach().float()
        # fp32 cascade summation (relative error ~1e-7): a float64 reduction costs 4x on CPU
        sums[module_of(name)] += float((t.clamp_min(0).sqrt() if sqrt else t).sum())
    return [sums[m] for m in modules]


def mask_jaccards(fa: dict[str, torch.Tensor], fb: dict[str, torch.Tensor], fractions) -> list[float]:
    """Jaccard overlaps of the top-fraction coordinate masks of two Fishers over the same parameters
    (cut at the exact k-th largest value; coordinates tied with it all join), one per fraction."""
    ks = [top_count(f, sum(t.numel() for t in fa.values())) for f in fractions]
    fb = {n: fb[n] for n in fa}
    counts = topk.coarse_histogram(fa)[0], topk.coarse_histogram(fb)[0]
    return [both / either if either else 1.0 for both, either in topk.overlaps(fa, fb, ks, counts)]
