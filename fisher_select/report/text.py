"""The report's sentences and table rows, shared by the CLI summary, report.md and report.html.

Numbers are shown to 3 significant digits.
"""

from __future__ import annotations

import math

from fisher_select.caveats import CAVEAT_LINE, CAVEATS
from fisher_select.report.statistics import ReportStatistics, ScaleUncertainty
from fisher_select.report.study_advice import finding_line
from fisher_select.run.schema import ModuleEntry, RunReport

HEAVY_WEIGHT_SHARE = 0.5  # SFT: one sample carries more than half a prompt's importance weight
LOW_ESS_FRACTION = 0.5  # SFT: effective sample size below half of K
SCALE_RATIO = 10.0  # objectives whose S differ by more than this factor
TRUNCATION_CAVEAT = 0.1
VERDICT_MODULES = 5  # modules the verdict names
SILENT_PROMPTS_ADVICE = 0.5  # more than this share of prompts without signal: say what to change


def fmt(x, digits: int = 3) -> str:
    """3 significant digits; None -> n/a."""
    if x is None:
        return "n/a"
    if isinstance(x, bool) or isinstance(x, int):
        return str(x)
    if isinstance(x, str):
        return x
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.3g}%"


def interval(iv) -> str:
    return "n/a" if not iv else f"[{fmt(iv[0])}, {fmt(iv[1])}]"


def scale_text(entry, u: ScaleUncertainty | None) -> str:
    """S with its interval, standard error and silent prompts."""
    if entry.signal_scale is None:
        return "S unknown (bounds are sqrt(F): ranking only)"
    text = f"S = {fmt(entry.signal_scale)}"
    if u is None:
        return text
    if u.bootstrap_interval:
        text += (f" ({u.level:.0%} CI {interval(u.bootstrap_interval)} bootstrap over prompts, "
                 f"t {interval(u.t_interval)}; stderr {fmt(u.stderr)}"
                 f"{'' if u.relative_stderr is None else ', ' + pct(u.relative_stderr)})")
    elif u.note:
        text += f" ({u.note})"
    return text + f"; {u.prompts_without_signal} of {u.num_prompts} prompts without signal"


def uncertainty_of(stats: ReportStatistics, name: str) -> ScaleUncertainty | None:
    return next((u for u in stats.uncertainty if u.objective == name), None)


def objective_rows(report: RunReport, stats: ReportStatistics) -> list[list[str]]:
    """Per objective: name, type, S, its bootstrap and t intervals, stderr, prompts without signal, signal."""
    rows = []
    for o in report.objectives:
        u = uncertainty_of(stats, o.name)
        rows.append([o.name, o.type, fmt(o.signal_scale), interval(u.bootstrap_interval) if u else "n/a",
                     interval(u.t_interval) if u else "n/a", fmt(u.stderr) if u else "n/a",
                     f"{u.prompts_without_signal} of {u.num_prompts}" if u else "n/a", o.signal])
    return rows


def run_caveats(report: RunReport, stats: ReportStatistics) -> list[str]:
    """The caveats, made concrete with this run's numbers where they bite."""
    out = []
    scales = {}
    for o in report.objectives:
        s, u = o.signal_scale, uncertainty_of(stats, o.name)
        if s is None:
            out.append(f"S of {o.name} is unknown: its bounds are sqrt(F), which only rank coordinates")
        elif s == 0:
            out.append(f"S = 0 for {o.name}: its bounds are 0 only because no sampled response of "
                       f"{report.num_prompts} prompts carried signal, not because training would move nothing")
        elif not math.isfinite(s):
            out.append(f"S is infinite for {o.name}: it has no bound")
        else:
            scales[o.name] = s
            if u is not None and u.relative_stderr is not None and u.relative_stderr > 0.25:
                out.append(f"S of {o.name} = {fmt(s)} has a standard error of {pct(u.relative_stderr)}: its bounds "
                           f"(sqrt(S)) are uncertain by about {pct(u.relative_stderr / 2)}")
        weights = o.details.get("weights") if isinstance(o.details.get("weights"), dict) else {}
        share, ess = weights.get("max_weight_share"), weights.get("ess_mean_fraction")
        if (share is not None and share > HEAVY_WEIGHT_SHARE) or (ess is not None and ess < LOW_ESS_FRACTION):
            out.append(f"importance weights of {o.name} are heavy (largest weight share {fmt(share)}, mean ESS "
                       f"{pct(ess)} of K): its S rests on few samples and is likely underestimated")
    if len(scales) > 1:
        hi, lo = max(scales, key=scales.get), min(scales, key=scales.get)
        ratio = scales[hi] / scales[lo]
        if ratio > SCALE_RATIO:
            out.append(f"S of {hi} is {fmt(ratio)}x that of {lo}: {hi}'s bounds are {fmt(math.sqrt(ratio))}x looser")
    if report.truncation_rate > TRUNCATION_CAVEAT:
        out.append(f"{pct(report.truncation_rate)} of responses were cut at max_new_tokens = {report.max_new_tokens}: "
                   "F and S describe the truncated distribution")
    return out


