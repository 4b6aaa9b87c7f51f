"""Runs side by side (two objectives, two models, two seeds): their numbers, and how much their
Fisher rankings agree (``run.verify.agreement``: top-k coordinate mask overlap, rank correlation of
module masses). This module lays the comparison out; ``run.verify`` compares.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import asdict, dataclass

from fisher_select.report.statistics import ReportStatistics
from fisher_select.report.text import fmt, interval, pct, uncertainty_of
from fisher_select.run.load import Run, load_run
from fisher_select.run.verify import PairAgreement, agreement


@dataclass
class Comparison:
    runs: list[dict]  # per run: the summary row shown
    pairs: list[PairAgreement]

    def to_json(self) -> dict:
        return asdict(self)


def compare(paths: list["str | os.PathLike"]) -> Comparison:
    runs = [load_run(p) for p in paths]
    rows = [_summary(r, str(p)) for r, p in zip(runs, paths)]
    pairs = [agreement(a, b, str(pa), str(pb)) for (a, pa), (b, pb) in itertools.combinations(zip(runs, paths), 2)]
    return Comparison(rows, pairs)


def _summary(run: Run, path: str) -> dict:
    r = run.report
    stats = ReportStatistics.from_json(r.statistics)
    objectives = []
    for o in r.objectives:
        u = uncertainty_of(stats, o.name)
        objectives.append(f"{o.name}: S {fmt(o.signal_scale)} {interval(u.bootstrap_interval) if u else ''}".strip())
    conc = stats.concentration
    return {"path": path, "run_id": r.run_id, "model": r.model.name, "recipe": r.recipe or "n/a",
            "samples": f"{r.num_prompts} x {r.samples_per_prompt}", "seed": r.seed,
            "truncated": pct(r.truncation_rate), "objectives": "; ".join(objectives),
            "conformity": stats.conformity.verdict if stats.conformity else "n/a",
            "stability": stats.stability.verdict if stats.stability else "n/a",
            "top 1% mass": pct(conc.fisher_mass_shares[1]) if conc else "n/a"}


def comparison_lines(c: Comparison) -> list[str]:
    keys = list(c.runs[0])
    width = max(len(k) for k in keys)
    lines = []
    for key in keys:
        lines.append(f"{key:<{width}}  " + "  |  ".join(str(r[key]) for r in c.runs))
    for p in c.pairs:
        head = f"{p.run_a} vs {p.run_b}:"
        if p.comparable:
            overlap = ", ".join(f"top {pct(f)} Jaccard {fmt(j)}" for f, j in zip(p.top_fractions, p.jaccard))
        else:
            overlap = p.note
        lines.append(f"{head} {overlap}; Spearman of module bound masses (sum sqrt(F)) {fmt(p.spearman_bound_mass)} "
                     f"(Fisher masses, sum F, {fmt(p.spearman_fisher_mass)}) over {p.common_modules} common modules")
    return lines
