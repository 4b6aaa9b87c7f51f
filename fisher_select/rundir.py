"""The run directory: one typed, versioned schema, written and read here and nowhere else.

A run directory (docs/RUN_FORMAT.md) holds
- ``fisher.safetensors``: diagonal Fisher F per parameter (fp32, the parameter's shape; for a
  bitsandbytes-quantized Linear, the shape of the dequantized weight);
- ``fisher_token.safetensors``: the token-level Fisher, when a token-level objective ran;
- ``bounds.safetensors``: ``sqrt(F * S)`` of the primary objective (only when S is known and finite);
- ``grad_estimate.safetensors``: Monte Carlo estimate of the primary objective's expected
  gradient (``grad_estimate-<objective>.safetensors`` for further objectives);
- ``samples.jsonl``, ``report.json`` (a ``RunReport``) and ``report.html``.

The directory is written atomically (``fisher_select.atomic.write_dir``): complete or absent.
``Calibration`` (in memory, from ``calibrate``) and ``Run`` (loaded) answer the same questions
through ``BoundsView``: which Fisher an objective uses, its scale, its bound.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fisher_select.atomic import write_file
from fisher_select.errors import FisherSelectError

FORMAT_VERSION = 3  # 1: fisher_select 0.1.0 (no format_version key); 2: module masses named "mass"

# ---------------------------------------------------------------------------
# Every file name fisher_select writes, in one place

# A run directory (`fisher-select calibrate --out RUN`)
FISHER_FILE = "fisher.safetensors"
BOUNDS_FILE = "bounds.safetensors"
GRAD_FILE = "grad_estimate.safetensors"  # the primary objective's
GRAD_FILE_OF = "grad_estimate-{objective}.safetensors"  # every further objective's
GRAD_GLOB = "grad_estimate*.safetensors"
TOKEN_FISHER_FILE = "fisher_token.safetensors"
SAMPLES_FILE = "samples.jsonl"
REPORT_FILE = "report.json"
HTML_FILE = "report.html"
MARKDOWN_FILE = "report.md"
# `fisher-select validate` inside a run directory: RUN/validation-<optimizer>-seed<seed>/
VALIDATION_DIR = "validation-{optimizer}-seed{seed}"
VALIDATION_GLOB = "validation-*/validation.json"
VALIDATION_FILE = "validation.json"
VALIDATION_PLOTS = {"bound": "bound_vs_movement.png", "curves": "precision_at_k.png",
                    "objective": "objective_per_step.png"}
# The matched-budget outcome study (``studies.outcomes``) inside a run directory: RUN/outcomes-<kind>/
OUTCOMES_DIR = "outcomes-{kind}"
OUTCOMES_GLOB = "outcomes-*/outcomes.json"
OUTCOMES_FILE = "outcomes.json"
OUTCOMES_PLOT = "recovery_vs_density.png"
# A calibration checkpoint beside the run: RUN.checkpoint/rank-000-of-001/batch-000004/
CHECKPOINT_SUFFIX = ".checkpoint"
CHECKPOINT_RANK_DIR = "rank-{rank:03d}-of-{world:03d}"
CHECKPOINT_BATCH_DIR = "batch-{batches:06d}"
CHECKPOINT_BATCH_PATTERN = r"^batch-(\d{6})$"
CHECKPOINT_MANIFEST, CHECKPOINT_TENSORS, CHECKPOINT_SAMPLES = "manifest.json", "tensors.safetensors", "samples.jsonl"
# A mask file FILE (safetensors of booleans) and its sidecar FILE.json
MASK_FORMAT = "fisher_select.masks/1"
MASK_SIDECAR_SUFFIX = ".json"
# A LoRA hint directory: PEFT's own config file name, and the provenance beside it
LORA_CONFIG_FILE = "adapter_config.json"  # peft.utils.CONFIG_NAME (checked in the tests)
LORA_PROVENANCE_FILE = "fisher_select_provenance.json"
LORA_PROVENANCE_FORMAT = "fisher_select.lora_provenance/1"
# A sparse delta directory (``training.sparse``): indices + values, provenance
SPARSE_DELTA_FILE = "sparse_delta.safetensors"
SPARSE_META_FILE = "sparse_delta.json"
SPARSE_FORMAT = "fisher_select.sparse_delta/1"
# The embedded default converted from its GGUF, in the model cache
MODEL_SOURCE_FILE = "fisher_select_source.json"


def sidecar_path(path: "str | os.PathLike") -> Path:
    """``<path>.json``: the human-readable copy of a mask file's metadata."""
    path = Path(path)
    return path.with_name(path.name + MASK_SIDECAR_SUFFIX)


