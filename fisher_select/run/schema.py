"""report.json's typed, versioned records: ``RunReport`` and the entries it holds.

``RunReport.from_json`` refuses another format with what to do (``fisher-select migrate``, in
``run.migrate``); the report's content (tables, statistics, warnings) is built by ``report.build``.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fisher_select.errors import FisherSelectError
from fisher_select.run.io import REWRITE_ADVICE
from fisher_select.run.names import GRAD_FILE

# 1: fisher_select 0.1.0 (no format_version key); 2: module masses named "mass"; 3: bound_mass / fisher_mass;
# 4: ModuleEntry.sqrt_fisher_mean named bound_mass_per_coordinate
FORMAT_VERSION = 4


def _scale_to_json(x: float | None):
    """JSON has no inf/nan: an infinite S is written as the string "inf"."""
    if x is None or math.isfinite(x):
        return x
    return str(x)


def _scale_from_json(x) -> float | None:
    return None if x is None else float(x)


@dataclass
class ModelInfo:
    """The calibrated model: where it came from and the fingerprint outputs are checked against."""

    name: str  # the --model spec
    fingerprint: dict
    path: str | None  # the resolved model directory
    dtype: str | None
    quantization: str | None
    architecture: str | None  # the model class


@dataclass
class ObjectiveEntry:
    """One objective's scale and report fields; ``details`` holds the objective's own summary."""

    name: str
    type: str
    signal_scale: float | None  # None: unknown; inf: no bound
    token_level: bool = False
    grad_file: str = GRAD_FILE
    signal: str = ""  # the signal's formula
    warnings: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**self.details, "name": self.name, "type": self.type, "signal": self.signal,
                "signal_scale": _scale_to_json(self.signal_scale), "token_level": self.token_level,
                "grad_file": self.grad_file, "warnings": self.warnings}

    @classmethod
    def from_json(cls, data: dict) -> "ObjectiveEntry":
        own = {f.name for f in dataclasses.fields(cls)} - {"details"}
        kwargs = {k: v for k, v in data.items() if k in own}
        kwargs["signal_scale"] = _scale_from_json(data.get("signal_scale"))
        return cls(**kwargs, details={k: v for k, v in data.items() if k not in own})

    @classmethod
    def from_summary(cls, name: str, summary: dict, signal_scale: float | None, grad_file: str) -> "ObjectiveEntry":
        """From an objective's summary dict (calibration side)."""
        entry = cls.from_json({**summary, "name": name, "grad_file": grad_file})
        entry.signal_scale = signal_scale
        return entry


@dataclass
class ModuleEntry:
    """Per-module aggregates of F. Two masses, never confused: the **Fisher mass** (sum of F, dominated
    by a few huge coordinates) and the **bound mass** (sum of sqrt(F): the sum of the module's bounds
    up to the objective's constant sqrt(S)). Modules rank by bound mass: it tracks how much training
    moves a module, the Fisher mass does not (docs/VALIDATION.md)."""

    name: str
    numel: int
    fisher_mass: float  # sum of F over the module
    parameters: list[str]
    type: str | None = None  # module class name
    fisher_share: float = 0.0  # fisher_mass / the model's total
    bound_mass: float = 0.0  # sum of sqrt(F) over the module
    bound_share: float = 0.0  # bound_mass / the model's total
    bound_mass_per_coordinate: float = 0.0  # bound_mass / numel: the mean of sqrt(F)
    bound_mean: float | None = None  # bound_mass_per_coordinate * sqrt(S) (None: S unknown)
    bound_max: float | None = None
    fisher_mass_rel_stderr: float | None = None  # of fisher_mass, from the per-batch spread (None: not measured)


@dataclass
class RunReport:
    """report.json. Keys are these fields; ``to_json`` adds the primary objective's shortcuts."""

    run_id: str
    model: ModelInfo
    objectives: list[ObjectiveEntry]
    modules: list[ModuleEntry]
    caveats: list[str] = field(default_factory=list)
    created: str = ""
    fisher_select_version: str = ""
    format_version: int = FORMAT_VERSION
    environment: dict = field(default_factory=dict)  # python, platform, library versions, device
    command_line: list[str] | None = None  # argv of `fisher-select calibrate` (None from the Python API)
    recipe: str | None = None  # recipe name
    config: dict | None = None  # the resolved recipe
    num_prompts: int = 0
    num_samples: int = 0
    num_truncated: int = 0
    samples_per_prompt: int | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    sampling: dict = field(default_factory=dict)
    coverage: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # degenerate or unreliable results, with numbers
    mixed_bound: dict | None = None
    statistics: dict = field(default_factory=dict)  # the report's sections (docs/REPORT.md), JSON as written
    timings: dict = field(default_factory=dict)  # wall seconds per phase of `calibrate` (fisher_select.timing)
    # MoE models: per layer, tokens routed to each expert and its bound mass (report.experts.ExpertSection's
    # JSON); None for a model without fused experts
    experts: dict | None = None

    @property
    def truncation_rate(self) -> float:
        return self.num_truncated / max(1, self.num_samples)

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["model"] = dataclasses.asdict(self.model)
        data["objectives"] = [o.to_json() for o in self.objectives]
        data["modules"] = [dataclasses.asdict(m) for m in self.modules]
        primary = self.objectives[0]  # shortcuts for readers of the JSON; derived, not read back
        data.update(objective=primary.name, signal=primary.signal, signal_scale=_scale_to_json(primary.signal_scale),
                    truncation_rate=self.truncation_rate)
        return data

    @classmethod
    def from_json(cls, data: dict, where: str) -> "RunReport":
        if not isinstance(data, dict):
            raise FisherSelectError(f"{where} holds a JSON {type(data).__name__}, not a run report; {REWRITE_ADVICE}")
        version = data.get("format_version", 1)
        if version != FORMAT_VERSION:
            made = data.get("fisher_select_version", "an older release")
            raise FisherSelectError(
                f"{where} was made by fisher_select {made} (run format {version}); this is format {FORMAT_VERSION}: "
                f"re-run `fisher-select calibrate`, or upgrade it in place with `fisher-select migrate {Path(where).parent}`")
        try:
            own = {f.name for f in dataclasses.fields(cls)}
            kwargs = {k: v for k, v in data.items() if k in own}
            kwargs["model"] = ModelInfo(**data["model"])
            kwargs["objectives"] = [ObjectiveEntry.from_json(o) for o in data["objectives"]]
            kwargs["modules"] = [ModuleEntry(**m) for m in data["modules"]]
            return cls(**kwargs)
        except (KeyError, TypeError, AttributeError) as err:  # a key missing, or of the wrong kind
            raise FisherSelectError(f"{where} is not a fisher_select run report ({type(err).__name__}: {err}); "
                                    f"{REWRITE_ADVICE}") from None


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
