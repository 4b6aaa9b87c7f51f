"""The report of a run: built from a calibration, refreshed from a run's files, and handed with its
pages to the run directory's one writer (``run.write``).

Every report carries the caveats of ``fisher_select.caveats``, first, with the run's own numbers
where they bite (``report.text.caveat_block``). The report's statistics (``report.statistics``)
are computed here from the calibration (``build_report``) or again from a run directory
(``refresh_report``, for ``fisher-select report``): what needs only the run's files (F, g, S,
samples, per-prompt scale terms) is recomputed; what needs the sampling pass itself (score means,
split halves, per-batch spread) is kept from the report as written.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from fisher_select.caveats import CAVEATS
from fisher_select.distributed import rank_world
from fisher_select.report import experts, markdown, outcomes_section, page
from fisher_select.report.statistics import (ReportStatistics, bound_ratio, concentration, module_spread,
                                             scale_uncertainty, signal_diagnostics)
from fisher_select.report.warnings import run_warnings
from fisher_select.run.io import read_run_samples, read_tensors
from fisher_select.run.load import load_run, load_run_report
from fisher_select.run.names import HTML_FILE, MARKDOWN_FILE, SAMPLES_FILE, grad_file_for
from fisher_select.run.schema import ModelInfo, ModuleEntry, ObjectiveEntry, RunReport, new_run_id, utc_now
from fisher_select.run.validation import load_validations
from fisher_select.run.write import rewrite_report, write_run
from fisher_select.stats.bounds import module_masses
from fisher_select.stats.experts import experts_by_module, fused_experts
from fisher_select.timing import PhaseClock
from fisher_select.version import __version__


def module_table(fisher: dict[str, torch.Tensor], scale: float | None, types: dict[str, str] | None = None,
                 rel_stderr: dict[str, float] | None = None) -> list[ModuleEntry]:
    """One entry per module with a parameter, by bound mass (sum of sqrt(F)), largest first.

    Bound mass ranks modules because it tracks how much training moves them; the Fisher mass (sum
    of F), dominated by a few huge coordinates, does not (docs/VALIDATION.md). Both are recorded.
    ``types`` maps module name -> class name (recorded so hints can tell Linear from Conv1D);
    ``rel_stderr`` module name -> relative standard error of its F mass (from the per-batch spread).
    """
    root = math.sqrt(scale) if scale is not None else None
    masses = module_masses(fisher)
    table = [ModuleEntry(m.name, m.numel, m.fisher_mass, m.parameters, type=(types or {}).get(m.name),
                         bound_mass=m.bound_mass) for m in masses.values()]
    # fsum: exact, so the shares do not depend on the order the parameters come in (memory vs file)
    total = math.fsum(e.fisher_mass for e in table) or 1.0
    bound_total = math.fsum(e.bound_mass for e in table) or 1.0
    for e in table:
        e.bound_mass_per_coordinate = e.bound_mass / max(1, e.numel)
        e.bound_mean = None if root is None else e.bound_mass_per_coordinate * root
        e.bound_max = None if root is None else masses[e.name].root_max * root
        e.fisher_share = e.fisher_mass / total
        e.bound_share = e.bound_mass / bound_total
        e.fisher_mass_rel_stderr = (rel_stderr or {}).get(e.name)
    return sorted(table, key=lambda e: (-e.bound_mass, e.name))


def build_report(cal, *, model: ModelInfo, recipe: dict | None, recipe_name: str | None, sampling: dict,
                 settings: dict, command_line: list[str] | None = None) -> RunReport:
    """The report of a finished calibration (``cal``: a ``Calibration``)."""
    objectives = [ObjectiveEntry.from_summary(o.name, o.summary, o.signal_scale, grad_file_for(i, o.name))
                  for i, o in enumerate(cal.objectives)]
    diag = getattr(cal, "diagnostics", None)
    spread = module_spread(diag.unit_names, diag.unit_masses, diag.unit_counts) if diag else {}
    report = RunReport(
        run_id=new_run_id(), created=utc_now(), fisher_select_version=__version__, model=model,
        environment=environment(), command_line=command_line,
        recipe=recipe_name, config=recipe, objectives=objectives,
        num_prompts=cal.num_prompts, num_samples=cal.num_samples, num_truncated=cal.num_truncated,
        samples_per_prompt=settings.get("samples_per_prompt"), max_new_tokens=settings.get("max_new_tokens"),
        seed=settings.get("seed"), sampling=sampling, coverage=cal.coverage, checks=cal.checks,
        caveats=list(CAVEATS),
        modules=module_table(cal.fisher_for(None), cal.signal_scale, cal.coverage.get("module_types"), spread))
    stats = _file_statistics(cal, objectives, [o.grad_estimate for o in cal.objectives], cal.samples,
                             cal.num_prompts, diag.scale_terms if diag else None)
    stats.conformity = diag.conformity if diag else None  # none without score sums (memory modes gradient / fisher)
    stats.stability = diag.split_half if diag else None
    report.statistics = stats.to_json()
    report.experts = _experts_json(cal.fisher_for(None), cal.signal_scale, getattr(cal, "expert_tokens", None),
                                   getattr(cal, "expert_positions", None))
    report.warnings = run_warnings(report)
    return report


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
    old_experts = experts.section_of(report.experts)  # the counts need the sampling pass: kept as written
    counts = {kind: {layer.module: getattr(layer, kind) for layer in old_experts.layers
                     if getattr(layer, kind) is not None} if old_experts else None for kind in ("tokens", "positions")}
    report.experts = _experts_json(run.fisher_for(None), run.signal_scale, counts["tokens"], counts["positions"])
    report.warnings = run_warnings(report)
    return report


def _experts_json(fisher: dict, scale: float | None, tokens: dict | None, positions: dict | None) -> dict | None:
    """report.json's ``experts``: per MoE layer, tokens per expert and bound masses (None: no fused experts)."""
    known = experts_by_module(fused_experts({n: tuple(f.shape) for n, f in fisher.items()}))
    # counts of a routed module whose tensors the section does not split (not named like fused experts) are
    # left out rather than refused: a finished calibration is never lost to its report
    tokens, positions = ({m: c for m, c in (d or {}).items() if m in known} or None for d in (tokens, positions))
    section = experts.expert_section(fisher, scale, tokens, positions)
    return None if section is None else section.to_json()


