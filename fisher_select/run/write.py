"""The one writer of a run directory (docs/RUN_FORMAT.md).

``write_run`` writes a whole run atomically (``fisher_select.atomic.write_dir``: complete or absent):
the tensors, samples.jsonl, the pages ``report/`` renders, then report.json. ``rewrite_report``
replaces the report and its pages of an existing run, each file atomically. The pages are passed in
(file name -> writer of that file), so the run directory never imports the report's renderers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from fisher_select.atomic import write_dir, write_file
from fisher_select.run.io import save_tensors, write_json
from fisher_select.run.names import BOUNDS_FILE, FISHER_FILE, REPORT_FILE, SAMPLES_FILE, TOKEN_FISHER_FILE
from fisher_select.run.schema import RunReport

Pages = dict[str, Callable[[Path], None]]  # file name in the run directory -> writes that file at the path given


def write_run(out: Path, cal, report: RunReport, overwrite: bool, pages: Pages | None = None,
              before_report: Callable[[], None] | None = None) -> Path:
    """The run directory of ``cal`` (a Calibration), atomically: tensors and samples, ``pages``, then
    report.json. ``before_report``: called just before report.json is written (e.g. to record the
    writing time in ``report.timings``)."""

    def writer(tmp: Path) -> None:
        _write_results(tmp, cal, report)
        for name, write in (pages or {}).items():
            write(tmp / name)
        if before_report is not None:
            before_report()
        write_json(tmp / REPORT_FILE, report.to_json())

    return write_dir(out, writer, overwrite=overwrite)


def rewrite_report(path: Path, report: RunReport, pages: Pages | None = None) -> list[Path]:
    """report.json and ``pages`` of the run directory ``path`` again, each file replaced atomically
    (tensors and samples are never rewritten). Returns the paths written, report.json first."""
    writers = {REPORT_FILE: lambda tmp: write_json(tmp, report.to_json()), **(pages or {})}
    return [write_file(path / name, writer, overwrite=True) for name, writer in writers.items()]


def _write_results(folder: Path, cal, report: RunReport) -> None:
    """A run's tensor files and samples.jsonl into ``folder``: all of a run but its report and pages."""
    meta = {"run_id": report.run_id, "model": report.model.name}
    save_tensors(folder / FISHER_FILE, cal.fisher, meta)
    if cal.token_fisher is not None:
        save_tensors(folder / TOKEN_FISHER_FILE, cal.token_fisher, meta)
    scale = cal.signal_scale
    if scale is not None and math.isfinite(scale):
        save_tensors(folder / BOUNDS_FILE, cal.bound(), {**meta, "signal_scale": scale})
    for entry, result in zip(report.objectives, cal.objectives):
        save_tensors(folder / entry.grad_file, result.grad_estimate, {**meta, "objective": result.name})
    with open(folder / SAMPLES_FILE, "w") as fh:
        for s in cal.samples:
            fh.write(json.dumps(s) + "\n")


def run_bytes(num_parameters: int, num_objectives: int) -> int:
    """About the most a run directory takes: fp32 tensors of F, the bounds, a token-level F and one
    gradient estimate per objective (4 bytes per coordinate each), plus 64 MiB of samples and pages."""
    return 4 * num_parameters * (3 + num_objectives) + 64 * 2**20
