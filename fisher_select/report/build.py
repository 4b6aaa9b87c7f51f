"""report.json, the run directory's tensors, and the per-module table.

Every report carries the caveats of ``fisher_select.caveats``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path

import torch

from fisher_select.caveats import CAVEAT_LINE, CAVEATS
from fisher_select.report import page
from fisher_select.rundir import (BOUNDS_FILE, FISHER_FILE, GRAD_FILE, REPORT_FILE, TOKEN_FISHER_FILE, save_tensors,
                  write_atomically, write_json)

def module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def module_table(fisher: dict[str, torch.Tensor], scale: float | None, types: dict[str, str] | None = None) -> list[dict]:
    """One entry per module with a parameter, sorted by Fisher mass (largest first).

    ``types`` maps module name -> class name (recorded so hints can tell Linear from Conv1D).
    """
    root = math.sqrt(scale) if scale is not None else None
    table: dict[str, dict] = {}
    for name, f in fisher.items():
        mod = module_of(name)
        entry = table.setdefault(mod, {"name": mod, "type": (types or {}).get(mod), "numel": 0, "fisher_mass": 0.0,
                                       "_sqrt_sum": 0.0, "_sqrt_max": 0.0, "parameters": []})
        entry["numel"] += f.numel()
        entry["fisher_mass"] += float(f.double().sum())
        root_f = f.double().clamp_min(0).sqrt()
        entry["_sqrt_sum"] += float(root_f.sum())
        entry["_sqrt_max"] = max(entry["_sqrt_max"], float(root_f.max()) if f.numel() else 0.0)
        entry["parameters"].append(name)
    rows = []
    for e in table.values():
        sqrt_sum, sqrt_max = e.pop("_sqrt_sum"), e.pop("_sqrt_max")
        e["bound_mean"] = None if root is None else sqrt_sum / max(1, e["numel"]) * root
        e["bound_max"] = None if root is None else sqrt_max * root
        e["sqrt_fisher_mean"] = sqrt_sum / max(1, e["numel"])
        rows.append(e)
    total = sum(r["fisher_mass"] for r in rows) or 1.0
    for r in rows:
        r["mass_share"] = r["fisher_mass"] / total
    return sorted(rows, key=lambda r: -r["fisher_mass"])


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]


def build_report(cal, *, model: dict, recipe: dict | None, recipe_name: str | None, sampling: dict,
                 settings: dict) -> dict:
    """The report.json content (JSON-ready)."""
    primary = cal.objectives[0]
    objectives = []
    for o in cal.objectives:
        objectives.append({**o.summary, "name": o.name, "signal_scale": _finite(o.signal_scale),
                           "grad_file": GRAD_FILE if o is primary else f"grad_estimate-{o.name}.safetensors"})
    token = primary.summary.get("token_level", False)
    return {
        "run_id": new_run_id(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fisher_select_version": _version(),
        "model": model,
        "recipe": recipe_name,
        "config": recipe,
        "objective": primary.name,
        "signal": primary.summary.get("signal"),
        "signal_scale": _finite(primary.signal_scale),
        "objectives": objectives,
        "num_prompts": cal.num_prompts,
        "num_samples": cal.num_samples,
        "samples_per_prompt": settings.get("samples_per_prompt"),
        "max_new_tokens": settings.get("max_new_tokens"),
        "seed": settings.get("seed"),
        "truncation_rate": cal.truncation_rate,
        "num_truncated": cal.num_truncated,
        "sampling": sampling,
        "coverage": cal.coverage,
        "checks": cal.checks,
        "caveats": CAVEATS,
        "modules": module_table(cal.token_fisher if token else cal.fisher, primary.signal_scale,
                                cal.coverage.get("module_types")),
    }


def _finite(x):
    """JSON has no inf/nan: infinite S is written as the string "inf"."""
    if x is None or (isinstance(x, float) and math.isfinite(x)):
        return x
    return str(x)


def _version() -> str:
    from fisher_select import __version__

    return __version__


def write_run(out: Path, cal, report: dict, overwrite: bool) -> None:
    """Write the whole run directory atomically."""

    def writer(tmp: Path) -> None:
        meta = {"run_id": report["run_id"], "model": report["model"]["name"]}
        save_tensors(tmp / FISHER_FILE, cal.fisher, meta)
        if cal.token_fisher is not None:
            save_tensors(tmp / TOKEN_FISHER_FILE, cal.token_fisher, meta)
        scale = cal.signal_scale
        if scale is not None and math.isfinite(scale):
            save_tensors(tmp / BOUNDS_FILE, cal.bound(), {**meta, "signal_scale": scale})
        for entry, result in zip(report["objectives"], cal.objectives):
            save_tensors(tmp / entry["grad_file"], result.grad_estimate, {**meta, "objective": result.name})
        with open(tmp / "samples.jsonl", "w") as fh:
            for s in cal.samples:
                fh.write(json.dumps(s) + "\n")
        write_json(tmp / REPORT_FILE, report)

        page.write_html(tmp / "report.html", report, cal)

    write_atomically(out, writer, overwrite)


def summary_lines(report: dict, top: int = 8) -> list[str]:
    """The short summary the CLI prints."""
    lines = [f"run {report['run_id']}  model {report['model']['name']}  "
             f"{report['num_prompts']} prompts x {report['samples_per_prompt']} samples, "
             f"truncated {report['truncation_rate']:.0%}"]
    for o in report["objectives"]:
        lines.append(f"objective {o['name']} ({o['type']}): S = {o['signal_scale']}   signal: {o['signal']}")
    lines.append(f"top modules by Fisher mass (of {len(report['modules'])}):")
    for m in report["modules"][:top]:
        bound = f"{m['bound_max']:.3g}" if m["bound_max"] is not None else "n/a (S unknown)"
        lines.append(f"  {m['mass_share']:6.1%}  {m['name']:<45} bound max {bound}")
    if report["truncation_rate"] > 0.1:
        lines.append(f"warning: {report['truncation_rate']:.0%} of responses were cut at max_new_tokens: a cut "
                     "response is not a full sample of the model, so F describes the truncated distribution; "
                     "raise --max-new-tokens if training uses longer responses")
    for o in report["objectives"]:
        for w in o.get("warnings", []):
            lines.append(f"warning ({o['name']}): {w}")
    lines.append(CAVEAT_LINE)
    return lines
