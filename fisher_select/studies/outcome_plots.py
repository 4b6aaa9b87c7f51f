"""The outcome study's figure: gain against forgetting, one point per arm with its standard errors."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from fisher_select.run.outcomes import OutcomesRecord


def gain_vs_forgetting(path: Path, record: OutcomesRecord) -> None:
    """Recovered share (x) against the change in general-text NLL per token (y), mean ± SE over replicates."""
    fig = Figure(figsize=(7, 5))
    ax = fig.subplots()
    for name, arm in record.arms.items():
        gain, forget = arm.get("recovered"), arm.get("forgetting")
        if name == "start" or not gain or not forget:
            continue
        ax.errorbar(gain["mean"], forget["mean"], xerr=gain["se"] or 0, yerr=forget["se"] or 0, fmt="o", capsize=3)
        ax.annotate(name + (" *" if arm.get("lr_on_edge") else ""), (gain["mean"], forget["mean"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xlabel("share of full fine-tuning's held-out gain recovered")
    ax.set_ylabel("forgetting: change in general-text NLL per token")
    ax.set_title(f"{record.kind}: gain against forgetting (mean ± SE over replicates; * lr on its grid's edge)",
                 fontsize=9)
    fig.savefig(path, format="png", dpi=120)
