"""Run directories: written atomically, loaded as a `Run`.

A run directory holds
- ``fisher.safetensors``: diagonal Fisher F per parameter (fp32, the parameter's shape; for a
  bitsandbytes-quantized Linear, the shape of the dequantized weight);
- ``bounds.safetensors``: ``sqrt(F * S)`` of the primary objective (only when S is known);
- ``grad_estimate.safetensors``: Monte Carlo estimate of the primary objective's expected
  gradient (``grad_estimate-<objective>.safetensors`` for further objectives);
- ``samples.jsonl``, ``report.json`` and ``report.html``.

Everything is written into a sibling temporary directory which is renamed into place, so a run
directory is complete or absent, never half-written.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from fisher_select.errors import FisherSelectError

FISHER_FILE = "fisher.safetensors"
BOUNDS_FILE = "bounds.safetensors"
GRAD_FILE = "grad_estimate.safetensors"
TOKEN_FISHER_FILE = "fisher_token.safetensors"
REPORT_FILE = "report.json"


@dataclass
class Run:
    """A loaded calibration run. ``fisher`` maps parameter name -> F (fp32)."""

    report: dict
    fisher: dict[str, torch.Tensor]
    path: Path | None = None
    token_fisher: dict[str, torch.Tensor] | None = None  # F^tok, for token-level objectives
    _grads: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def run_id(self) -> str:
        return self.report["run_id"]

    @property
    def fingerprint(self) -> dict:
        return self.report["model"]["fingerprint"]

    @property
    def objectives(self) -> list[dict]:
        return self.report["objectives"]

    @property
    def signal_scale(self) -> float | None:
        """S of the primary (first) objective; None when unknown (e.g. SFT without a density)."""
        return self.signal_scale_of(None)

    def bound(self, objective: str | None = None) -> dict[str, torch.Tensor]:
        """``sqrt(F_i * S)`` per coordinate for one objective (default: the primary one).

        When S is unknown the bound is only known up to the common factor ``sqrt(S)``; this
        returns ``sqrt(F)`` then (same ranking) -- check ``signal_scale`` before using absolute
        thresholds.
        """
        return coordinate_bound(self.fisher_for(objective), self.signal_scale_of(objective))

    def fisher_for(self, objective: str | None = None) -> dict[str, torch.Tensor]:
        """The Fisher an objective's bound uses: F^tok for token-level objectives, else F."""
        entry = self._entry(objective)
        return self.token_fisher if entry.get("token_level") and self.token_fisher is not None else self.fisher

    def signal_scale_of(self, objective: str | None) -> float | None:
        """S of ``objective`` (default: the primary one); an error for an unknown objective name."""
        value = self._entry(objective).get("signal_scale")
        return None if value is None else float(value)  # JSON holds an infinite S as "inf"

    def _entry(self, objective: str | None) -> dict:
        for entry in self.objectives:
            if objective is None or entry["name"] == objective:
                return entry
        names = ", ".join(e["name"] for e in self.objectives)
        raise FisherSelectError(f"run {self.run_id} has no objective {objective!r}; it has: {names}")


def coordinate_bound(fisher: dict[str, torch.Tensor], scale: float | None) -> dict[str, torch.Tensor]:
    """``sqrt(F_i * S)`` per coordinate; ``sqrt(F_i)`` when S is unknown (None)."""
    root = math.sqrt(scale) if scale is not None else 1.0  # inf when S is infinite: no bound
    # F_i = 0 means h_i = 0 on every response, so g_i = 0 whatever S is (avoid 0 * inf).
    return {name: torch.where(f > 0, f.sqrt() * root, 0.0) for name, f in fisher.items()}


def load_run(run: "str | os.PathLike | Run") -> Run:
    """Load a run directory (or pass a loaded `Run` through)."""
    if isinstance(run, Run):
        return run
    path = Path(run)
    report_path = path / REPORT_FILE
    if not report_path.is_file() or not (path / FISHER_FILE).is_file():
        raise FisherSelectError(
            f"{path} is not a fisher_select run directory (no {REPORT_FILE} / {FISHER_FILE}); "
            "pass the --out directory of `fisher-select calibrate`"
        )
    report = json.loads(report_path.read_text())
    token = path / TOKEN_FISHER_FILE
    return Run(report=report, fisher=load_file(str(path / FISHER_FILE)), path=path,
               token_fisher=load_file(str(token)) if token.is_file() else None)


def write_atomically(out: Path, writer: Callable[[Path], None], overwrite: bool) -> None:
    """Call ``writer(tmpdir)`` then move the finished directory to ``out`` in one rename.

    An existing non-empty ``out`` is replaced only with ``overwrite``; on any error the temporary
    directory is removed and ``out`` is left as it was.
    """
    out = Path(out)
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a run directory is an ordinary one
    try:
        writer(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse, before any work is done, to replace a non-empty directory without ``overwrite``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FisherSelectError(f"output path {out} exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FisherSelectError(
            f"output directory {out} already holds files (another run?); "
            "pass --overwrite to replace it or choose another --out"
        )


def _replace_dir(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.replace(tmp, out)
        return
    trash = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, trash)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(trash, out)
        raise
    shutil.rmtree(trash, ignore_errors=True)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """safetensors with contiguous CPU tensors and string metadata."""
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(flat, str(path), metadata={k: str(v) for k, v in (metadata or {}).items()})


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj):
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
