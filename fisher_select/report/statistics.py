"""The numbers a user decides from: uncertainty of S, concentration of F, the bound's tightness and
each objective's signal. Pure functions of tensors and lists; the sampling conformity and split-half
stability sections come from ``fisher_select.stats`` (the calibration computes them too).

Every result is a dataclass written into report.json under ``statistics`` (docs/REPORT.md names
each key); ``ReportStatistics.from_json`` reads it back. The thresholds behind each verdict are
the constants below, and each verdict's message states the number it saw.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import stats as sps

from fisher_select.stats import topk
from fisher_select.stats.conformity import ScoreMeanConformity
from fisher_select.stats.histogram import Histogram
from fisher_select.stats.naming import layer_and_kind, module_of
from fisher_select.stats.ranking import top_count
from fisher_select.stats.stability import SplitHalf

LEVEL = 0.95  # confidence level of every interval
RESAMPLES = 2000  # bootstrap resamples of the prompts
BOOTSTRAP_SEED = 0  # the bootstrap is reproducible: same terms, same interval
CONCENTRATION_FRACTIONS = (0.001, 0.01, 0.1)  # share of F mass in the top 0.1% / 1% / 10%


# ---------------------------------------------------------------------------
# Uncertainty of S


@dataclass
class ScaleUncertainty:
    """S of one objective with its analytic standard error and a bootstrap interval over prompts."""

    objective: str
    signal_scale: float | None
    num_prompts: int
    prompts_without_signal: int  # prompts whose scale term is exactly 0
    stderr: float | None  # std(terms, ddof=1) / sqrt(N): the analytic standard error
    relative_stderr: float | None
    t_interval: list[float] | None  # S -+ t_{N-1} stderr
    bootstrap_interval: list[float] | None  # BCa bootstrap interval of the mean over resampled prompts
    level: float = LEVEL
    resamples: int = RESAMPLES
    scale_terms: list[float | str] = field(default_factory=list)  # per prompt: its E[a^2 | x]; "inf"/"nan" as text
    note: str = ""


def scale_uncertainty(objective: str, terms: list[float], *, level: float = LEVEL, resamples: int = RESAMPLES,
                      seed: int = BOOTSTRAP_SEED) -> ScaleUncertainty:
    """S = mean of the per-prompt terms; prompts are independent, so resampling them gives S's spread."""
    t = np.asarray(terms, dtype=np.float64)  # (N,)
    n = t.size
    out = ScaleUncertainty(objective, None, n, int((t == 0).sum()), None, None, None, None, level, resamples,
                           [float(v) if math.isfinite(v) else str(float(v)) for v in t])
    if n == 0 or not np.isfinite(t).all():
        out.signal_scale = float(t.mean()) if n and not np.isnan(t).any() else None
        out.note = "no prompts" if n == 0 else "a prompt's term is infinite or undefined: S has no interval"
        return out
    out.signal_scale = float(t.mean())
    if n < 2:
        out.note = "one prompt: no spread to estimate an interval from"
        return out
    se = float(t.std(ddof=1) / math.sqrt(n))
    half = float(sps.t.ppf(0.5 + level / 2, n - 1)) * se
    floor = 0.0 if (t >= 0).all() else -math.inf  # scale terms are variances: S >= 0
    out.stderr, out.t_interval = se, [max(floor, out.signal_scale - half), out.signal_scale + half]
    out.relative_stderr = se / out.signal_scale if out.signal_scale > 0 else None
    out.bootstrap_interval = _bootstrap_mean(t, level, resamples, seed)
    return out


def _bootstrap_mean(t: np.ndarray, level: float, resamples: int, seed: int) -> list[float]:
    """BCa interval of the mean of ``t`` over prompts resampled with replacement (numpy RNG, seeded).

    Scale terms are skewed (non-negative, often many zeros), so the plain percentile interval
    undercovers with few prompts; BCa corrects its bias and skew. The jackknife of a mean is
    closed-form, so this costs O(N) memory beyond the resamples. Constant terms: the point itself.
    """
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 2_000_000 // t.size)  # bounded memory for many prompts
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        means[start:stop] = t[rng.integers(0, t.size, (stop - start, t.size))].mean(1)
    est = float(t.mean())
    jack = (t.sum() - t) / (t.size - 1)  # (N,) leave-one-out means
    d = jack.mean() - jack
    below = float((means < est).mean())
    if not 0 < below < 1 or not (d**2).sum() > 0:
        lo, hi = np.quantile(means, [0.5 - level / 2, 0.5 + level / 2])
        return [float(lo), float(hi)]
    z0 = sps.norm.ppf(below)
    accel = (d**3).sum() / (6 * (d**2).sum() ** 1.5)
    z = sps.norm.ppf([0.5 - level / 2, 0.5 + level / 2])
    probs = sps.norm.cdf(z0 + (z0 + z) / (1 - accel * (z0 + z)))
    lo, hi = np.quantile(means, probs)
    return [float(lo), float(hi)]


