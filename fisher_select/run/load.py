"""Loading a run directory: ``Run`` (F, F^tok and the report; the bounds through ``BoundsView``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fisher_select.errors import FisherSelectError
from fisher_select.run.io import read_json, read_tensors
from fisher_select.run.names import FISHER_FILE, REPORT_FILE, TOKEN_FISHER_FILE
from fisher_select.run.schema import ObjectiveEntry, RunReport
from fisher_select.stats.bounds import BoundsView


@dataclass
class Run(BoundsView):
    """A loaded calibration run. ``fisher`` maps parameter name -> F (fp32)."""

    report: RunReport
    fisher: dict[str, torch.Tensor]
    path: Path | None = None
    token_fisher: dict[str, torch.Tensor] | None = None  # F^tok, for token-level objectives

    @property
    def run_id(self) -> str:
        return self.report.run_id

    @property
    def fingerprint(self) -> dict:
        return self.report.model.fingerprint

    @property
    def objectives(self) -> list[ObjectiveEntry]:
        return self.report.objectives

    def describe_source(self) -> str:
        return f"run {self.run_id}"

    def grad_estimate_of(self, objective: str | None = None) -> dict[str, torch.Tensor]:
        """The objective's Monte-Carlo gradient estimate g_hat, read from the run directory."""
        entry = self.objective(objective)
        path = self.path / entry.grad_file if self.path is not None and entry.grad_file else None
        if path is None or not path.is_file():
            raise FisherSelectError(f"{self.describe_source()} keeps no gradient estimate for objective {entry.name!r} "
                                    f"({path or 'no run directory'}); rank by the bound, or recalibrate with the "
                                    "default accumulators (not --accumulators fisher)")
        return read_tensors(path)

    def provenance(self, caveat: str) -> dict:
        """What every output made from this run records: run id, model, caveats."""
        return {"run_id": self.run_id,
                "model": {"name": self.report.model.name, "fingerprint": self.fingerprint},
                "caveat": caveat, "run_caveats": list(self.report.caveats)}


def load_run(run: "str | os.PathLike | Run") -> Run:
    """Load a run directory (or pass a loaded `Run` through)."""
    if isinstance(run, Run):
        return run
    path = Path(run)
    report = load_run_report(path)
    token = path / TOKEN_FISHER_FILE
    return Run(report=report, fisher=read_tensors(path / FISHER_FILE), path=path,
               token_fisher=read_tensors(token) if token.is_file() else None)


def load_run_report(path: "str | os.PathLike") -> RunReport:
    """A run directory's report alone: no tensor is read (what redrawing the pages needs)."""
    path = Path(path)
    report_path = path / REPORT_FILE
    if not report_path.is_file() or not (path / FISHER_FILE).is_file():
        raise FisherSelectError(
            f"{path} is not a fisher_select run directory (no {REPORT_FILE} / {FISHER_FILE}); "
            "pass the --out directory of `fisher-select calibrate`")
    return RunReport.from_json(read_json(report_path), str(report_path))
