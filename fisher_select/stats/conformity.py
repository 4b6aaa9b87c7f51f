"""The score-mean check: do the samples follow the model?

Under the model ``E[h] = 0``, so ``z = mean(h) / stderr`` is about standard normal per coordinate
(a t with n - 1 degrees of freedom for n samples). The check counts the share of coordinates with
``|z| > 3`` against the share expected for n samples; the embeddings and output head, whose scores
are heavy-tailed rare-token jumps, are left out of the robust version the verdict uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy import stats as sps

from fisher_select.stats.histogram import Histogram

Z_CUT = 3.0  # the score-mean check counts coordinates with |z| > 3
NORMAL_SHARE = 2 * float(sps.norm.sf(Z_CUT))  # 0.27%: the share of |z| > 3 for a normal z
CONFORMITY_RATIO = 3.0  # share of |z| > 3 above this many times the expected share: flagged
CONSISTENT = "consistent with samples from the model"
OFF_POLICY = "far above the expected share: off-policy samples or a bug"


@dataclass
class ZSummary:
    """|z| of the score mean over one set of coordinates."""

    coordinates: int
    share_above: float  # share with |z| > Z_CUT
    rms_z: float
    median_abs_z: float
    ratio: float  # share_above / the expected share for this many samples


@dataclass
class ScoreMeanConformity:
    """Do the samples follow the model? E[h] = 0 under the model, so z = mean(h) / stderr is about
    standard normal per coordinate (t with n - 1 degrees of freedom for n samples)."""

    samples: int
    expected_share_normal: float  # 0.27%
    expected_share: float  # share of |z| > 3 expected for n samples (t reference)
    expected_median_abs_z: float
    all: ZSummary
    robust: ZSummary  # outside the embeddings and output head
    excluded_parameters: list[str]
    degenerate: int  # coordinates with F ~ mean^2 (samples agree to fp32 precision): no z
    heavy_tails: bool
    verdict: str
    message: str
    histogram: Histogram  # |z| of all coordinates
    histogram_robust: Histogram


Z_LINEAR = 240  # bins of width 0.025 on [0, 6) ...
Z_LOG = 60  # ... then log-spaced bins from 6 to 1e6 (the last one open-ended)


def z_edges() -> torch.Tensor:
    """Bin edges of |z|: fine up to 6 (the median and the |z| > 3 tail), then logarithmic."""
    return torch.cat([torch.linspace(0, 6, Z_LINEAR + 1), torch.logspace(math.log10(6), 6, Z_LOG + 1)[1:]]).double()


def score_mean_conformity(fisher: dict[str, torch.Tensor], score_mean: dict[str, torch.Tensor], n: int,
                          heavy_parameters: set[str]) -> ScoreMeanConformity:
    """``fisher``: mean h^2, ``score_mean``: mean h over n samples, per parameter.

    ``heavy_parameters`` (embeddings and output head) have scores made of rare-token jumps: a
    row's h is small and of one sign on most samples and large on the few that sample its token,
    so z there is far from normal even on-policy. The robust version leaves them out.
    """
    bins = Z_LINEAR + Z_LOG
    counts = {True: torch.zeros(bins, dtype=torch.float64), False: torch.zeros(bins, dtype=torch.float64)}
    zsq = {True: 0.0, False: 0.0}
    degenerate = 0
    for name, f in fisher.items():
        heavy = name in heavy_parameters
        c, sq, bad = _z_counts(f, score_mean[name], n)
        counts[heavy] += c
        zsq[heavy] += sq
        degenerate += bad
    return _conformity(n, z_edges(), counts, zsq, degenerate, sorted(heavy_parameters & set(fisher)))


def _z_counts(f: torch.Tensor, m: torch.Tensor, n: int) -> tuple[torch.Tensor, float, int]:
    """|z| counts per bin of z_edges(), the sum of z^2 and the coordinates without a z, in fp32 passes."""
    f, m = f.detach().reshape(-1).float(), m.detach().reshape(-1).float()
    var = f - m * m  # per-sample variance of h (divisor n)
    ok = var > 1e-5 * f  # below: cancellation of fp32 sums (error > 0.6% of var), no z; F = 0: no z
    z = m.abs() * math.sqrt(n) * torch.rsqrt(torch.where(ok, var, 1.0))
    linear = (z / (6.0 / Z_LINEAR)).floor()
    step = math.log10(1e6 / 6) / Z_LOG
    logged = Z_LINEAR + (torch.log10(z.clamp_min(6.0) / 6.0) / step).floor()
    idx = torch.where(z < 6.0, linear, logged).clamp(max=Z_LINEAR + Z_LOG - 1)
    idx = torch.where(ok, idx, Z_LINEAR + Z_LOG).long()  # one overflow bin for "no z", dropped
    counts = torch.bincount(idx, minlength=Z_LINEAR + Z_LOG + 1)[:-1].double().cpu()
    zsq = float(torch.where(ok, z * z, 0.0).sum())  # fp32 cascade summation
    return counts, zsq, int(torch.count_nonzero((f > 0) & ~ok))


def _summary(counts: torch.Tensor, zsq: float, edges: torch.Tensor, expected: float) -> ZSummary:
    total = float(counts.sum())
    if total == 0:
        return ZSummary(0, 0.0, math.nan, math.nan, math.nan)
    cut = int(torch.searchsorted(edges, torch.tensor(Z_CUT, dtype=torch.float64)))
    share = float(counts[cut:].sum()) / total
    return ZSummary(int(total), share, math.sqrt(zsq / total), _histogram_median(counts, edges), share / expected)


def _histogram_median(counts: torch.Tensor, edges: torch.Tensor) -> float:
    cum = counts.cumsum(0)
    half = float(cum[-1]) / 2
    i = int(torch.searchsorted(cum, torch.tensor(half, dtype=torch.float64)))
    below = float(cum[i - 1]) if i > 0 else 0.0
    frac = (half - below) / float(counts[i]) if counts[i] > 0 else 0.0
    return float(edges[i] + frac * (edges[i + 1] - edges[i]))


def expected_abs_z(n: int) -> tuple[float, float]:
    """(share of |z| > 3, median |z|) for z = sqrt(n / (n - 1)) t_{n-1}: what on-policy samples give."""
    if n < 2:
        return math.nan, math.nan
    stretch = math.sqrt(n / (n - 1))
    return 2 * float(sps.t.sf(Z_CUT / stretch, n - 1)), stretch * float(sps.t.ppf(0.75, n - 1))


def _conformity(n, edges, counts, zsq, degenerate, excluded) -> ScoreMeanConformity:
    share, median = expected_abs_z(n)
    every = _summary(counts[True] + counts[False], zsq[True] + zsq[False], edges, share)
    robust = _summary(counts[False], zsq[False], edges, share) if counts[False].sum() > 0 else every
    flagged = robust.ratio > CONFORMITY_RATIO
    heavy = every.ratio > CONFORMITY_RATIO and not flagged
    verdict = OFF_POLICY if flagged else CONSISTENT
    message = (f"{_pct(robust.share_above)} of coordinates have |z| > 3 against {_pct(share)} expected for {n} "
               f"samples ({robust.ratio:.3g}x; normal: {_pct(NORMAL_SHARE)})")
    if excluded:
        message += " outside the embeddings and output head"
    if heavy:
        message += (f"; with them {_pct(every.share_above)} ({every.ratio:.3g}x, RMS z {every.rms_z:.3g}): their "
                    "rare-token scores are heavy-tailed, which inflates z, so the verdict uses the robust version")
    message += f": {verdict}" + (" (samples drawn at another temperature, truncated, or a scoring bug)"
                                 if flagged else "")
    return ScoreMeanConformity(n, NORMAL_SHARE, share, median, every, robust, excluded, degenerate, heavy, verdict,
                               message, Histogram(edges.tolist(), (counts[True] + counts[False]).tolist()),
                               Histogram(edges.tolist(), counts[False].tolist()))


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"