def checkpoint_folder(out: "str | os.PathLike") -> Path:
    """``OUT.checkpoint`` beside the run directory ``OUT``."""
    out = Path(out)
    return out.with_name(out.name + CHECKPOINT_SUFFIX)


def validation_dir(run_path: "str | os.PathLike", optimizer: str, seed: int) -> Path:
    """Where `fisher-select validate` writes by default: inside the run directory."""
    return Path(run_path) / VALIDATION_DIR.format(optimizer=optimizer, seed=seed)


def read_json_files(run_dir, pattern: str, remedy: str) -> list[tuple[str, dict]]:
    """(folder name, parsed JSON) of every file matching ``pattern`` in ``run_dir`` (None: []);
    an unreadable one is named, with ``remedy`` (what to do)."""
    if run_dir is None:
        return []
    out = []
    for path in sorted(Path(run_dir).glob(pattern)):
        try:
            out.append((path.parent.name, json.loads(path.read_text())))
        except (OSError, ValueError) as err:
            raise FisherSelectError(f"{path} is unreadable ({err}); {remedy}") from None
    return out


def outcomes_dir(run_path: "str | os.PathLike", kind: str) -> Path:
    """Where the outcome study of one training kind is kept: inside the run directory."""
    return Path(run_path) / OUTCOMES_DIR.format(kind=kind)


# ---------------------------------------------------------------------------
# Bounds shared by in-memory calibrations and loaded runs


def coordinate_bound(fisher: dict[str, torch.Tensor], scale: float | None) -> dict[str, torch.Tensor]:
    """``sqrt(F_i * S)`` per coordinate; ``sqrt(F_i)`` when S is unknown (None)."""
    root = math.sqrt(scale) if scale is not None else 1.0  # inf when S is infinite: no bound
    # F_i = 0 means h_i = 0 on every response, so g_i = 0 whatever S is (avoid 0 * inf).
    return {name: torch.where(f > 0, f.sqrt() * root, 0.0) for name, f in fisher.items()}


