"""report.json's content (a ``RunReport``) from a calibration, the per-module table, the CLI summary.

Every report carries the caveats of ``fisher_select.caveats``, first, with the run's own numbers
where they bite (``report.text.caveat_block``). The report's statistics (``report.statistics``)
are computed here from the calibration (``build_report``) or again from a run directory
(``refresh_report``, for ``fisher-select report``): what needs only the run's files (F, g, S,
samples, per-prompt scale terms) is recomputed; what needs the sampling pass itself (score means,
split halves, per-batch spread) is kept from the report as written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from fisher_select.calibration.distributed import rank_world
from fisher_select.calibration.rollouts import mismatch_warnings
from fisher_select.caveats import CAVEATS
from fisher_select.report import markdown, page, validation
from fisher_select.report.statistics import (OFF_POLICY, STABLE, ReportStatistics, bound_ratio, concentration,
                                             module_of, module_spread, scale_uncertainty, score_mean_conformity,
                                             signal_diagnostics)
from fisher_select.report.text import caveat_block, fmt, module_rows, statistics_lines
from fisher_select.atomic import write_file
from fisher_select.rundir import (HTML_FILE, REPORT_FILE, SAMPLES_FILE, ModelInfo, ModuleEntry, ObjectiveEntry,
                                  RunReport, grad_file_for, load_run, new_run_id, utc_now)
from fisher_select.rundir import _write_json as write_json  # the one writer of report.json's layout
from fisher_select.rundir import write_run as write_run_dir

__all__ = ["module_of", "module_table", "build_report", "refresh_report", "regenerate", "write_run",
           "summary_lines", "run_warnings", "MARKDOWN_FILE"]

MARKDOWN_FILE = "report.md"


def module_table(fisher: dict[str, torch.Tensor], scale: float | None, types: dict[str, str] | None = None,
                 rel_stderr: dict[str, float] | None = None) -> list[ModuleEntry]:
    """One entry per module with a parameter, sorted by Fisher mass (largest first).

    ``types`` maps module name -> class name (recorded so hints can tell Linear from Conv1D);
    ``rel_stderr`` module name -> relative standard error of its F mass (from the per-batch spread).
    Report tables rank by ``sqrt_fisher_mass`` instead (PITFALLS.md: it predicts movement).
    """
    root = math.sqrt(scale) if scale is not None else None
    table: dict[str, ModuleEntry] = {}
    sqrt_max: dict[str, float] = {}
    for name, f in fisher.items():
        mod = module_of(name)
        entry = table.setdefault(mod, ModuleEntry(mod, 0, 0.0, [], type=(types or {}).get(mod)))
        root_f = f.double().clamp_min(0).sqrt()
        entry.numel += f.numel()
        entry.fisher_mass += float(f.double().sum())
        entry.sqrt_fisher_mass += float(root_f.sum())
        sqrt_max[mod] = max(sqrt_max.get(mod, 0.0), float(root_f.max()) if f.numel() else 0.0)
        entry.parameters.append(name)
    # fsum: exact, so the shares do not depend on the order the parameters come in (memory vs file)
    total = math.fsum(e.fisher_mass for e in table.values()) or 1.0
    sqrt_total = math.fsum(e.sqrt_fisher_mass for e in table.values()) or 1.0
    for e in table.values():
        e.sqrt_fisher_mean = e.sqrt_fisher_mass / max(1, e.numel)
        e.bound_mean = None if root is None else e.sqrt_fisher_mean * root
        e.bound_max = None if root is None else sqrt_max[e.name] * root
        e.mass_share = e.fisher_mass / total
        e.sqrt_mass_share = e.sqrt_fisher_mass / sqrt_total
        e.fisher_mass_rel_stderr = (rel_stderr or {}).get(e.name)
    return sorted(table.values(), key=lambda e: -e.fisher_mass)


def build_report(cal, *, model: ModelInfo, recipe: dict | None, recipe_name: str | None, sampling: dict,
                 settings: dict, command_line: list[str] | None = None) -> RunReport:
    """The report of a finished calibration (``cal``: a ``Calibration``)."""
    objectives = [ObjectiveEntry.from_summary(o.name, o.summary, o.signal_scale, grad_file_for(i, o.name))
                  for i, o in enumerate(cal.objectives)]
    diag = getattr(cal, "diagnostics", None)
    spread = module_spread(diag.unit_names, diag.unit_masses, diag.unit_counts) if diag else {}
    report = RunReport(
        run_id=new_run_id(), created=utc_now(), fisher_select_version=_version(), model=model,
        environment=environment(), command_line=command_line,
        recipe=recipe_name, config=recipe, objectives=objectives,
        num_prompts=cal.num_prompts, num_samples=cal.num_samples, num_truncated=cal.num_truncated,
        samples_per_prompt=settings.get("samples_per_prompt"), max_new_tokens=settings.get("max_new_tokens"),
        seed=settings.get("seed"), sampling=sampling, coverage=cal.coverage, checks=cal.checks,
        caveats=list(CAVEATS),
        modules=module_table(cal.fisher_for(None), cal.signal_scale, cal.coverage.get("module_types"), spread))
    stats = _file_statistics(cal, objectives, [o.grad_estimate for o in cal.objectives], cal.samples,
                             cal.num_prompts, diag.scale_terms if diag else None)
    if cal.score_mean:  # none without score sums (memory modes gradient / fisher: checks["memory"] says so)
        stats.conformity = score_mean_conformity(cal.fisher, cal.score_mean, cal.num_samples,
                                                 heavy_parameters(cal.fisher, cal.coverage))
    stats.stability = diag.split_half if diag else None
    report.statistics = stats.to_json()
    report.warnings = run_warnings(report)
    return report


def heavy_parameters(fisher: dict, coverage: dict) -> set[str]:
    """Parameters of the input embeddings and output head (their scores are rare-token jumps)."""
    heads = set(coverage.get("embeddings") or [])
    return {n for n in fisher if module_of(n) in heads}


def _file_statistics(view, objectives: list[ObjectiveEntry], grads: list[dict], samples: list[dict],
                     num_prompts: int, scale_terms: list[list[float]] | None) -> ReportStatistics:
    """The statistics that need only what a run directory holds (``view``: a Calibration or Run)."""
    stats = ReportStatistics(concentration=concentration(view.fisher))
    for i, entry in enumerate(objectives):
        if scale_terms is not None and entry.signal_scale is not None:
            stats.uncertainty.append(scale_uncertainty(entry.name, scale_terms[i]))
        s = entry.signal_scale
        if s is not None and math.isfinite(s) and s > 0 and grads[i]:  # {}: no signal sums kept (fisher mode)
            stats.bound_ratios.append(bound_ratio(entry.name, grads[i], view.fisher_for(entry.name), s))
        stats.signals.append(signal_diagnostics(entry, samples, num_prompts))
    return stats


def refresh_report(run, grads: list[dict | None], samples: list[dict]) -> RunReport:
    """``run``'s report with every statistic recomputed from its files, the rest kept as written."""
    report = run.report
    old = ReportStatistics.from_json(report.statistics)
    terms = [next((u.scale_terms for u in old.uncertainty if u.objective == e.name), None) for e in report.objectives]
    have_terms = any(t is not None for t in terms)
    stats = _file_statistics(run, report.objectives, grads, samples, report.num_prompts,
                             [[float(v) for v in (t or [])] for t in terms] if have_terms else None)
    stats.uncertainty = [u for u in stats.uncertainty if u.num_prompts]  # objectives without stored terms: none
    stats.conformity, stats.stability = old.conformity, old.stability
    spread = {m.name: m.fisher_mass_rel_stderr for m in report.modules if m.fisher_mass_rel_stderr is not None}
    report.modules = module_table(run.fisher_for(None), run.signal_scale, report.coverage.get("module_types"), spread)
    report.statistics = stats.to_json()
    report.warnings = run_warnings(report)
    return report