def regenerate(path: "str | Path", recompute: bool = False) -> list[Path]:
    """report.json, report.md and report.html of a run directory again (no sampling, no scoring); each
    file is replaced atomically. Returns the paths written.

    By default the pages are redrawn from report.json (every plot is drawn from its statistics), so no
    tensor is read; ``recompute`` first recomputes the statistics from the run's tensors and samples."""
    path = Path(path)
    report = load_run_report(path)
    samples_file = path / SAMPLES_FILE
    samples = read_run_samples(samples_file, report.num_samples) if samples_file.is_file() else []
    if recompute:
        run = load_run(path)
        report = refresh_report(run, [_load_grad(path / e.grad_file) for e in run.report.objectives], samples)
    else:
        report.warnings = run_warnings(report)
    checked = load_validations(path)  # what `fisher-select validate` measured, if anything
    outcomes = outcomes_section.load_outcomes(path)  # what the outcome study measured, if it ran
    pages = {MARKDOWN_FILE: lambda tmp: markdown.write_markdown(tmp, report, checked, outcomes),
             HTML_FILE: lambda tmp: page.write_html(tmp, report, samples=samples, validations=checked,
                                                    outcomes=outcomes, run_dir=path)}
    return rewrite_report(path, report, pages)


def _load_grad(path: Path) -> dict | None:
    return read_tensors(path) if path.is_file() else None


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


def write_run_with_pages(out: Path, cal, report: RunReport, overwrite: bool, clock: PhaseClock | None = None) -> Path:
    """The run directory of ``cal`` with report.html and report.md, through the one writer
    (``run.write.write_run``). ``clock``: the run's phase clock; writing is its last lap, and
    ``report.timings`` (in report.json) then holds every phase."""
    pages = {HTML_FILE: lambda tmp: page.write_html(tmp, report, cal),
             MARKDOWN_FILE: lambda tmp: markdown.write_markdown(tmp, report)}

    def stamp_timings() -> None:
        clock.lap("writing")
        report.timings = run_timings(clock, cal)

    return write_run(out, cal, report, overwrite, pages, stamp_timings if clock is not None else None)


def run_timings(clock: PhaseClock, cal) -> dict:
    """report.json's ``timings``: the calibration lap split into sampling, scoring and the rest (the
    checks, objectives' statistics, merging), with sampling's tokens/s and scoring's samples/s."""
    t = cal.timings
    clock.split("calibration", {"sampling": t.get("sampling_s", 0.0), "scoring": t.get("scoring_s", 0.0)}, "checks")
    rates = {"response_tokens_per_s": t.get("response_tokens", 0) / max(t.get("sampling_s", 0.0), 1e-9),
             "samples_per_s": t.get("samples", 0) / max(t.get("scoring_s", 0.0), 1e-9),
             "note": "this process's wall clock; report.json itself and the final rename are not counted"}
    return clock.to_json(rates)