class BoundsView:
    """Objective lookup, Fisher choice and bounds over ``self.fisher``, ``self.token_fisher`` and
    ``self.objectives`` (entries with ``name``, ``signal_scale`` and ``token_level``)."""

    fisher: dict[str, torch.Tensor]
    token_fisher: dict[str, torch.Tensor] | None
    objectives: list

    def describe_source(self) -> str:
        return "this calibration"

    def objective(self, name: str | None = None):
        """The entry of objective ``name`` (default: the primary, first, one)."""
        for entry in self.objectives:
            if name is None or entry.name == name:
                return entry
        names = ", ".join(e.name for e in self.objectives)
        raise FisherSelectError(f"{self.describe_source()} has no objective {name!r}; it has: {names}")

    @property
    def signal_scale(self) -> float | None:
        """S of the primary objective; None when unknown (e.g. SFT without a density)."""
        return self.objective(None).signal_scale

    def signal_scale_of(self, objective: str | None) -> float | None:
        return self.objective(objective).signal_scale

    def fisher_for(self, objective: str | None = None) -> dict[str, torch.Tensor]:
        """The Fisher an objective's bound uses: F^tok for token-level objectives, else F."""
        token = self.objective(objective).token_level and self.token_fisher is not None
        return self.token_fisher if token else self.fisher

    def bound(self, objective: str | None = None) -> dict[str, torch.Tensor]:
        """``sqrt(F_i * S)`` per coordinate for one objective (default: the primary one).

        When S is unknown the bound is only known up to the common factor ``sqrt(S)``; this
        returns ``sqrt(F)`` then (same ranking): check ``signal_scale`` before using absolute
        thresholds.
        """
        return coordinate_bound(self.fisher_for(objective), self.signal_scale_of(objective))

    def mixed_bound(self, weights: dict[str, float]) -> dict[str, torch.Tensor]:
        """``sum_o |c_o| sqrt(F^(o)_i S_o)`` for a weighted mix of objectives on the same samples.

        For sequence-level objectives F^(o) = F and this is ``sqrt(F_i) sum_o |c_o| sqrt(S_o)``
        (MATH.md); a token-level objective brings its own factor sqrt(F^tok_i S_tok).
        """
        out: dict[str, torch.Tensor] = {}
        for name, c in weights.items():
            if self.signal_scale_of(name) is None:
                raise FisherSelectError(f"objective {name!r} has an unknown signal scale; it cannot enter a mixed bound")
            for n, b in self.bound(name).items():
                out[n] = out[n] + abs(c) * b if n in out else abs(c) * b
        return out


# ---------------------------------------------------------------------------
# The schema of report.json


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
    sqrt_fisher_mean: float = 0.0  # bound_mass / numel
    bound_mean: float | None = None  # sqrt_fisher_mean * sqrt(S) (None: S unknown)
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


# ---------------------------------------------------------------------------
# Loaded runs


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


# Format 2 -> 3: the module masses got one name each (fisher_mass / bound_mass, never "mass").
_MODULE_RENAMES_2 = {"mass_share": "fisher_share", "sqrt_fisher_mass": "bound_mass", "sqrt_mass_share": "bound_share"}
_STATISTICS_RENAMES_2 = {"stability": {"spearman_sqrt_mass": "spearman_bound_mass", "spearman_mass": "spearman_fisher_mass",
                                       "module_sqrt_mass": "module_bound_mass"},
                         "concentration": {"mass_shares": "fisher_mass_shares"}}


def _rename(entry, renames: dict) -> None:
    for old, new in renames.items():
        if isinstance(entry, dict) and old in entry:
            entry[new] = entry.pop(old)


def migrate(path: "str | os.PathLike") -> Path:
    """Upgrade a run directory of an older format in place (only report.json changes; tensors never do).

    Format 1 (fisher_select 0.1.0) lacked the version key; format 2 named the module masses
    ``mass_share`` / ``sqrt_fisher_mass`` / ``sqrt_mass_share``, now ``fisher_share`` / ``bound_mass`` /
    ``bound_share``.
    """
    report_path = Path(path) / REPORT_FILE
    if not report_path.is_file():
        raise FisherSelectError(f"{path} is not a fisher_select run directory (no {REPORT_FILE})")
    data = read_json(report_path)
    version = data.get("format_version", 1)
    if version == FORMAT_VERSION:
        return report_path
    if version not in (1, 2):
        raise FisherSelectError(f"{report_path} has run format {version}, which this release cannot migrate")
    for module in data.get("modules", []):
        _rename(module, _MODULE_RENAMES_2)
    for section, renames in _STATISTICS_RENAMES_2.items():
        _rename((data.get("statistics") or {}).get(section), renames)
    data["format_version"] = FORMAT_VERSION
    RunReport.from_json(data, str(report_path))  # refuse what would not load afterwards
    write_file(report_path, lambda tmp: write_json(tmp, data), overwrite=True)
    return report_path


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


# ---------------------------------------------------------------------------
# Writing


def write_run_tensors(folder: Path, cal, report: RunReport) -> None:
    """A run's tensor files and samples.jsonl into ``folder`` (``cal``: a Calibration): all of a run
    but its report; report.json, the pages and the atomic directory are ``run_report.write_run``'s."""
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


