"""validation.json's typed, versioned record: what `fisher-select validate` measured for a run.

Written by ``training.validate`` into ``RUN/validation-<optimizer>-seed<seed>/`` and rendered once,
by ``report.validation_section``. The coordinate metrics of the run's ranking (``auroc``,
``precision_at_k``, ...) sit at the top level of the JSON, as every baseline's do; the record keeps
them in ``metrics``.

Format 1 (no ``format_version`` key) named the module aggregates ``sum_sqrt_fisher`` / ``sum_fisher``;
format 2 names them ``bound_mass`` / ``fisher_mass``, as report.json does. Format 1 files still load.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fisher_select.errors import FisherSelectError
from fisher_select.run.io import read_json_files
from fisher_select.run.names import VALIDATION_GLOB

VALIDATION_FORMAT_VERSION = 2
_RENAMES_1 = {"sum_sqrt_fisher": "bound_mass", "sum_fisher": "fisher_mass"}  # format 1 -> 2


@dataclass
class ValidationRecord:
    """validation.json. Module aggregates: the bound mass (sum of sqrt(F)) and the Fisher mass (sum of F)."""

    run_id: str = ""
    model: str = ""
    objective: dict = field(default_factory=dict)  # name, type of the trained objective
    settings: dict = field(default_factory=dict)  # the training settings and validation options
    training: dict = field(default_factory=dict)  # what was trained and measured, in words
    subsample: dict = field(default_factory=dict)
    ranking: str = ""
    metrics: dict = field(default_factory=dict)  # the run's ranking: auroc, precision_at_k, recall_at_k, ...
    # bound_mass, fisher_mass: Spearman of each module aggregate against module movement; chosen; modules; meaning
    spearman_modules: dict = field(default_factory=dict)
    module_table: list[dict] = field(default_factory=list)  # module, fisher_mass, bound_mass, movement
    auroc_by_step: dict = field(default_factory=dict)
    first_step: dict = field(default_factory=dict)  # the first-step check (violation_rate None: no S, and why)
    training_outcome: dict = field(default_factory=dict)
    baselines: dict = field(default_factory=dict)  # ranking name -> its metrics (or {"unavailable": why})
    adam_aware: dict = field(default_factory=dict)
    movement_summary: dict = field(default_factory=dict)
    caveats: list[str] = field(default_factory=list)
    elapsed_s: float | None = None
    format_version: int = VALIDATION_FORMAT_VERSION

    @property
    def first_step_violation_rate(self) -> float | None:
        return self.first_step.get("violation_rate")

    def to_json(self) -> dict:
        """The JSON: the ranking's metrics at the top level, and ``first_step_violation_rate`` (derived,
        not read back) beside ``first_step``."""
        out: dict = {}
        for f in dataclasses.fields(self):
            if f.name == "metrics":
                out.update(self.metrics)
                continue
            if f.name == "first_step":
                out["first_step_violation_rate"] = self.first_step_violation_rate
            out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_json(cls, data: dict, where: str = "validation.json") -> "ValidationRecord":
        """A record from validation.json's content, of this format or format 1 (renamed on the way in)."""
        if not isinstance(data, dict):
            raise FisherSelectError(f"{where} holds a JSON {type(data).__name__}, not a validation record; "
                                    "delete it or rerun validate with --overwrite")
        version = data.get("format_version", 1)
        if version not in (1, VALIDATION_FORMAT_VERSION):
            raise FisherSelectError(f"{where} has validation format {version}; this release reads formats 1 and "
                                    f"{VALIDATION_FORMAT_VERSION}: rerun validate with --overwrite")
        if version == 1:
            data = _from_format_1(data)
        own = {f.name for f in dataclasses.fields(cls)} - {"metrics"}
        kwargs = {k: v for k, v in data.items() if k in own}
        metrics = {k: v for k, v in data.items() if k not in own and k != "first_step_violation_rate"}
        return cls(**{**kwargs, "format_version": VALIDATION_FORMAT_VERSION}, metrics=metrics)


def _from_format_1(data: dict) -> dict:
    """Format 1's module aggregates under their names of today (the spearman_modules keys, the
    ``chosen`` value, the module table's columns, every baseline's ``spearman_modules`` dict)."""
    data = dict(data)
    sm = dict(data.get("spearman_modules") or {})
    for old, new in _RENAMES_1.items():
        if old in sm:
            sm[new] = sm.pop(old)
    sm["chosen"] = _RENAMES_1.get(sm.get("chosen"), sm.get("chosen"))
    data["spearman_modules"] = sm
    data["module_table"] = [{_RENAMES_1.get(k, k): v for k, v in row.items()} for row in data.get("module_table", [])]
    return data


def load_validations(run_dir) -> list[tuple[str, ValidationRecord]]:
    """(directory name, record) of every validation inside ``run_dir`` (none, or no directory: [])."""
    found = read_json_files(run_dir, VALIDATION_GLOB, "delete it or rerun validate with --overwrite")
    return [(name, ValidationRecord.from_json(data, f"{run_dir}/{name}/validation.json")) for name, data in found]
