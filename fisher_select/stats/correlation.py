"""Agreement between two rankings: Spearman's rank correlation, top-k mask overlaps (module masses:
``stats.bounds.module_masses``)."""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats as sps

from fisher_select.stats import topk
from fisher_select.stats.ranking import top_count


def spearman(x, y) -> float | None:
    """Spearman's rank correlation (None when either side is constant or shorter than 3)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 3 or np.all(x == x[0]) or np.all(y == y[0]):
        return None
    return float(sps.spearmanr(x, y).statistic)


def mask_jaccards(fa: dict[str, torch.Tensor], fb: dict[str, torch.Tensor], fractions) -> list[float]:
    """Jaccard overlaps of the top-fraction coordinate masks of two Fishers over the same parameters
    (cut at the exact k-th largest value; coordinates tied with it all join), one per fraction."""
    ks = [top_count(f, sum(t.numel() for t in fa.values())) for f in fractions]
    fb = {n: fb[n] for n in fa}
    counts = topk.coarse_histogram(fa)[0], topk.coarse_histogram(fb)[0]
    return [both / either if either else 1.0 for both, either in topk.overlaps(fa, fb, ks, counts)]
