"""report.md: the report as Markdown text (the plots are in report.html)."""

from __future__ import annotations

from pathlib import Path

from fisher_select.report import experts, outcomes_section, validation_section
from fisher_select.report.statistics import ReportStatistics
from fisher_select.report.tables import markdown_table as _table
from fisher_select.report.text import (objective_rows, MODULE_COLUMNS, caveat_block, coverage_text, fallback_rows, fmt,
                                       module_cells, pct, ranked_modules, scale_text, selfcheck_text, uncertainty_of,
                                       verdict_lines)
from fisher_select.run.schema import RunReport

TOP_MODULES = 30


def markdown_text(report: RunReport, validations=(), outcomes=()) -> str:
    stats = ReportStatistics.from_json(report.statistics)
    out = [f"# fisher_select run {report.run_id}", "", "## Verdict", ""] + [f"- {v}" for v in verdict_lines(report)]
    out += ["", "## What these numbers do not promise", ""]
    out += [f"- {c}" for c in caveat_block(report)]
    if report.warnings:
        out += ["", "## Warnings about this run", ""] + [f"- {w}" for w in report.warnings]
    out += ["", "## Run", "", f"Model **{report.model.name}** ({report.model.fingerprint.get('num_parameters', '?')} "
            f"parameters), recipe {report.recipe or 'n/a'}; {report.num_prompts} prompts x {report.samples_per_prompt} "
            f"samples = {report.num_samples} responses, max_new_tokens {report.max_new_tokens}, seed {report.seed}; "
            f"sampling {report.sampling.get('method', 'ancestral')} at temperature "
            f"{report.sampling.get('temperature', 1.0)}; truncated: {pct(report.truncation_rate)}. "
            f"Autograd check: max relative error {fmt(report.checks.get('autograd', {}).get('max_relative_error'))}."]
    out += _coverage(report) + _objectives(report, stats) + _conformity(stats) + _stability(stats)
    out += _concentration(stats)
    out += _ratios(stats) + _signals(stats) + _modules(report)
    out += experts.markdown_lines(experts.section_of(report.experts))  # MoE layers only
    out += validation_section.markdown_lines(list(validations))  # RUN/validation-*/validation.json
    out += outcomes_section.markdown_lines(list(outcomes))  # RUN/outcomes-*/outcomes.json
    return "\n".join(out) + "\n"


def _coverage(report) -> list[str]:
    """The rules' self-check, the parameters per rule, and every fallback parameter with its module's class."""
    out = ["", "## Rule coverage", "", selfcheck_text(report), "", coverage_text(report)]
    rows = fallback_rows(report)
    return out + (["", "Parameters on the fallback:", ""] + _table(["parameter", "module class"], rows) if rows else [])


def _objectives(report, stats) -> list[str]:
    rows = objective_rows(report, stats)
    out = ["", "## Objectives", ""]
    out += _table(["objective", "type", "S", "95% CI (bootstrap)", "95% CI (t)", "stderr", "prompts without signal",
                   "signal"], rows)
    return out + [""] + [f"- {o.name}: {scale_text(o, uncertainty_of(stats, o.name))}" for o in report.objectives]


def _conformity(stats) -> list[str]:
    c = stats.conformity
    if c is None:
        return []
    rows = [[label, z.coordinates, pct(z.share_above), pct(c.expected_share), fmt(z.ratio), fmt(z.rms_z),
             fmt(z.median_abs_z), fmt(c.expected_median_abs_z)]
            for label, z in (("all coordinates", c.all), ("robust (no embeddings/head)", c.robust))]
    return ["", "## Sampling conformity (score-mean check)", "", c.message, ""] + _table(
        ["coordinates", "count", "share |z| > 3", "expected", "ratio", "RMS z", "median |z|", "expected median"], rows)


def _stability(stats) -> list[str]:
    s = stats.stability
    if s is None:
        return ["", "## Estimator stability", "", "Not measured (calibrate(stability=False), or a half without prompts)."]
    rows = [[f"top {pct(f)}", fmt(j)] for f, j in zip(s.top_fractions, s.jaccard)]
    return (["", "## Estimator stability (split halves)", "", s.message, "",
             f"Spearman of module bound masses (sum sqrt(F)): {fmt(s.spearman_bound_mass)}; of Fisher masses (sum F): {fmt(s.spearman_fisher_mass)}.", ""]
            + _table(["coordinate mask", "Jaccard between halves"], rows))


def _concentration(stats) -> list[str]:
    c = stats.concentration
    if c is None:
        return []
    rows = [[f"top {pct(f)}", pct(s)] for f, s in zip(c.fractions, c.fisher_mass_shares)]
    return (["", "## Concentration of F", "", f"{c.coordinates} coordinates, {c.zero_coordinates} with F = 0.", ""]
            + _table(["coordinates", "share of F mass"], rows))


def _ratios(stats) -> list[str]:
    out = []
    for b in stats.bound_ratios:
        rows = [[k] + [fmt(v) for v in vals] + [pct(a)] for k, vals, a in zip(b.kinds, b.values, b.share_above_1)]
        out += ["", f"## |g_hat| / bound per module kind ({b.objective})", "", b.note, ""]
        out += _table(["kind"] + [f"q{q:g}" for q in b.quantiles] + ["share > 1"], rows)
    return out


def _signals(stats) -> list[str]:
    out = []
    for s in stats.signals:
        if s.numbers:
            out += ["", f"## Signal diagnostics: {s.objective} ({s.type})", ""]
            out += _table(["quantity", "value"], [[label, fmt(v)] for label, v in s.numbers])
    return out


def _modules(report) -> list[str]:
    ranked = ranked_modules(report)[:TOP_MODULES]
    out = ["", f"## Top {len(ranked)} of {len(report.modules)} modules by sum of sqrt(F)", "",
           "Ranked by the sum of sqrt(F) over the module, which predicts module movement; the sum of F, dominated "
           "by a few huge coordinates, does not (both shown). The bound is sqrt(F S) of the primary objective.", ""]
    return out + _table(list(MODULE_COLUMNS), [module_cells(m) for m in ranked])


def write_markdown(path: Path, report: RunReport, validations=(), outcomes=()) -> None:
    Path(path).write_text(markdown_text(report, validations, outcomes))