def regenerate(path: "str | Path") -> list[Path]:
    """report.json, report.md and report.html of a run directory again, from its files (no sampling, no
    scoring); each file is replaced atomically. Returns the paths written."""
    run = load_run(path)
    grads = [_load_grad(run.path / e.grad_file) for e in run.report.objectives]
    samples_file = run.path / SAMPLES_FILE
    samples = [json.loads(line) for line in samples_file.read_text().splitlines() if line.strip()] \
        if samples_file.is_file() else []
    report = refresh_report(run, grads, samples)
    checked = validation.load_validations(run.path)  # what `fisher-select validate` measured, if anything
    writers = {REPORT_FILE: lambda tmp: write_json(tmp, report.to_json()),
               MARKDOWN_FILE: lambda tmp: markdown.write_markdown(tmp, report, checked),
               HTML_FILE: lambda tmp: page.write_html(tmp, report, samples=samples, validations=checked)}
    return [write_file(run.path / name, writer, overwrite=True) for name, writer in writers.items()]


def _load_grad(path: Path) -> dict | None:
    return load_file(str(path)) if path.is_file() else None


# Libraries whose release can change the numbers (kernels, tokenizers, loaders) or the outputs' format.
_LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "peft", "accelerate", "numpy", "bitsandbytes")


def environment() -> dict:
    """Where the run was made: Python, platform, library versions (None: not installed), ranks.

    (The device and dtype are the recipe's, in ``config``.)
    """
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "platform": platform.platform(),
            "libraries": {name: installed(name) for name in _LIBRARIES},
            "world_size": rank_world()[1]}


