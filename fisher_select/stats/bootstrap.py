"""The percentile bootstrap interval of a mean over replicates (resampling replicates with replacement)."""

from __future__ import annotations

import numpy as np


def bootstrap_interval(values, *, resamples: int = 10_000, seed: int = 0, level: float = 0.95) -> list[float] | None:
    """[low, high] of the mean of ``values`` at ``level`` (percentile bootstrap, fp64); None with fewer than 2."""
    x = np.asarray(values, dtype=np.float64)  # (R,)
    n = len(x)
    if n < 2:
        return None
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, n, size=(resamples, n))].mean(axis=1)  # (resamples,)
    tail = (1.0 - level) / 2.0
    return [float(np.quantile(means, tail)), float(np.quantile(means, 1.0 - tail))]