def grad_file_for(index: int, name: str) -> str:
    """The gradient-estimate file of the index-th objective."""
    return GRAD_FILE if index == 0 else GRAD_FILE_OF.format(objective=name)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """safetensors with contiguous CPU tensors and string metadata."""
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    try:
        save_file(flat, str(path), metadata={k: str(v) for k, v in (metadata or {}).items()})
    except SafetensorError as err:  # safetensors reports I/O failures (disk full, ...) as its own type
        raise OSError(f"could not write {path}: {err}") from err


def write_json(path: Path, obj) -> None:
    """JSON as every fisher_select file holds it: indented, paths and tensors as text and lists."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj):
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


# ---------------------------------------------------------------------------
# Reading: a damaged file is the user's input, not a bug (exit 2, the path, what to do)

REWRITE_ADVICE = ("re-run the command that wrote it (`fisher-select calibrate ... --overwrite`), or "
                  "`fisher-select migrate RUN` for a run of an older release")


def read_json(path: Path):
    """The JSON in ``path``; a truncated, empty or foreign file is a ``FisherSelectError`` naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise FisherSelectError(f"{path} is not text (binary content where JSON was expected); {REWRITE_ADVICE}") from None
    if not text.strip():
        raise FisherSelectError(f"{path} is empty; {REWRITE_ADVICE}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise FisherSelectError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}: "
                                f"truncated or edited); {REWRITE_ADVICE}") from None


def read_samples(path: Path) -> list[dict]:
    """The records of a JSONL file (samples.jsonl); a damaged line is a ``FisherSelectError`` naming it."""
    out = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise FisherSelectError(f"{path} is not text (binary content where JSON lines were expected); "
                                f"{REWRITE_ADVICE}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise FisherSelectError(f"{path}, line {number}: not valid JSON ({err.msg} at column {err.colno}: "
                                    f"truncated or edited); {REWRITE_ADVICE}") from None
        if not isinstance(record, dict):
            raise FisherSelectError(f"{path}, line {number}: a JSON {type(record).__name__}, not a sample record; "
                                    f"{REWRITE_ADVICE}")
        out.append(record)
    return out


def read_run_samples(path: Path, expected: int) -> list[dict]:
    """A run's samples.jsonl, which must hold the ``expected`` samples its report counts: an emptied file, or
    one cut at a line end, parses but is not the run's."""
    samples = read_samples(path)
    if len(samples) != expected:
        raise FisherSelectError(f"{path} holds {len(samples)} sample record(s) but {REPORT_FILE} counts {expected} "
                                f"(emptied or truncated); {REWRITE_ADVICE}")
    return samples


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a truncated, empty or foreign file is a ``FisherSelectError``."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise FisherSelectError(f"{path} is {'empty' if size == 0 else 'truncated'} ({size} bytes; a safetensors "
                                f"file starts with an 8-byte header length); {REWRITE_ADVICE}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        what = _safetensors_problem(str(err), path, size)
        raise FisherSelectError(f"{path} is not a readable safetensors file ({what}); {REWRITE_ADVICE}") from None


def _safetensors_problem(message: str, path: Path, size: int) -> str:
    """Which part of the file is damaged: the header's length, the header, or the tensor data after it."""
    raw = path.read_bytes()
    header = int.from_bytes(raw[:8], "little")
    if header > size - 8:
        return f"truncated safetensors header: it announces {header} bytes, the file has {size - 8} after the length"
    try:
        entries = json.loads(raw[8 : 8 + header])
        end = max((e["data_offsets"][1] for k, e in entries.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):  # not the JSON of a safetensors header
        return f"corrupt safetensors header: {message}"
    if 8 + header + end > size:
        return f"truncated tensor data: the header describes {end} bytes of tensors, the file holds {size - 8 - header}"
    return f"corrupt tensor data: {message}"