def caveat_block(report: RunReport, short: bool = False) -> list[str]:
    """The caveats first: the general ones (one line when ``short``), then this run's numbers."""
    concrete = run_caveats(report, ReportStatistics.from_json(report.statistics))
    head = [CAVEAT_LINE] if short else list(CAVEATS)
    return head + [f"  in this run: {c}" if short else f"In this run: {c}" for c in concrete]


def statistics_lines(report: RunReport) -> list[str]:
    """One line per objective (S with its uncertainty), then sampling, stability and concentration."""
    stats = ReportStatistics.from_json(report.statistics)
    lines = [f"objective {o.name} ({o.type}): {scale_text(o, uncertainty_of(stats, o.name))}   signal: {o.signal}"
             for o in report.objectives]
    if stats.conformity is not None:
        lines.append(f"sampling conformity: {stats.conformity.message}")
    if stats.stability is not None:
        lines.append(f"estimator stability: {stats.stability.message}")
    c = stats.concentration
    if c is not None:
        parts = ", ".join(f"top {pct(f)}: {pct(s)}" for f, s in zip(c.fractions, c.fisher_mass_shares))
        lines.append(f"concentration: share of F mass in the top coordinates: {parts}")
    return lines


MODULE_COLUMNS = ("bound mass share", "Fisher mass share", "F mass rel. stderr", "bound mean", "bound max", "module")


def ranked_modules(report: RunReport) -> list[ModuleEntry]:
    """Modules by bound mass (sum of sqrt(F)), largest first: the ranking every table uses."""
    return sorted(report.modules, key=lambda m: (-m.bound_mass, m.name))


def module_cells(m: ModuleEntry) -> list[str]:
    return [pct(m.bound_share), pct(m.fisher_share), pct(m.fisher_mass_rel_stderr), fmt(m.bound_mean),
            fmt(m.bound_max) if m.bound_max is not None else "n/a (S unknown)", m.name]


def module_rows(report: RunReport, top: int) -> tuple[str, list[str]]:
    """A fixed-width header and rows of the ``top`` modules by bound mass."""
    widths = (16, 17, 18, 11, 11, 0)
    header = "  ".join(f"{c:<{w}}" if w else c for c, w in zip(MODULE_COLUMNS, widths))
    rows = ["  ".join(f"{c:<{w}}" if w else c for c, w in zip(module_cells(m), widths))
            for m in ranked_modules(report)[:top]]
    return header, rows


def run_summary_lines(report: RunReport, top: int | None = 15) -> list[str]:
    """The summary the CLI prints: the verdict, the caveats with the run's numbers beside it, then the run, its statistics,
    the ``top`` modules by bound mass, sum of sqrt(F) (None: all) and the warnings."""
    lines = verdict_lines(report) + caveat_block(report, short=True)
    lines.append(f"run {report.run_id}  model {report.model.name}  "
                 f"{report.num_prompts} prompts x {report.samples_per_prompt} samples, "
                 f"truncated {report.truncation_rate:.0%}")
    lines += statistics_lines(report)
    shown = len(report.modules) if top is None else min(top, len(report.modules))
    more = "" if shown == len(report.modules) else "; --all for every module"
    lines.append(f"top {shown} of {len(report.modules)} modules by bound mass, the sum of sqrt(F) (it tracks "
                 f"module movement; the Fisher mass, sum of F, does not){more}:")
    header, rows = module_rows(report, shown)
    lines += ["  " + header] + ["  " + r for r in rows]
    lines += [f"warning: {w}" for w in report.warnings]
    lines += timing_lines(report)
    return lines


def timing_lines(report: RunReport) -> list[str]:
    """Where the run's wall time went (report.json ``timings``), one line; none for runs without it."""
    t = report.timings
    if not t:
        return []
    phases = ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}s ({pct(t['shares'][name])})"
                       for name, seconds in t["phases_s"].items())
    return [f"time: {t['wall_s']:.1f}s wall: {phases}; sampling {t['response_tokens_per_s']:,.0f} response tokens/s, "
            f"scoring {t['samples_per_s']:,.1f} samples/s"]


