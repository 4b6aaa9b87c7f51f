"""report.html: one self-contained page (inline CSS, matplotlib PNGs as data URIs, no script, no network).

The page is made from the report alone (``RunReport`` with its statistics), so ``fisher-select
report RUN`` draws it again from report.json; ``samples`` (samples.jsonl records) add a few
example responses.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from fisher_select.report import experts, outcomes_section, plots, validation_section
from fisher_select.report.statistics import ReportStatistics
from fisher_select.report.tables import html_table as _table
from fisher_select.report.text import (objective_rows, MODULE_COLUMNS, caveat_block, coverage_text, fallback_rows, fmt,
                                       module_cells, pct, ranked_modules, selfcheck_text, verdict_lines)
from fisher_select.run.schema import RunReport

TOP_MODULES = 30
EXAMPLE_SAMPLES = 6

_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222;padding:0 1em}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{padding:2px 8px;border-bottom:1px solid #ddd;
text-align:left;vertical-align:top}th{background:#f4f4f4}.num{text-align:right;font-variant-numeric:tabular-nums}
.caveat{background:#fff4e5;border-left:4px solid #f0a020;padding:.5em 1em;margin:1em 0}
.verdict{background:#e8f4ea;border-left:4px solid #2e8b57;padding:.5em 1em;margin:1em 0}
.warn{background:#fdecea;border-left:4px solid #d93025;padding:.5em 1em;margin:1em 0}
figure{margin:1.5em 0}figcaption{font-size:13px;color:#555}img{max-width:100%}
pre{background:#f7f7f7;padding:.5em;overflow:auto;font-size:12px}"""


def _e(x) -> str:
    return html.escape(str(x))


def _list(items: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{_e(i)}</li>" for i in items) + "</ul>"


def write_html(path: Path, report: RunReport, cal=None, samples: list[dict] | None = None, validations=(),
               outcomes=(), run_dir=None) -> None:
    """Write the page; ``cal`` (a Calibration) supplies example samples when ``samples`` is not given;
    ``validations``: (name, validation.json) pairs for the Validation section; ``outcomes``: (name,
    outcomes.json) pairs for the outcome section, whose plots are read from ``run_dir``."""
    samples = samples if samples is not None else list(getattr(cal, "samples", None) or [])
    Path(path).write_text(page_html(report, samples, validations, outcomes, run_dir))


def page_html(report: RunReport, samples: list[dict], validations=(), outcomes=(), run_dir=None) -> str:
    stats = ReportStatistics.from_json(report.statistics)
    figures = plots.all_plots(report)
    body = [f"<h1>fisher_select run {_e(report.run_id)}</h1>",
            f'<div class="verdict"><b>Verdict</b>{_list(verdict_lines(report))}</div>',
            f'<div class="caveat"><b>What these numbers do not promise</b>{_list(caveat_block(report))}</div>']
    if report.warnings:
        body.append(f'<div class="warn"><b>Warnings about this run</b>{_list(report.warnings)}</div>')
    body += [_run_section(report), _coverage_section(report), _objectives_section(report, stats),
             _statistics_section(stats), _modules_section(report),
             experts.html_section(experts.section_of(report.experts)),
             validation_section.html_section(list(validations)),
             outcomes_section.html_section(list(outcomes), run_dir), "<h2>Plots</h2>"]
    body += [f'<figure id="{p.key}"><h3>{_e(p.title)}</h3><img alt="{_e(p.title)}" src="{p.data_uri}">'
             f"<figcaption>{_e(p.caption)}</figcaption></figure>" for p in figures]
    body.append(_samples_section(report, samples))
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>fisher_select run '
            f"{_e(report.run_id)}</title><style>{_STYLE}</style></head><body>{''.join(body)}</body></html>\n")


def _run_section(report: RunReport) -> str:
    auto = report.checks.get("autograd", {})
    rows = [["model", f"{report.model.name} ({report.model.fingerprint.get('num_parameters', '?')} parameters, "
                      f"{report.model.architecture or '?'}, dtype {report.model.dtype or '?'}, quantization "
                      f"{report.model.quantization or 'none'})"],
            ["recipe", report.recipe or "n/a"],
            ["prompts x samples", f"{report.num_prompts} x {report.samples_per_prompt} = {report.num_samples}"],
            ["max_new_tokens, seed", f"{report.max_new_tokens}, {report.seed}"],
            ["sampling", ", ".join(f"{k} {v}" for k, v in report.sampling.items())],
            ["truncated at max_new_tokens", f"{report.num_truncated} ({pct(report.truncation_rate)})"],
            ["autograd check (first batch)", f"max relative error {fmt(auto.get('max_relative_error'))} "
                                             f"(tolerance {fmt(auto.get('tolerance'))})"]]
    recipe = json.dumps(report.config, indent=2, default=str) if report.config else "n/a"
    return (f"<h2>Run</h2>{_table(['', ''], rows)}<details><summary>Resolved recipe</summary>"
            f"<pre>{_e(recipe)}</pre></details>")


