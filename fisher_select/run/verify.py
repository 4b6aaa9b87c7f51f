"""Two runs compared, for both commands that compare runs.

- ``compare_runs`` (``fisher-select verify``): are two runs the same result? Every tensor bit for bit,
  the samples, the report but what identifies the run; the environment apart.
- ``agreement`` (``fisher-select compare``): how far do two runs that are expected to differ (two
  objectives, models, seeds) agree? Top-k coordinate mask overlaps and the rank correlation of
  module masses. ``report.compare`` lays the comparison out beside each run's numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fisher_select.run.io import read_json, read_tensors
from fisher_select.run.load import Run, load_run
from fisher_select.run.names import BOUNDS_FILE, FISHER_FILE, GRAD_GLOB, REPORT_FILE, SAMPLES_FILE, TOKEN_FISHER_FILE
from fisher_select.stats.bounds import module_masses
from fisher_select.stats.correlation import mask_jaccards, spearman
from fisher_select.stats.naming import module_of
from fisher_select.stats.stability import TOP_FRACTIONS


@dataclass
class RunDifferences:
    """What two run directories differ in: their results (tensors, samples, report) and, apart,
    where they were made (``environment``: one line per library whose version differs)."""

    results: list[str]
    environment: list[str]

    @property
    def identical_results(self) -> bool:
        return not self.results


# Report keys that identify a run or say where and how fast it was made, not what it found.
_IDENTITY_KEYS = ("run_id", "created", "command_line", "environment", "timings")


def compare_runs(a: "str | os.PathLike", b: "str | os.PathLike") -> RunDifferences:
    """Two run directories' contents compared: every tensor file tensor by tensor and bit for bit, the
    samples, then the report except what identifies the run (id, time, command line); the environment
    (Python, platform, library versions) is compared apart."""
    a, b = Path(a), Path(b)
    load_run(a), load_run(b)  # both must be runs of this format
    diffs = _tensor_differences(a, b)
    if (a / SAMPLES_FILE).read_bytes() != (b / SAMPLES_FILE).read_bytes():
        diffs.append(f"{SAMPLES_FILE} differs (other samples: seed, settings or model)")
    ra, rb = (read_json(d / REPORT_FILE) for d in (a, b))
    for key in sorted(set(ra) | set(rb)):
        if key not in _IDENTITY_KEYS and ra.get(key) != rb.get(key):
            diffs.append(f"{REPORT_FILE}: {key} differs")
    return RunDifferences(diffs, environment_differences(ra.get("environment") or {}, rb.get("environment") or {}))


def _tensor_differences(a: Path, b: Path) -> list[str]:
    diffs = []
    files = sorted(set(_run_tensor_files(a)) | set(_run_tensor_files(b)))  # masks saved beside a run are not part of it
    for name in files:
        if not (a / name).is_file() or not (b / name).is_file():
            diffs.append(f"{name}: only in {a if (a / name).is_file() else b}")
            continue
        ta, tb = read_tensors(a / name), read_tensors(b / name)
        for key in sorted(set(ta) | set(tb)):
            if key not in ta or key not in tb:
                diffs.append(f"{name}: {key} only in one run")
            elif ta[key].shape != tb[key].shape or not torch.equal(ta[key], tb[key]):
                diffs.append(f"{name}: {key} differs (max |difference| {_max_difference(ta[key], tb[key])})")
    return diffs


def environment_differences(ea: dict, eb: dict) -> list[str]:
    """One line per library (or Python, platform, world size) whose value differs between two runs."""
    out = []
    la, lb = ea.get("libraries") or {}, eb.get("libraries") or {}
    for name in sorted(set(la) | set(lb)):
        if la.get(name) != lb.get(name):
            out.append(f"{name} {la.get(name) or 'not installed'} vs {lb.get(name) or 'not installed'}")
    for key in sorted((set(ea) | set(eb)) - {"libraries"}):
        if ea.get(key) != eb.get(key):
            out.append(f"{key} {ea.get(key)} vs {eb.get(key)}")
    return out


def _run_tensor_files(path: Path) -> list[str]:
    names = [FISHER_FILE, BOUNDS_FILE, TOKEN_FISHER_FILE] + [p.name for p in path.glob(GRAD_GLOB)]
    return [n for n in names if (path / n).is_file()]


def _max_difference(x: torch.Tensor, y: torch.Tensor) -> str:
    if x.shape != y.shape:
        return f"shapes {tuple(x.shape)} vs {tuple(y.shape)}"
    return f"{float((x.double() - y.double()).abs().max()):.3g}"


@dataclass
class PairAgreement:
    """How two runs' Fishers agree; ``comparable`` is False when their parameters differ."""

    run_a: str
    run_b: str
    comparable: bool
    top_fractions: list[float] = field(default_factory=list)
    jaccard: list[float] = field(default_factory=list)  # of the exact top-fraction masks of F, per fraction
    spearman_bound_mass: float | None = None  # module sums of sqrt(F), over common modules
    spearman_fisher_mass: float | None = None  # module sums of F
    common_modules: int = 0
    note: str = ""


def agreement(a: Run, b: Run, name_a: str, name_b: str) -> PairAgreement:
    fa, fb = a.fisher, b.fisher
    same = set(fa) == set(fb) and all(fa[n].shape == fb[n].shape for n in fa)
    out = PairAgreement(name_a, name_b, same)
    if same:
        out.top_fractions = list(TOP_FRACTIONS)
        out.jaccard = mask_jaccards(fa, fb, TOP_FRACTIONS)
    else:
        out.note = "different parameters (names or shapes): no coordinate masks to overlap"
    common = sorted({module_of(n) for n in fa} & {module_of(n) for n in fb})
    out.common_modules = len(common)
    if common:
        ma = module_masses({n: t for n, t in fa.items() if module_of(n) in common})
        mb = module_masses({n: t for n, t in fb.items() if module_of(n) in common})
        out.spearman_bound_mass = spearman([ma[m].bound_mass for m in common], [mb[m].bound_mass for m in common])
        out.spearman_fisher_mass = spearman([ma[m].fisher_mass for m in common], [mb[m].fisher_mass for m in common])
    return out
