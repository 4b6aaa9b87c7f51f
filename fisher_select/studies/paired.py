"""Paired statistics over replicates: the bound's outcome against a peer's, replicate by replicate."""

from __future__ import annotations

import math
import statistics

import numpy as np
from scipy import stats as sps

from fisher_select.stats.bootstrap import bootstrap_interval

TRAINED_SE = 3.0  # a kind counts as trained when full fine-tuning's improvement is at least this many SE


def paired(bound: list[float], peer: list[float], *, resamples: int = 10_000, seed: int = 0,
           level: float = 0.95) -> dict:
    """Mean of ``bound - peer`` over replicates with its percentile bootstrap interval (resampling
    replicates), the paired t-test's and the Wilcoxon signed-rank test's two-sided p-values (scipy).

    p-values are None with fewer than 2 replicates, t's when every difference is equal, Wilcoxon's
    when every difference is 0.
    """
    if len(bound) != len(peer):
        raise ValueError(f"paired statistics need one value per replicate on both sides, got {len(bound)} "
                         f"and {len(peer)}")
    d = np.asarray(bound, dtype=np.float64) - np.asarray(peer, dtype=np.float64)  # (R,)
    n = len(d)
    out = {"n": n, "mean_difference": float(d.mean()) if n else None, "interval": None, "level": level,
           "t_p": None, "wilcoxon_p": None, "differences": d.tolist()}
    if n < 2:
        return out
    out["interval"] = bootstrap_interval(d, resamples=resamples, seed=seed, level=level)
    if np.ptp(d) > 0:
        out["t_p"] = float(sps.ttest_rel(bound, peer).pvalue)
    if np.any(d != 0):
        out["wilcoxon_p"] = float(sps.wilcoxon(bound, peer).pvalue)
    return out


def trained(improvements: list[float]) -> dict:
    """Full fine-tuning's held-out improvement over replicates (> 0: better): mean, standard error, and
    whether the mean is at least ``TRAINED_SE`` standard errors above 0 (the kind trained at all)."""
    n = len(improvements)
    mean = statistics.fmean(improvements) if n else None  # None, not NaN: the record stays valid JSON
    se = statistics.stdev(improvements) / math.sqrt(n) if n > 1 else None
    ok = n > 1 and mean > 0 and (se == 0 or mean >= TRAINED_SE * se)
    return {"n": n, "mean": mean, "se": se, "z": mean / se if se and se > 0 else None, "trained": ok,
            "rule": f"mean improvement >= {TRAINED_SE:g} standard errors over replicates"}