# ---------------------------------------------------------------------------
# Spread of the module masses over scoring batches


def module_spread(names: list[str], unit_masses: list[list[float]], unit_counts: list[int]) -> dict[str, float]:
    """Relative standard error of each module's F mass from the spread over scoring units.

    A unit is one scoring call (the samples of whole prompts); F_mod = sum_u M_u / sum_u n_u is a
    ratio estimator with variance sum_u (M_u - F_mod n_u)^2 / (U (U - 1) nbar^2).
    """
    u = len(unit_counts)
    if u < 2:
        return {}
    masses = np.asarray(unit_masses, dtype=np.float64)  # (U, P)
    counts = np.asarray(unit_counts, dtype=np.float64)  # (U,)
    modules = sorted({module_of(n) for n in names})
    column = {m: [i for i, n in enumerate(names) if module_of(n) == m] for m in modules}
    out = {}
    for m, cols in column.items():
        mass = masses[:, cols].sum(1)  # (U,)
        f = mass.sum() / counts.sum()
        if f <= 0:
            continue
        var = ((mass - f * counts) ** 2).sum() / (u * (u - 1) * counts.mean() ** 2)
        out[m] = float(math.sqrt(var) / f)
    return out


# ---------------------------------------------------------------------------
# Concentration and the bound


@dataclass
class Concentration:
    """How concentrated F is: mass in the top coordinates and the cumulative-mass curve."""

    coordinates: int
    zero_coordinates: int
    fractions: list[float]
    fisher_mass_shares: list[float]  # share of the total F mass in the top fraction of coordinates (exact)
    curve_fraction: list[float]  # cumulative curve (from a fine log10 histogram): fraction of coordinates ...
    curve_mass: list[float]  # ... and the share of F mass they hold
    log10_histogram: Histogram  # coordinates per log10 F bin (F > 0)


def concentration(fisher: dict[str, torch.Tensor], bins: int = 400, points: int = 400) -> Concentration:
    """Shares of the top fractions (the k-th largest F exactly), the curve and a log10 histogram from
    one coarse histogram of F's bit patterns (bins 0.8% wide in value)."""
    numel = sum(t.numel() for t in fisher.values())
    counts, masses = topk.coarse_histogram(fisher, masses=True)
    total = float(masses.sum())
    tops = topk.top_masses(fisher, [top_count(f, numel) for f in CONCENTRATION_FRACTIONS], counts, masses)
    shares = [m / total if total > 0 else 0.0 for m in tops]
    zeros = sum(int(torch.count_nonzero(t == 0)) for t in fisher.values())
    used = (counts > 0).nonzero().reshape(-1).flip(0)  # non-empty bins, largest values first
    cum_n = np.concatenate([[0.0], counts[used].cumsum(0).numpy()]) / max(1, numel)
    cum_m = np.concatenate([[0.0], masses[used].cumsum(0).numpy()]) / (total if total > 0 else 1.0)
    pick = np.unique(np.linspace(0, len(cum_n) - 1, min(points, len(cum_n))).round().astype(int))
    return Concentration(numel, zeros, list(CONCENTRATION_FRACTIONS), shares, cum_n[pick].tolist(),
                         cum_m[pick].tolist(), _log10_histogram(counts, bins))


def _log10_histogram(counts: torch.Tensor, bins: int) -> Histogram:
    """Coordinates per log10 F bin (F > 0), re-binned from the coarse histogram by each bin's floor."""
    used = (counts > 0).nonzero().reshape(-1)
    used = used[used > 0]  # bin 0: F = 0 (or below 1e-40)
    if not used.numel():
        return Histogram([0.0, 1.0], [0.0])
    logs = topk.bin_floors(used).double().log10().numpy()
    lo, hi = math.floor(logs.min()), math.ceil(logs.max())
    hi = hi if hi > lo else lo + 1
    hist, edges = np.histogram(logs, bins=bins, range=(lo, hi), weights=counts[used].numpy())
    return Histogram(edges.tolist(), hist.tolist())


