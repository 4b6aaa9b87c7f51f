"""One builder for in-memory runs and run directories in tests (the schema lives in fisher_select.run.schema)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fisher_select.report.build import module_table
from fisher_select.run.io import save_tensors
from fisher_select.run.load import Run
from fisher_select.run.names import FISHER_FILE, REPORT_FILE
from fisher_select.run.schema import ModelInfo, ObjectiveEntry, RunReport


def make_run(fisher: dict[str, torch.Tensor], *, objectives=({"name": "rl", "signal_scale": 1.0},),
             fingerprint: dict | None = None, model_name: str = "synthetic", run_id: str = "run-test",
             caveats=(), token_fisher: dict[str, torch.Tensor] | None = None) -> Run:
    """A run over ``fisher``; objectives as report.json entries (``"inf"`` allowed for S, type = name by default).

    Modules come from the library's own table (parameters grouped by dotted prefix, largest
    Fisher mass first); no module types are recorded.
    """
    entries = [ObjectiveEntry.from_json({"type": o["name"], **o}) for o in objectives]
    report = RunReport(run_id=run_id, model=ModelInfo(model_name, fingerprint or {"id": "synthetic"}, "/nowhere", None, None, None),
                       objectives=entries, modules=module_table(fisher, None), caveats=list(caveats))
    return Run(report=report, fisher=fisher, token_fisher=token_fisher)


def write_run_dir(run: Run, path: Path) -> Path:
    """A minimal run directory (fisher + report) from an in-memory Run."""
    path.mkdir()
    save_tensors(path / FISHER_FILE, run.fisher)
    (path / REPORT_FILE).write_text(json.dumps(run.report.to_json(), indent=2))
    return path
