"""Runs side by side (two objectives, two models, two seeds): their numbers, and how much their
Fisher rankings agree (top-k coordinate mask overlap, rank correlation of module masses).

Unlike ``rundir.compare_runs`` (bit-for-bit reproducibility), this compares results that are
expected to differ.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import asdict, dataclass, field

from fisher_select.report.statistics import ReportStatistics
from fisher_select.report.text import fmt, interval, pct, uncertainty_of
from fisher_select.rundir import Run, load_run
from fisher_select.stats.correlation import mask_jaccards, module_sums, spearman
from fisher_select.stats.naming import module_of
from fisher_select.stats.stability import TOP_FRACTIONS


@dataclass
class PairAgreement:
    """How two runs' Fishers agree; ``comparable`` is False when their parameters differ."""

    run_a: str
    run_b: str
    comparable: bool
    top_fractions: list[float] = field(default_factory=list)
    jaccard: list[float] = field(default_factory=list)  # of the exact top-fraction masks of F, per fraction
    spearman_bound_mass: float | None = None  # module sums of sqrt(F), over common modules
    spearman_fisher_mass: float | None = None  # module sums of F
    common_modules: int = 0
    note: str = ""


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


def agreement(a: Run, b: Run, name_a: str, name_b: str) -> PairAgreement:
    fa, fb = a.fisher, b.fisher
    same = set(fa) == set(fb) and all(fa[n].shape == fb[n].shape for n in fa)
    out = PairAgreement(name_a, name_b, same)
    if same:
        out.top_fractions = list(TOP_FRACTIONS)
        out.jaccard = mask_jaccards(fa, fb, TOP_FRACTIONS)
    else:
        out.note = "different parameters (names or shapes): no coordinate masks to overlap"
    common = sorted({module_of(n) for n in fa} & {module_of(n) for n in fb})
    out.common_modules = len(common)
    if common:
        sub_a = {n: t for n, t in fa.items() if module_of(n) in common}
        sub_b = {n: t for n, t in fb.items() if module_of(n) in common}
        out.spearman_bound_mass = spearman(module_sums(sub_a, common, True), module_sums(sub_b, common, True))
        out.spearman_fisher_mass = spearman(module_sums(sub_a, common, False), module_sums(sub_b, common, False))
    return out


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