@dataclass
class BoundRatio:
    """|g_hat_i| / sqrt(F_i S) per module kind: at most 1 up to noise (Cauchy-Schwarz on the samples)."""

    objective: str
    kinds: list[str]
    quantiles: list[float]
    values: list[list[float | None]]  # per kind, per quantile
    share_above_1: list[float]
    histograms: list[Histogram]  # per kind, log10 ratio
    note: str = ("the sample's own Cauchy-Schwarz gives |g_hat| <= sqrt(mean(a^2) F): ratios slightly above 1 "
                 "come from mean(a^2) exceeding the estimate S (e.g. K / (K - 1) for leave-one-out signals)")


RATIO_QUANTILES = (0.5, 0.9, 0.99, 1.0)


RATIO_RANGE = (-8.0, 2.0)  # log10 |g_hat| / bound shown; beyond it, the end bins
RATIO_FINE = 1000  # 0.01-decade bins for the quantiles; the stored histogram sums 5 of them


def bound_ratio(objective: str, grad: dict[str, torch.Tensor], fisher: dict[str, torch.Tensor],
                scale: float) -> BoundRatio:
    per_kind: dict[str, torch.Tensor] = {}
    largest: dict[str, float] = {}
    for name, f in fisher.items():
        kind = layer_and_kind(module_of(name))[1]
        counts, top = _ratio_counts(grad[name], f, math.sqrt(scale))
        per_kind[kind] = per_kind.get(kind, 0) + counts
        largest[kind] = max(largest.get(kind, 0.0), top)
    kinds = sorted(per_kind)
    lo, hi = RATIO_RANGE
    fine_edges = np.linspace(lo, hi, RATIO_FINE + 1)
    one = int(round(-lo / (hi - lo) * RATIO_FINE))  # the fine bin starting at ratio 1
    values, above, hists = [], [], []
    for kind in kinds:
        c = per_kind[kind].numpy()
        total = c.sum()
        values.append([_fine_quantile(c, fine_edges, q) for q in RATIO_QUANTILES[:-1]] + [largest[kind]]
                      if total else [None] * len(RATIO_QUANTILES))
        above.append(float(c[one:].sum() / total) if total else 0.0)
        hists.append(Histogram(fine_edges[::5].tolist(), c.reshape(-1, 5).sum(1).tolist()))
    return BoundRatio(objective, kinds, list(RATIO_QUANTILES), values, above, hists)


def _ratio_counts(g: torch.Tensor, f: torch.Tensor, root: float) -> tuple[torch.Tensor, float]:
    """Counts of log10 |g| / sqrt(F S) per fine bin over coordinates with F > 0, and the largest ratio."""
    g, f = g.detach().reshape(-1).float(), f.detach().reshape(-1).float()
    ok = f > 0
    ratio = torch.where(ok, g.abs() * torch.rsqrt(torch.where(ok, f, 1.0)) / root, 0.0)
    lo, hi = RATIO_RANGE
    idx = ((torch.log10(ratio) - lo) / ((hi - lo) / RATIO_FINE)).floor().clamp(0, RATIO_FINE - 1)  # 0: -inf too
    idx = torch.where(ok, idx, RATIO_FINE).long()
    counts = torch.bincount(idx, minlength=RATIO_FINE + 1)[:-1].double().cpu()
    return counts, float(ratio.max()) if ratio.numel() else 0.0


def _fine_quantile(counts: np.ndarray, edges: np.ndarray, q: float) -> float:
    """Quantile of a histogram, interpolated inside its bin in log10 (resolution 0.01 decade)."""
    cum = np.cumsum(counts)
    target = q * cum[-1]
    i = int(np.searchsorted(cum, target))
    before = cum[i - 1] if i > 0 else 0.0
    frac = (target - before) / counts[i] if counts[i] > 0 else 0.0
    return float(10 ** (edges[i] + frac * (edges[i + 1] - edges[i])))


# ---------------------------------------------------------------------------
# Signal diagnostics per objective