def _coverage_section(report: RunReport) -> str:
    """The rules' self-check, the parameters per rule, every fallback parameter, and each parameter's rule."""
    out = f"<h2>Rule coverage</h2><p>{_e(selfcheck_text(report))}</p><p>{_e(coverage_text(report))}</p>"
    rows = fallback_rows(report)
    if rows:
        out += "<p>Parameters on the fallback:</p>" + _table(["parameter", "module class"], rows)
    every = report.coverage.get("parameter_rules")
    if every:
        out += ("<details><summary>Each parameter's rule</summary>"
                + _table(["parameter", "rule"], [[n, r] for n, r in every.items()]) + "</details>")
    return out


def _objectives_section(report: RunReport, stats: ReportStatistics) -> str:
    rows = objective_rows(report, stats)
    out = "<h2>Objectives</h2>" + _table(["objective", "type", "S", "95% CI bootstrap (BCa, prompts)", "95% CI (t)",
                                          "stderr", "prompts without signal", "signal a"], rows)
    for s in stats.signals:
        if s.numbers:
            out += f"<h3>Signal diagnostics: {_e(s.objective)}</h3>" + _table(
                ["quantity", "value"], [[label, fmt(v)] for label, v in s.numbers])
    return out


def _statistics_section(stats: ReportStatistics) -> str:
    out = "<h2>Sampling conformity</h2>"
    c = stats.conformity
    if c is not None:
        rows = [[label, z.coordinates, pct(z.share_above), pct(c.expected_share), fmt(z.ratio), fmt(z.rms_z),
                 fmt(z.median_abs_z)] for label, z in (("all", c.all), ("robust (no embeddings/head)", c.robust))]
        out += f"<p>{_e(c.message)}</p>" + _table(["coordinates", "count", "|z| > 3", "expected", "ratio", "RMS z",
                                                   "median |z|"], rows)
    else:
        out += "<p>Not recorded in this report.</p>"
    out += "<h2>Estimator stability</h2>"
    s = stats.stability
    out += (f"<p>{_e(s.message)}</p>" + _table(["top coordinates", "Jaccard between halves"],
                                               [[pct(f), fmt(j)] for f, j in zip(s.top_fractions, s.jaccard)])
            if s is not None else "<p>Not measured (stability off, or a half without prompts).</p>")
    k = stats.concentration
    if k is not None:
        out += "<h2>Concentration</h2>" + _table(["top coordinates", "share of F mass"],
                                                 [[pct(f), pct(m)] for f, m in zip(k.fractions, k.fisher_mass_shares)])
    for b in stats.bound_ratios:
        out += f"<h3>|g_hat| / bound per module type ({_e(b.objective)})</h3><p>{_e(b.note)}</p>" + _table(
            ["module type"] + [f"quantile {q:g}" for q in b.quantiles] + ["share > 1"],
            [[kind] + [fmt(v) for v in vals] + [pct(a)] for kind, vals, a in zip(b.kinds, b.values, b.share_above_1)])
    return out


def _modules_section(report: RunReport) -> str:
    ranked = ranked_modules(report)[:TOP_MODULES]
    return (f"<h2>Top {len(ranked)} of {len(report.modules)} modules by sum of sqrt(F)</h2><p>Ranked by the sum of "
            "sqrt(F), which predicts module movement; the sum of F, dominated by a few huge coordinates, does not. "
            "Bounds are sqrt(F S) of the primary objective; the relative standard error of the F mass comes from "
            "the spread over scoring batches.</p>" + _table(list(MODULE_COLUMNS), [module_cells(m) for m in ranked]))


def _samples_section(report: RunReport, samples: list[dict]) -> str:
    if not samples:
        return ""
    rows = []
    for s in samples[:EXAMPLE_SAMPLES]:
        prompt = s.get("prompt")
        prompt = prompt if isinstance(prompt, str) else json.dumps(prompt)
        values = ", ".join(f"{k} {fmt(v)}" for k, v in (s.get("value") or {}).items())
        rows.append([s.get("prompt_index"), prompt[:300], str(s.get("response", ""))[:300], values,
                     "yes" if s.get("truncated") else "no"])
    return (f"<h2>Example samples ({min(len(samples), EXAMPLE_SAMPLES)} of {len(samples)})</h2>"
            + _table(["prompt", "text", "response", "value", "truncated"], rows))