def verdict_lines(report: RunReport) -> list[str]:
    """The answer first: what to train, how sure that is, and what to change if it is weak."""
    stats = ReportStatistics.from_json(report.statistics)
    found = [finding_line(report.objectives[0].type)] if report.objectives else []  # what the study measured
    return [_what_to_train(report), _how_sure(report, stats), _what_to_change(report, stats), *found]


def _what_to_train(report: RunReport) -> str:
    top = ranked_modules(report)[:VERDICT_MODULES]
    if not top:
        return "What to train: no module has a parameter in this run."
    names = ", ".join(f"{m.name} ({pct(m.bound_share)})" for m in top)
    return (f"What to train: the modules with the most bound mass (sum of sqrt(F)) are {names}; together "
            f"{pct(sum(m.bound_share for m in top))} of it. As a mask: `fisher-select select RUN --top 0.01 "
            f"--out MASK.safetensors`; as LoRA targets and ranks: `fisher-select lora RUN --out DIR`.")


def _how_sure(report: RunReport, stats: ReportStatistics) -> str:
    parts = [scale_text(o, uncertainty_of(stats, o.name)) for o in report.objectives[:1]]
    s = stats.stability
    parts.append(f"split halves: {s.message}" if s is not None else "split halves: not measured")
    parts.append(f"truncated at max_new_tokens: {pct(report.truncation_rate)}")
    return "How sure: " + "; ".join(parts) + "."


def _what_to_change(report: RunReport, stats: ReportStatistics) -> str:
    advice = []
    if report.truncation_rate > TRUNCATION_CAVEAT:
        advice.append(f"raise --max-new-tokens (now {report.max_new_tokens}): "
                      f"{pct(report.truncation_rate)} of responses were cut")
    u = uncertainty_of(stats, report.objectives[0].name) if report.objectives else None
    if u is not None and u.num_prompts and u.prompts_without_signal / u.num_prompts > SILENT_PROMPTS_ADVICE:
        advice.append(f"use prompts whose rewards vary, or more --samples-per-prompt: {u.prompts_without_signal} "
                      f"of {u.num_prompts} prompts carried no signal")
    s = stats.stability
    if s is not None and s.verdict != "stable":
        total = sum(s.prompts)  # a report of an older release may suggest no more than it has: say no count then
        more = (f" (about {s.prompts_suggested} in all, {s.prompts_suggested - total} more)"
                if s.prompts_suggested and s.prompts_suggested > total else "")
        advice.append(f"calibrate on more prompts{more}: the split halves do not agree yet")
    if not advice:
        return "What to change: nothing this report flags."
    return "What to change: " + "; ".join(advice) + "."


def selfcheck_text(report: RunReport) -> str:
    """The rules' self-check against autograd (``checks.selfcheck``) in one sentence."""
    c = report.checks.get("selfcheck")
    if not c:
        return "Rule self-check: not run (verify=False in calibrate or fsdp.wrap, or a run from an older release)."
    return (f"Rule self-check (the engine's per-sample sums against autograd on {c.get('rows')} rows, "
            f"{c.get('on', 'first batch')}): max relative error {fmt(c.get('max_relative_error'))} "
            f"(tolerance {fmt(c.get('tolerance'))}) "
            f"over {c.get('parameters')} rule-covered parameters.")


def fallback_rows(report: RunReport) -> list[list[str]]:
    """[parameter, its module's class] for every parameter on the exact per-sample fallback (``coverage.fallback``)."""
    types = report.coverage.get("module_types") or {}
    return [[n, types.get(n.rpartition(".")[0], "?")] for n in report.coverage.get("fallback") or []]


def coverage_text(report: RunReport) -> str:
    """How many parameters each rule covers, and how many are on the fallback (named by ``fallback_rows``)."""
    rules = report.coverage.get("rules") or {}
    counted = ", ".join(f"{rule} {n}" for rule, n in sorted(rules.items())) or "none"
    fallback = len(report.coverage.get("fallback") or [])
    tail = (f"{fallback} on the exact per-sample fallback (one backward per sample: exact, slower), listed below."
            if fallback else "none on the fallback.")
    return f"Parameters per rule: {counted}; {tail} Each parameter's rule is in report.json (coverage.parameter_rules)."
