"""The outcome study's figure: gain against forgetting, one panel per budget, one point per arm with its
standard errors.

One panel per budget keeps the arms that compete (the same density) side by side; the arms at their
own trainable count (full fine-tuning, LoRA rank 1) are drawn in every panel as references. Forgetting
spans orders of magnitude between arms (a random mask at lr 1 forgets 100x what the bound's mask does),
so its axis is symmetric-log: linear near 0, where the careful arms sit, logarithmic above.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from fisher_select.run.outcomes import OutcomesRecord

REFERENCE_MARKERS = {"full": "s", "lora_all_linear_r1": "D"}  # own-count arms: every panel, grey
LINEAR_UP_TO = 0.1  # the symlog axis is linear in [-0.1, 0.1] (nats per token)


def panels(record: OutcomesRecord) -> tuple[dict[float, list[tuple]], list[tuple]]:
    """(budget -> [(rule, gain, gain SE, forgetting, forgetting SE, lr on edge)], [the same for the
    own-count arms]): every arm with both measures, in one list."""
    by_budget: dict[float, list[tuple]] = {}
    references = []
    for name, arm in sorted(record.arms.items()):
        gain, forget = arm.get("recovered"), arm.get("forgetting")
        if name == "start" or not gain or not forget:
            continue
        rule, _, budget = name.partition("@")
        point = (rule, gain["mean"], gain["se"] or 0.0, forget["mean"], forget["se"] or 0.0,
                 bool(arm.get("lr_on_edge")))
        if budget:
            by_budget.setdefault(float(budget), []).append(point)
        else:
            references.append(point)
    return dict(sorted(by_budget.items())), references


def gain_vs_forgetting(path: Path, record: OutcomesRecord) -> None:
    """Recovered share (x) against the change in general-text NLL per token (y, symlog), mean ± SE over
    replicates, one panel per budget; an arm whose lr sits on its grid's edge is drawn hollow."""
    by_budget, references = panels(record)
    budgets = list(by_budget) or [None]
    fig = Figure(figsize=(3.6 * len(budgets), 4.2))
    axes = fig.subplots(1, len(budgets), sharey=True, squeeze=False)[0]
    rules = sorted({p[0] for points in by_budget.values() for p in points})
    colors = {rule: f"C{i % 10}" for i, rule in enumerate(rules)}
    for ax, budget in zip(axes, budgets):
        for rule, gain, gain_se, forget, forget_se, edge in by_budget.get(budget, []):
            ax.errorbar(gain, forget, xerr=gain_se, yerr=forget_se, fmt="o", capsize=2, color=colors[rule],
                        markerfacecolor="none" if edge else colors[rule], label=rule)
        for rule, gain, gain_se, forget, forget_se, edge in references:
            ax.errorbar(gain, forget, xerr=gain_se, yerr=forget_se, fmt=REFERENCE_MARKERS.get(rule, "^"),
                        capsize=2, color="grey", markerfacecolor="none" if edge else "grey", label=rule)
        ax.axhline(0.0, color="grey", linewidth=0.5)
        ax.set_yscale("symlog", linthresh=LINEAR_UP_TO)
        ax.set_title("own counts" if budget is None else f"density {budget:g}", fontsize=9)
        ax.set_xlabel("share of full fine-tuning's gain", fontsize=8)
    axes[0].set_ylabel("forgetting: change in general-text NLL per token (symlog)", fontsize=8)
    unique = {}  # label -> handle, over every panel (a rule may miss a budget)
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            unique.setdefault(label, handle)
    fig.legend(unique.values(), unique.keys(), loc="lower center", ncol=min(len(unique), 4), fontsize=7,
               frameon=False)
    fig.suptitle(f"{record.kind}: gain against forgetting (mean ± SE over replicates; hollow: lr on its "
                 f"grid's edge)", fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 0.95))
    fig.savefig(path, format="png", dpi=120)
