"""The figures of a validation (matplotlib's object API: no pyplot, no global backend state)."""

from __future__ import annotations

from pathlib import Path

import torch
from matplotlib.figure import Figure

SCATTER_POINTS = 20_000  # points drawn of the subsample (the metrics use all of it)


def bound_vs_movement(path: Path, bound: torch.Tensor, moved: torch.Tensor, bound_label: str, seed: int) -> None:
    """Log-log scatter of the bound against realized |delta| on the subsample (zeros counted in the title)."""
    keep = (bound > 0) & (moved > 0)
    idx = keep.nonzero().squeeze(1)
    if idx.numel() > SCATTER_POINTS:
        idx = idx[torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(seed))[:SCATTER_POINTS]]
    fig = Figure(figsize=(6, 5))
    ax = fig.subplots()
    if idx.numel():
        ax.scatter(bound[idx].numpy(), moved[idx].numpy(), s=2, alpha=0.3, linewidths=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:  # nothing to draw on log axes (e.g. no coordinate moved: a zero training signal)
        ax.text(0.5, 0.5, "no coordinate with a positive bound and a positive movement", ha="center",
                transform=ax.transAxes)
    ax.set_xlabel(bound_label)
    ax.set_ylabel("realized |delta theta| (fp32)")
    ax.set_title(f"{idx.numel()} of {bound.numel()} subsampled coordinates; "
                 f"{int((bound == 0).sum())} with bound 0, {int((moved == 0).sum())} unmoved", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def overlap_curves(path: Path, fractions: list[float], curves: dict[str, list[float]]) -> None:
    """Share of the predicted top-k in the realized top-k, per ranking, against k."""
    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    for label, values in curves.items():
        ax.plot(fractions, values, marker=".", label=label, linewidth=2.2 if label == "fisher" else 1.2)
    ax.set_xscale("log")
    ax.set_xlabel("mask density k (fraction of coordinates)")
    ax.set_ylabel("precision@k vs the realized top-k")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def objective_curves(path: Path, runs: dict[str, list[dict]], ylabel: str) -> None:
    """The objective value of each step's batch, per training run (full, other seed, masks)."""
    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    for label, log in runs.items():
        ax.plot([e["step"] for e in log], [e["outcome"] for e in log], marker=".", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def recovery_curves(path: Path, report: dict) -> None:
    """The outcome study's share recovered against density: one curve per mask rule (mean, band min..max
    over seeds), one point with its min..max bar per module, LoRA or SHiRA method; 1 = full fine-tuning."""
    fig = Figure(figsize=(7, 5))
    ax = fig.subplots()
    curves: dict[str, list] = {}
    for m in report["methods"].values():
        known = [s for s in m.get("recovered", []) if s is not None]
        if known and len(known) == len(m["recovered"]):
            curves.setdefault(m["method"], []).append((m["density"], sum(known) / len(known), min(known), max(known)))
    for name, points in sorted(curves.items()):
        x, mean, lo, hi = zip(*sorted(points))
        if len(points) > 1:
            line, = ax.plot(x, mean, marker="o", label=name)
            ax.fill_between(x, lo, hi, alpha=0.2, color=line.get_color())
        else:
            ax.errorbar(x, mean, yerr=[[mean[0] - lo[0]], [hi[0] - mean[0]]], marker="s", linestyle="", capsize=3,
                        label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="full fine-tuning")
    ax.set_xscale("log")
    ax.set_xlabel("trainable share of the parameters (density)")
    ax.set_ylabel("share of full fine-tuning's held-out gain recovered")
    ax.set_title(f"{report['kind']}: mean over seeds, band/bar = min..max")
    ax.legend(fontsize=7, loc="best")
    fig.savefig(path, dpi=120, bbox_inches="tight", format="png")  # path may be a temporary name