VALUE_LABELS = {"rl": "reward", "sft": "log importance weight", "opd-pg": "sigma = log T - log pi (sequence)",
                "opd-full": "KL(pi || T) along the response"}


@dataclass
class SignalDiagnostics:
    """What one objective's signal looked like: labelled numbers and a histogram of its raw values."""

    objective: str
    type: str
    numbers: list[list]  # [label, value] pairs, in display order
    value_label: str
    histogram: Histogram | None  # of the per-sample raw values (reward, log w, sigma, ...)


def signal_diagnostics(entry, samples: list[dict], num_prompts: int) -> SignalDiagnostics:
    """``entry``: an ObjectiveEntry; ``samples``: samples.jsonl records (with ``value`` per objective)."""
    d = entry.details
    values = [s["value"].get(entry.name) for s in samples if isinstance(s.get("value"), dict)]
    values = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    numbers: list[list] = []
    silent = d.get("prompts_without_signal")
    if silent is not None and num_prompts:
        numbers.append(["prompts without signal (zero variance)", silent])
        numbers.append(["share of prompts without signal", silent / num_prompts])
    if values:
        numbers += [["mean value", float(np.mean(values))], ["std of values", float(np.std(values))],
                    ["distinct values", len(set(values))]]
    numbers += _type_numbers(entry, samples)
    hist = _value_histogram(values) if values else None
    return SignalDiagnostics(entry.name, entry.type, numbers, VALUE_LABELS.get(entry.type, "value"), hist)


def _type_numbers(entry, samples: list[dict]) -> list[list]:
    d, out = entry.details, []
    weights = d.get("weights") if isinstance(d.get("weights"), dict) else None
    if weights:  # SFT toward a density: importance weights
        out += [["ESS / K (mean over prompts)", weights.get("ess_mean_fraction")],
                ["smallest ESS", weights.get("ess_min")], ["largest weight share", weights.get("max_weight_share")],
                ["prompts dominated by one sample", weights.get("prompts_dominated")]]
    if entry.type in ("opd-pg", "opd-full"):
        lengths = [len(s.get("response_ids", [])) for s in samples]
        mean_len = float(np.mean(lengths)) if lengths else None
        s = entry.signal_scale
        out += [["signal per sequence (S)", s], ["mean response tokens", mean_len],
                ["signal per token (S / mean tokens)", s / mean_len if s is not None and mean_len else None]]
        for key, label in (("reverse_kl_estimate", "reverse KL estimate"),
                           ("signal_scale_sampled", "S from the sampled tokens")):
            if key in d:
                out.append([label, d[key]])
    return out


def _value_histogram(values: list[float], bins: int = 30) -> Histogram:
    lo, hi = min(values), max(values)
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    distinct = sorted(set(values))
    if len(distinct) <= bins:  # few distinct values (0/1 rewards): one bin each
        gaps = np.diff(distinct).min() if len(distinct) > 1 else 1.0
        edges = np.concatenate([[distinct[0] - gaps / 2], np.asarray(distinct) + gaps / 2])
    else:
        edges = np.linspace(lo, hi, bins + 1)
    counts, _ = np.histogram(values, bins=edges)
    return Histogram(edges.tolist(), counts.astype(float).tolist())


# ---------------------------------------------------------------------------
# All of it, as written in report.json


@dataclass
class ReportStatistics:
    uncertainty: list[ScaleUncertainty] = field(default_factory=list)
    conformity: ScoreMeanConformity | None = None
    stability: SplitHalf | None = None
    concentration: Concentration | None = None
    bound_ratios: list[BoundRatio] = field(default_factory=list)
    signals: list[SignalDiagnostics] = field(default_factory=list)

    def to_json(self) -> dict:
        return _clean(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, data: dict | None) -> "ReportStatistics":
        return _build(cls, data or {})


def _clean(obj):
    """inf/nan (JSON has none) -> None, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _build(tp, data):
    """A dataclass tree from its JSON (unknown keys are ignored, missing ones take defaults)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if data is None:
        return None
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        kwargs = {f.name: _build(hints[f.name], data[f.name]) for f in dataclasses.fields(tp) if f.name in data}
        return tp(**kwargs)
    if origin is list and args:
        return [_build(args[0], v) for v in data]
    if args and type(None) in args:  # X | None
        inner = [a for a in args if a is not type(None)]
        return _build(inner[0], data) if len(inner) == 1 else data
    return data