def _version() -> str:
    from fisher_select import __version__

    return __version__


def write_run(out: Path, cal, report: RunReport, overwrite: bool) -> Path:
    """The run directory with its HTML and Markdown pages, atomically."""

    def pages(tmp: Path) -> None:
        page.write_html(tmp / HTML_FILE, report, cal)
        markdown.write_markdown(tmp / MARKDOWN_FILE, report)

    return write_run_dir(out, cal, report, overwrite=overwrite, extra=pages)


def summary_lines(report: RunReport, top: int | None = 15) -> list[str]:
    """The summary the CLI prints: caveats with the run's numbers first, then the run, its statistics,
    the ``top`` modules by sum of sqrt(F) (None: all) and the warnings."""
    lines = caveat_block(report, short=True)
    lines.append(f"run {report.run_id}  model {report.model.name}  "
                 f"{report.num_prompts} prompts x {report.samples_per_prompt} samples, "
                 f"truncated {report.truncation_rate:.0%}")
    lines += statistics_lines(report)
    shown = len(report.modules) if top is None else min(top, len(report.modules))
    more = "" if shown == len(report.modules) else "; --all for every module"
    lines.append(f"top {shown} of {len(report.modules)} modules by sum of sqrt(F) (predicts movement; "
                 f"F mass does not){more}:")
    header, rows = module_rows(report, shown)
    lines += ["  " + header] + ["  " + r for r in rows]
    lines += [f"warning: {w}" for w in report.warnings]
    return lines


# Thresholds of the run-level warnings (each warning states the number it saw).
TRUNCATION_WARN = 0.1  # share of responses cut at max_new_tokens
RMS_Z_RANGE = (0.5, 2.0)  # score-mean check: RMS z is about 1 when samples follow the model
RELATIVE_STDERR_WARN = 0.5  # standard error of S relative to S


def run_warnings(report: RunReport) -> list[str]:
    """Degenerate or unreliable results, each with its number and what to do."""
    out = mismatch_warnings(report.checks.get("rollouts"))  # first: off-policy rollouts estimate another Fisher
    if report.truncation_rate > TRUNCATION_WARN:
        out.append(f"{report.truncation_rate:.0%} of responses were cut at max_new_tokens: a cut "
                   "response is not a full sample of the model, so F describes the truncated distribution; "
                   "raise --max-new-tokens if training uses longer responses")
    cut = report.checks.get("prompts_truncated")
    if cut:
        out.append(f"{cut} of {report.num_prompts} prompts were cut to their last tokens to fit the model's context "
                   "(--truncate-prompts): those prompts lost their beginning; shorten them to calibrate on them whole")
    out += list(report.checks.get("memory", {}).get("missing", []))  # what a reduced memory mode left out
    stats = ReportStatistics.from_json(report.statistics)
    if stats.conformity is not None:  # the share of |z| > 3, robust to heavy-tailed embedding scores
        if stats.conformity.verdict == OFF_POLICY:
            out.append(f"score-mean check: {stats.conformity.message}")
    else:  # a report without statistics: the RMS z alone
        rms_z = report.checks.get("score_mean", {}).get("rms_z")
        if rms_z is not None and math.isfinite(rms_z) and not RMS_Z_RANGE[0] <= rms_z <= RMS_Z_RANGE[1]:
            out.append(f"score-mean check: RMS z = {rms_z:.3g} (about 1 expected): the samples may not follow the "
                       "model (off-policy sampling or a bug), or few samples of heavy-tailed scores inflate z; "
                       "raise --samples-per-prompt / --num-prompts")
    if stats.stability is not None and stats.stability.verdict != STABLE:
        out.append(f"estimator stability: {stats.stability.message}")
    for o in report.objectives:
        out += [f"({o.name}) {w}" for w in _objective_warnings(o, report.num_prompts)]
    return out


def _objective_warnings(o: ObjectiveEntry, num_prompts: int) -> list[str]:
    out = list(o.warnings)
    if o.signal_scale == 0.0:
        out.append("signal scale S = 0: no sampled response carried signal (e.g. every reward of a prompt was "
                   "equal), so every bound is 0; use prompts whose rewards vary, or more samples per prompt")
    silent = o.details.get("prompts_without_signal")
    if silent and o.signal_scale != 0.0:
        out.append(f"{silent} of {num_prompts} prompts carried no signal (constant rewards): S rests on the rest")
    stderr = o.details.get("signal_scale_stderr")
    if stderr is not None and o.signal_scale and math.isfinite(o.signal_scale) \
            and stderr > RELATIVE_STDERR_WARN * o.signal_scale:
        out.append(f"S = {fmt(o.signal_scale)} has a standard error of {fmt(stderr)} "
                   f"({stderr / o.signal_scale:.0%}): raise --num-prompts or --samples-per-prompt for a reliable scale")
    return out
