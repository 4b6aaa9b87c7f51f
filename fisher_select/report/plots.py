"""The report's figures, drawn with matplotlib and embedded as PNG data URIs (nothing external).

Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas, so pyplot's global state and
the user's backend are never touched. Each function returns a ``Plot`` or None when its data is
missing (e.g. no bound when S is unknown).
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogFormatterSciNotation
from scipy import stats as sps

from fisher_select.report.statistics import ReportStatistics
from fisher_select.report.text import ranked_modules
from fisher_select.run.schema import RunReport
from fisher_select.stats.naming import layer_and_kind

TOP = 30  # modules in the per-module bar charts
DPI = 100
_PERCENT = FuncFormatter(lambda x, _: f"{100 * x:.3g}%")  # 0.1% stays 0.1% on a log axis


@dataclass
class Plot:
    key: str  # anchor id in the page
    title: str
    caption: str
    data_uri: str


def _figure(width: float = 9.0, height: float = 4.5) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _uri(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _positive(values) -> list[float]:
    return [v if v is not None and v > 0 and math.isfinite(v) else math.nan for v in values]


def all_plots(report: RunReport) -> list[Plot]:
    stats = ReportStatistics.from_json(report.statistics)
    makers = [lambda: objectives_plot(report, stats), lambda: modules_plot(report),
              lambda: bounds_plot(report), lambda: heatmap_plot(report), lambda: layers_plot(report),
              lambda: cumulative_plot(stats), lambda: fisher_histogram_plot(stats), lambda: ratio_plot(stats),
              lambda: z_plot(stats), lambda: split_half_plot(stats), lambda: signals_plot(stats)]
    return [p for p in (make() for make in makers) if p is not None]


def objectives_plot(report: RunReport, stats: ReportStatistics) -> Plot | None:
    rows = [(u.objective, u.signal_scale, u.bootstrap_interval) for u in stats.uncertainty
            if u.signal_scale is not None and math.isfinite(u.signal_scale) and u.signal_scale > 0]
    if not rows:
        return None
    fig = _figure(7, 0.6 * len(rows) + 1.6)
    ax = fig.add_subplot()
    touches_zero = any(iv and iv[0] <= 0 for _, _, iv in rows)  # a log axis would hide an interval down to 0
    for i, (name, s, iv) in enumerate(rows):
        lo, hi = (iv if iv else (s, s))
        ax.errorbar([s], [i], xerr=[[s - lo], [hi - s]], fmt="o", capsize=4, color="C0")
        ax.annotate(f"{s:.3g} [{lo:.3g}, {hi:.3g}]", (s, i), textcoords="offset points", xytext=(0, 8),
                    ha="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_ylim(-0.6, len(rows) - 0.2)
    if touches_zero:
        ax.set_xlim(left=0)
    else:
        ax.set_xscale("log")
    ax.set_xlabel("signal scale S (95% bootstrap interval over prompts)")
    ax.set_ylabel("objective")
    ax.grid(True, which="both", axis="x", alpha=0.3)
    return Plot("scales", "Signal scale S per objective", "Point: S; bar: the 95% BCa bootstrap interval over "
                "prompts. The bound sqrt(F S) scales with sqrt(S).", _uri(fig))


def modules_plot(report: RunReport) -> Plot | None:
    mods = ranked_modules(report)[:TOP]
    if not mods:
        return None
    fig = _figure(9, 0.22 * len(mods) + 1.4)
    ax = fig.add_subplot()
    y = np.arange(len(mods))
    ax.barh(y - 0.2, _positive([m.bound_share for m in mods]), 0.4, label="share of the bound mass, sum sqrt(F) (the ranking)")
    ax.barh(y + 0.2, _positive([m.fisher_share for m in mods]), 0.4, label="share of the Fisher mass, sum F")
    ax.set_yticks(y, [m.name for m in mods], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(LogFormatterSciNotation())
    ax.set_xlabel("share of the model's total")
    ax.set_ylabel("module")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="major", axis="x", alpha=0.3)
    return Plot("modules", f"Top {len(mods)} modules by sum of sqrt(F)",
                "Both aggregates per module; the tables rank by sqrt(F), which predicts movement (the F mass is "
                "dominated by a few huge coordinates).", _uri(fig))


def bounds_plot(report: RunReport) -> Plot | None:
    """Mean and largest bound sqrt(F S) per module, one series per objective with a finite S > 0."""
    objectives = [o for o in report.objectives if o.signal_scale is not None and math.isfinite(o.signal_scale)
                  and o.signal_scale > 0 and not o.token_level]
    mods = ranked_modules(report)[:TOP]
    if not objectives or not mods:
        return None
    fig = _figure(9, 0.22 * len(mods) + 1.4)
    ax = fig.add_subplot()
    y = np.arange(len(mods))
    step = 0.8 / len(objectives)
    for i, o in enumerate(objectives):
        root = math.sqrt(o.signal_scale)
        off = y - 0.4 + step * (i + 0.5)
        ax.barh(off, _positive([m.bound_mass_per_coordinate * root for m in mods]), step, color=f"C{i}",
                label=f"{o.name}: mean bound")
        if i == 0 and all(m.bound_max is not None for m in mods):  # bound_max is the primary's
            ax.plot(_positive([m.bound_max for m in mods]), off, "|", color="k", ms=8, label=f"{o.name}: largest")
    ax.set_yticks(y, [m.name for m in mods], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("bound on |expected gradient| per coordinate, sqrt(F S)")
    ax.set_ylabel("module")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="major", axis="x", alpha=0.3)
    return Plot("bounds", "Bound per module", "Mean over the module's coordinates of sqrt(F S) per objective "
                "(sequence-level objectives; token-level ones use F^tok), and the primary objective's largest.",
                _uri(fig))


def _layer_grid(report: RunReport):
    cells, kinds, layers = {}, [], []
    for m in report.modules:
        layer, kind = layer_and_kind(m.name)
        if layer is None:
            continue
        cells[(layer, kind)] = cells.get((layer, kind), 0.0) + m.bound_mass
        kinds += [] if kind in kinds else [kind]
        layers += [] if layer in layers else [layer]
    return cells, sorted(kinds), sorted(layers)


def heatmap_plot(report: RunReport) -> Plot | None:
    cells, kinds, layers = _layer_grid(report)
    if not cells:
        return None
    grid = np.full((len(kinds), len(layers)), np.nan)
    for (layer, kind), v in cells.items():
        grid[kinds.index(kind), layers.index(layer)] = v if v > 0 else np.nan
    finite = grid[np.isfinite(grid)]
    if finite.size == 0:
        return None
    fig = _figure(9, 0.3 * len(kinds) + 2)
    ax = fig.add_subplot()
    image = ax.imshow(grid, aspect="auto", cmap="viridis", norm=LogNorm(finite.min(), max(finite.max(),
                                                                                          finite.min() * 1.01)))
    ax.set_yticks(range(len(kinds)), kinds, fontsize=8)
    ax.set_xticks(range(len(layers)), [str(i) for i in layers], fontsize=7)
    ax.set_xlabel("layer")
    ax.set_ylabel("module type")
    fig.colorbar(image, ax=ax, label="sum of sqrt(F) (log scale)")
    return Plot("heatmap", "Layer x module type", "Sum of sqrt(F) per layer and module type, log color scale "
                "(blank: no such module, or F = 0).", _uri(fig))


def layers_plot(report: RunReport) -> Plot | None:
    cells, _, layers = _layer_grid(report)
    if not layers:
        return None
    fmass = {}
    for m in report.modules:
        layer, _ = layer_and_kind(m.name)
        if layer is not None:
            fmass[layer] = fmass.get(layer, 0.0) + m.fisher_mass
    sqrt_mass = [sum(v for (layer, _), v in cells.items() if layer == i) for i in layers]
    fig = _figure(9, 3.8)
    ax = fig.add_subplot()
    x = np.arange(len(layers))
    ax.bar(x - 0.2, _positive(sqrt_mass), 0.4, label="sum of sqrt(F)")
    ax.bar(x + 0.2, _positive([fmass[i] for i in layers]), 0.4, label="sum of F")
    ax.set_xticks(x, [str(i) for i in layers], fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("module mass summed over the layer (log scale)")
    ax.legend(fontsize=8)
    ax.grid(True, which="major", axis="y", alpha=0.3)
    return Plot("layers", "Per layer", "Sum over each layer's modules (embeddings, final norm and head are not in "
                "a layer).", _uri(fig))


def cumulative_plot(stats: ReportStatistics) -> Plot | None:
    c = stats.concentration
    if c is None or len(c.curve_fraction) < 2:
        return None
    frac, mass = np.asarray(c.curve_fraction), np.asarray(c.curve_mass)
    keep = frac > 0
    fig = _figure(7, 4)
    ax = fig.add_subplot()
    ax.plot(frac[keep], mass[keep], color="C0")
    ax.plot(c.fractions, c.fisher_mass_shares, "o", color="C3", label="top 0.1% / 1% / 10% (exact)")
    for f, s in zip(c.fractions, c.fisher_mass_shares):
        ax.annotate(f"{100 * s:.3g}%", (f, s), textcoords="offset points", xytext=(6, -12), fontsize=8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(_PERCENT)
    ax.yaxis.set_major_formatter(_PERCENT)
    ax.set_xlabel("fraction of coordinates, largest F first")
    ax.set_ylabel("share of total F mass")
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    return Plot("cumulative", "Cumulative Fisher mass", "How few coordinates hold the Fisher mass.", _uri(fig))


def fisher_histogram_plot(stats: ReportStatistics) -> Plot | None:
    c = stats.concentration
    if c is None or not c.log10_histogram.counts:
        return None
    edges, counts = np.asarray(c.log10_histogram.edges), np.asarray(c.log10_histogram.counts)
    fig = _figure(8, 3.8)
    ax = fig.add_subplot()
    ax.stairs(np.where(counts > 0, counts, np.nan), 10.0**edges, fill=True, alpha=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("F per coordinate")
    ax.set_ylabel("coordinates per bin")
    ax.grid(True, which="major", alpha=0.3)
    return Plot("histogram", "Distribution of F", f"Coordinates per log-spaced bin of F; {c.zero_coordinates} of "
                f"{c.coordinates} coordinates have F = 0 (not shown).", _uri(fig))


def ratio_plot(stats: ReportStatistics) -> Plot | None:
    if not stats.bound_ratios:
        return None
    n = len(stats.bound_ratios)
    fig = _figure(9, 3.6 * n)
    for i, b in enumerate(stats.bound_ratios):
        ax = fig.add_subplot(n, 1, i + 1)
        for j, (kind, h) in enumerate(zip(b.kinds, b.histograms)):
            if h.counts and sum(h.counts):
                counts = np.asarray(h.counts) / sum(h.counts)
                ax.stairs(np.where(counts > 0, counts, np.nan), 10.0 ** np.asarray(h.edges), label=kind,
                          color=f"C{j % 10}", linestyle="-" if j < 10 else "--")
        ax.axvline(1.0, color="k", linestyle=":", label="bound")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("|g_hat| / sqrt(F S) per coordinate")
        ax.set_ylabel("share of the kind's coordinates")
        ax.set_title(b.objective, fontsize=10)
        ax.legend(fontsize=6, ncol=2, loc="upper left")
    return Plot("ratios", "|g_hat| / bound per module type", "At most 1 up to noise; far below 1, the bound is "
                "loose there (or the gradient estimate is noisy).", _uri(fig))


def z_plot(stats: ReportStatistics) -> Plot | None:
    c = stats.conformity
    if c is None:
        return None
    edges = np.asarray(c.histogram.edges)
    widths = np.diff(edges)
    fig = _figure(8, 3.8)
    ax = fig.add_subplot()
    for label, h in (("all coordinates", c.histogram), ("robust: no embeddings/head", c.histogram_robust)):
        counts = np.asarray(h.counts)
        if counts.sum() > 0:
            density = counts / counts.sum() / widths
            ax.stairs(np.where(density > 0, density, np.nan), edges, label=label)
    z = np.linspace(0.01, min(12.0, edges[-1]), 400)
    ax.plot(z, _abs_z_density(z, c.samples), "k--", label=f"expected for {c.samples} samples")
    ax.axvline(3.0, color="C3", linestyle=":", label="|z| = 3")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(bottom=1e-7)
    ax.set_xlabel("|z| = |mean(h)| / stderr per coordinate")
    ax.set_ylabel("density")
    ax.legend(fontsize=8)
    return Plot("conformity", "Score-mean check", c.message, _uri(fig))


def _abs_z_density(z: np.ndarray, n: int) -> np.ndarray:
    """Density of |z| = sqrt(n / (n - 1)) |t_{n-1}|."""
    if n < 2:
        return np.full_like(z, np.nan)
    stretch = math.sqrt(n / (n - 1))
    return 2 * sps.t.pdf(z / stretch, n - 1) / stretch


def split_half_plot(stats: ReportStatistics) -> Plot | None:
    s = stats.stability
    if s is None or not s.module_bound_mass:
        return None
    pts = np.asarray(s.module_bound_mass, dtype=float)
    pts = pts[(pts > 0).all(1)]
    if len(pts) == 0:
        return None
    fig = _figure(5.5, 5)
    ax = fig.add_subplot()
    ax.scatter(pts[:, 0], pts[:, 1], s=8, alpha=0.6)
    lo, hi = pts.min(), pts.max()
    ax.plot([lo, hi], [lo, hi], "k:", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"half A ({s.prompts[0]} prompts): module sum of sqrt(F)")
    ax.set_ylabel(f"half B ({s.prompts[1]} prompts)")
    ax.set_title(f"Spearman {s.spearman_bound_mass:.3g}" if s.spearman_bound_mass is not None else "", fontsize=10)
    return Plot("stability", "Split halves", s.message, _uri(fig))


def signals_plot(stats: ReportStatistics) -> Plot | None:
    shown = [s for s in stats.signals if s.histogram is not None and sum(s.histogram.counts) > 0]
    if not shown:
        return None
    fig = _figure(9, 3.2 * len(shown))
    for i, s in enumerate(shown):
        ax = fig.add_subplot(len(shown), 1, i + 1)
        ax.stairs(s.histogram.counts, s.histogram.edges, fill=True, alpha=0.7)
        ax.set_xlabel(s.value_label)
        ax.set_ylabel("samples")
        ax.set_title(f"{s.objective} ({s.type})", fontsize=10)
    return Plot("signals", "Signal per objective", "Per-sample raw values (RL: rewards); the share of prompts "
                "without signal is in the table above.", _uri(fig))
