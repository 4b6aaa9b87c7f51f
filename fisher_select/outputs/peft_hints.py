"""PEFT configurations from a run: LoRA targets and ranks by Fisher mass, SHiRA masks by bound.

Targets are Linear-like modules (a 2-D ``.weight``; input embeddings and the output head are
excluded), named by their **full** module names. PEFT matches a ``target_modules`` entry as the
full name or a ``.``-suffix of it, so a full name picks exactly one module; ``lora_hints`` checks
that no other module of the run ends with ``.<target>`` so the match is one-to-one.

``rank_pattern`` / ``alpha_pattern`` keys are ``re.escape(full name)``. PEFT (0.21) looks a
module's key up with ``re.match(rf"(.*\\.)?({key})$", module_name)`` (``get_pattern_key``), so an
escaped full name matches exactly the modules the same ``target_modules`` entry matches: the
name itself (or the same name under an extra wrapper prefix), and nothing else.

A LoraConfig object has no field for provenance, so the run id and model fingerprint live in the
hints dict (``fisher_select`` key) and, on disk, in a sidecar: ``save_lora_config`` writes a
directory holding ``adapter_config.json`` (LoraConfig fields only: ``LoraConfig.from_pretrained(dir)``
loads it without the unknown-key warning an extra key would cause) and
``fisher_select_provenance.json`` beside it. Both are checked when a model is given
(``lora_hints(..., model=m)``, ``load_lora_config(dir, m)``). SHiRA configs carry them in their
mask function, which refuses layers of any model other than the one it was built for.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import peft  # the PEFT library (absolute import: this module is fisher_select.outputs.peft_hints)
import torch

from fisher_select.engine import rules
from fisher_select.errors import FisherSelectError
from fisher_select.models import check_fingerprint
from fisher_select.rundir import ModuleEntry, Run, load_run
from fisher_select.atomic import check_dir_target, write_dir
from fisher_select.outputs.hint_settings import LoraHintSettings
from fisher_select.outputs.selection import CAVEAT, top_k_mask

# ``module_types=None``: every module the layer rules call Linear-like (``rules.is_linear_like``:
# nn.Linear and subclasses, bitsandbytes' 4/8-bit layers, Conv1D); a tuple of class names narrows
# that further (SHiRA: ``("Linear",)``).
LINEAR_TYPES = None
# Input embeddings / output heads by name, only for reports that record neither the rules' roles
# (``coverage["embeddings"]``, written by calibrate) nor come with the model.
_EMBEDDING_NAME = re.compile(r"(^|\.)(lm_head|embed_out|wte|wpe|[^.]*embed[^.]*)$")
# PEFT's own layer-index pattern (check_target_module_exists, layers_pattern=None).
_LAYER_INDEX = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")


@dataclass
class _Module:
    name: str
    mass: float  # Fisher mass of the module's parameters (report "fisher_mass")
    shape: tuple[int, int]  # weight shape as stored in the run (out, in) for nn.Linear
    kind: str | None  # class name, when known


# ---------------------------------------------------------------------------
# Choosing target modules


def _eligible(run: Run, *, module_types, model, layers, modules) -> list[_Module]:
    """Linear-like modules of the run, filtered by type, layer index and ``modules``."""
    if model is not None:
        check_fingerprint(run.fingerprint, model, f"run {run.run_id}")
    heads = _head_ids(model)
    found = []
    for entry in run.report.modules:
        weight = run.fisher.get(f"{entry.name}.weight")
        if weight is None or weight.dim() != 2:
            continue
        kind, linear, is_head = _describe(entry, run, model, heads)
        if is_head or not linear or (module_types is not None and kind not in module_types):
            continue
        if layers is not None and _layer_index(entry.name) not in layers:
            continue
        found.append(_Module(entry.name, float(entry.fisher_mass), tuple(weight.shape), kind))
    found = _restrict(found, modules, run)
    if not found:
        raise FisherSelectError(
            f"run {run.run_id} has no eligible Linear-like module (types {list(module_types or ['any'])}, "
            f"layers {layers}); widen --layers / --modules"
        )
    return found


def _head_ids(model) -> set[int]:
    """Identities of the model's input embeddings and output head (never LoRA targets)."""
    return set() if model is None else {id(m) for m in rules.embeddings_and_heads(model)}


def _describe(entry: ModuleEntry, run: Run, model, heads: set[int]) -> tuple[str | None, bool, bool]:
    """(class name or None, Linear-like, input embedding / output head) of one report entry.

    Asked of the layer rules: on the model's own module when the model is given, else as the
    rules recorded them at calibration (``coverage``). Reports recording neither (hand-made or
    migrated ones) fall back to the recorded class name and the module name.
    """
    name = entry.name
    if model is not None:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise FisherSelectError(
                f"run lists module {name}, which the model does not have; load the model of the run"
            ) from None
        return type(module).__name__, rules.is_linear_like(module), id(module) in heads
    recorded = run.report.coverage
    if "linear_like" in recorded and "embeddings" in recorded:
        return entry.type, name in recorded["linear_like"], name in recorded["embeddings"]
    linear = entry.type is None or entry.type in rules.linear_like_names()
    return entry.type, linear, bool(_EMBEDDING_NAME.search(name))


def _layer_index(name: str) -> int | None:
    match = _LAYER_INDEX.match(name)
    return int(match.group("idx")) if match else None


def _restrict(found: list[_Module], modules, run: Run) -> list[_Module]:
    """Keep modules named (full name or ``.``-suffix, as PEFT matches) in ``modules``."""
    if not modules:
        return found
    for wanted in modules:
        if not any(_matches(m.name, wanted) for m in found):
            raise FisherSelectError(
                f"no eligible module of run {run.run_id} is named {wanted!r} "
                "(full name or suffix such as 'q_proj'); check the names in its report"
            )
    return [m for m in found if any(_matches(m.name, w) for w in modules)]


def _matches(name: str, wanted: str) -> bool:
    return name == wanted or name.endswith("." + wanted)


def _choose(found: list[_Module], coverage, top_n) -> tuple[list[_Module], float]:
    """Targets by decreasing mass: the first ``top_n``, or the fewest reaching ``coverage``.

    Coverage is a share of the eligible modules' total mass. Returns (targets, share covered).
    """
    if coverage is not None and top_n is not None:
        raise FisherSelectError("pass either --coverage or --top-n, not both")
    order = sorted(found, key=lambda m: (-m.mass, m.name))
    total = sum(m.mass for m in order)
    if total <= 0:
        raise FisherSelectError("eligible modules carry no Fisher mass; recalibrate the run")
    if top_n is not None:
        if not 1 <= int(top_n) <= len(order) or int(top_n) != top_n:
            raise FisherSelectError(f"--top-n {top_n} must be an integer in [1, {len(order)}]")
        chosen = order[: int(top_n)]
    else:
        coverage = float(coverage)
        if not 0.0 < coverage <= 1.0:
            raise FisherSelectError(f"--coverage {coverage} is outside (0, 1]; pass e.g. 0.9")
        chosen, running = [], 0.0
        for m in order:  # the same summation order as ``total``, so coverage=1 reaches it
            chosen.append(m)
            running += m.mass
            if running >= coverage * total:
                break
    return chosen, sum(m.mass for m in chosen) / total


def _check_unambiguous(targets: list[_Module], run: Run, model) -> None:
    """No other module name may end in ``.<target>`` (PEFT would match it too)."""
    names = {e.name for e in run.report.modules}
    if model is not None:
        names.update(name for name, _ in model.named_modules())
    for t in targets:
        clash = sorted(n for n in names if n.endswith("." + t.name))
        if clash:
            raise FisherSelectError(
                f"target {t.name} is also a suffix of {clash[0]}; PEFT would adapt both, "
                "so fisher_select cannot name it unambiguously"
            )


# ---------------------------------------------------------------------------
# Rank allocation


def _allocate_ranks(targets, total_rank, step, min_rank, max_rank) -> list[int]:
    """Ranks in proportion to mass, clamped to [min_rank, cap], multiples of ``step``.

    Works in units of ``step``: U = total_rank / step rounded to nearest. The continuous
    allocation ``clamp(lam * mass, lo, hi)`` summing to U (lam by bisection) is floored, and the
    units still missing go to the largest remainders. The sum is exactly ``U * step`` unless
    every module is at its cap. A module's cap is ``max_rank`` and never above min(out, in).
    """
    lo = math.ceil(min_rank / step)
    hi = [math.floor(min(min(t.shape), max_rank or math.inf) / step) for t in targets]
    for t, h in zip(targets, hi):
        if h < lo:
            raise FisherSelectError(
                f"module {t.name} {t.shape} cannot take rank {lo * step} (cap {h * step}); "
                "lower --min-rank / --rank-step or raise --max-rank"
            )
    units = math.floor(total_rank / step + 0.5)
    if len(targets) * lo > units:
        raise FisherSelectError(
            f"total rank {total_rank} cannot give {len(targets)} modules rank >= {lo * step} each; "
            f"pass --total-rank >= {len(targets) * lo * step} or target fewer modules"
        )
    if sum(hi) <= units:
        return [h * step for h in hi]
    shares = _water_fill([t.mass for t in targets], lo, hi, units)
    alloc = [math.floor(s) for s in shares]
    # Missing units to the largest fractional parts (then larger mass, then earlier).
    order = sorted(range(len(targets)), key=lambda i: (alloc[i] - shares[i], -targets[i].mass, i))
    missing = units - sum(alloc)
    while missing > 0:  # terminates: sum(hi) > units, so some module always has room
        for i in order:
            if missing > 0 and alloc[i] < hi[i]:
                alloc[i] += 1
                missing -= 1
    return [a * step for a in alloc]


def _water_fill(masses, lo, hi, units) -> list[float]:
    """``clamp(lam * m_i, lo, hi_i)`` with the largest lam whose sum stays <= units."""

    def total(lam):
        return sum(min(max(lam * m, lo), h) for m, h in zip(masses, hi))

    low, high = 0.0, max(h / m for m, h in zip(masses, hi) if m > 0) if any(masses) else 0.0
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if total(mid) <= units else (low, mid)
    return [min(max(low * m, lo), h) for m, h in zip(masses, hi)]


# ---------------------------------------------------------------------------
# LoRA


def pattern_key(name: str) -> str:
    """rank_pattern / alpha_pattern key for one full module name (see module docstring)."""
    return re.escape(name)


def lora_hints(
    run: "Run | str | os.PathLike",
    *,
    coverage: float | None = None,
    top_n: int | None = None,
    total_rank: int | None = None,
    mean_rank: int = LoraHintSettings.mean_rank,
    rank_step: int = LoraHintSettings.rank_step,
    min_rank: int | None = None,
    max_rank: int | None = None,
    alpha_ratio: float = LoraHintSettings.alpha_ratio,
    layers_to_transform: list[int] | None = None,
    modules: list[str] | None = None,
    module_types: tuple[str, ...] | None = LINEAR_TYPES,
    task_type: str | None = "CAUSAL_LM",
    model=None,
) -> dict:
    """LoRA targets (full names) and per-module ranks from a run's Fisher mass.

    Targets: eligible modules by decreasing mass, the first ``top_n`` or the fewest covering
    ``coverage`` of the eligible mass (default 0.9). Ranks: ``total_rank`` (default 8 per target)
    split in proportion to mass, each in [``min_rank`` (default ``rank_step``), ``max_rank``],
    multiples of ``rank_step``, summing to ``total_rank`` rounded to a multiple of the step (less
    only when every module is at its cap). ``lora_alpha = alpha_ratio * r`` per module (alpha/r
    constant). ``layers_to_transform`` and ``modules`` (full names or suffixes) restrict the
    candidates. ``model``, when given, is checked against the run's fingerprint and supplies
    module classes (else the report's ``type`` field, else a 2-D weight and the name decide).
    Returns LoraConfig fields (``task_type`` included) plus a ``fisher_select`` provenance entry.
    """
    run = load_run(run)
    step, min_rank = _check_ranks(rank_step, min_rank, max_rank, alpha_ratio)
    layers = sorted({int(i) for i in layers_to_transform}) if layers_to_transform is not None else None
    found = _eligible(run, module_types=module_types, model=model, layers=layers, modules=modules)
    if coverage is None and top_n is None:
        coverage = LoraHintSettings.coverage
    targets, covered = _choose(found, coverage, top_n)
    _check_unambiguous(targets, run, model)
    requested = mean_rank * len(targets) if total_rank is None else int(total_rank)
    ranks = _allocate_ranks(targets, requested, step, min_rank, max_rank)
    alphas = [_alpha(alpha_ratio, r) for r in ranks]
    # Every target is in rank_pattern; r (the most common rank) only serves PEFT's bookkeeping.
    common = max(Counter(ranks).items(), key=lambda kv: (kv[1], kv[0]))[0]
    selection = {"coverage": coverage, "top_n": top_n, "covered": covered,
                 "layers_to_transform": layers, "modules": modules}
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "target_modules": [t.name for t in targets],
        "r": common,
        "lora_alpha": _alpha(alpha_ratio, common),
        "rank_pattern": {pattern_key(t.name): r for t, r in zip(targets, ranks)},
        "alpha_pattern": {pattern_key(t.name): a for t, a in zip(targets, alphas)},
        "layers_to_transform": layers,
        "fan_in_fan_out": any(t.kind == "Conv1D" for t in targets),  # GPT-2 style weights
        "fisher_select": {
            **run.provenance(CAVEAT),
            "selection": selection,
            "total_rank": sum(ranks),
            "requested_total_rank": requested,
            "rank_step": step,
            "alpha_ratio": alpha_ratio,
            "targets": _target_rows(targets, ranks, alphas, sum(m.mass for m in found)),
        },
    }


def _target_rows(targets, ranks, alphas, eligible_mass: float) -> list[dict]:
    return [
        {"name": t.name, "fisher_mass": t.mass, "share": t.mass / eligible_mass, "rank": r, "alpha": a}
        for t, r, a in zip(targets, ranks, alphas)
    ]


def _check_ranks(rank_step, min_rank, max_rank, alpha_ratio) -> tuple[int, int]:
    if int(rank_step) != rank_step or rank_step < 1:
        raise FisherSelectError(f"--rank-step {rank_step} must be a positive integer")
    min_rank = int(rank_step) if min_rank is None else min_rank
    if min_rank < 1 or (max_rank is not None and max_rank < min_rank):
        raise FisherSelectError(
            f"rank bounds min {min_rank} / max {max_rank} are invalid; need 1 <= min <= max"
        )
    if not alpha_ratio > 0:
        raise FisherSelectError(f"--alpha-ratio {alpha_ratio} must be positive")
    return int(rank_step), int(min_rank)


def _alpha(ratio: float, r: int):
    alpha = ratio * r
    return int(alpha) if float(alpha).is_integer() else alpha


def _lora_fields(hints: dict) -> dict:
    return {k: hints[k] for k in ("task_type", "target_modules", "r", "lora_alpha", "rank_pattern",
                                  "alpha_pattern", "layers_to_transform", "fan_in_fan_out")}


def lora_config(run: "Run | str | os.PathLike", **hint_kwargs) -> "peft.LoraConfig":
    """``peft.LoraConfig`` built from ``lora_hints(run, **hint_kwargs)``."""
    return lora_config_from_hints(lora_hints(run, **hint_kwargs))


def lora_config_from_hints(hints: dict) -> "peft.LoraConfig":
    """``peft.LoraConfig`` holding the LoraConfig fields of a ``lora_hints`` dict."""
    return peft.LoraConfig(**_lora_fields(hints))


# The files of a LoRA hint directory: PEFT's own config name, and the provenance sidecar beside it.
ADAPTER_CONFIG = peft.utils.CONFIG_NAME  # "adapter_config.json"
PROVENANCE_FILE = "fisher_select_provenance.json"
PROVENANCE_FORMAT = "fisher_select.lora_provenance/1"


def lora_config_dict(hints: dict) -> dict:
    """The ``adapter_config.json`` dict of a hint: PEFT's LoraConfig fields, nothing else."""
    fields = lora_config_from_hints(hints).to_dict()
    for key, value in fields.items():
        if isinstance(value, (set, frozenset)):
            fields[key] = sorted(value)
    fields["peft_type"] = peft.PeftType.LORA.value
    fields["target_modules"] = list(hints["target_modules"])  # keep mass order
    return fields


def provenance_dict(hints: dict) -> dict:
    """The sidecar of a hint: run id, model fingerprint, selection, ranks (``hints["fisher_select"]``)."""
    return {"format": PROVENANCE_FORMAT, "adapter_config": ADAPTER_CONFIG, **hints["fisher_select"]}


def check_lora_out(out: "str | os.PathLike", overwrite: bool) -> None:
    """Refuse, before any work, an ``--out`` that is a .json file name or an existing directory."""
    out = Path(out)
    if out.suffix == ".json":
        raise FisherSelectError(
            f"--out {out} names a .json file, but a LoRA hint is a directory ({ADAPTER_CONFIG} + "
            f"{PROVENANCE_FILE}, what LoraConfig.from_pretrained reads); pass a directory such as {out.with_suffix('')}"
        )
    check_dir_target(out, overwrite)


def save_lora_config(hints: dict, out: "str | os.PathLike", *, overwrite: bool = False) -> Path:
    """Write directory ``out``: ``adapter_config.json`` + ``fisher_select_provenance.json``, atomically.

    ``peft.LoraConfig.from_pretrained(out)`` reads it as any adapter directory (no weights inside:
    PEFT initialises the adapters); ``load_lora_config(out, model)`` also checks the model.
    """
    out = Path(out)
    check_lora_out(out, overwrite)
    config = json.dumps(lora_config_dict(hints), indent=2) + "\n"
    provenance = json.dumps(provenance_dict(hints), indent=2) + "\n"

    def write(tmp: Path) -> None:
        (tmp / ADAPTER_CONFIG).write_text(config)
        (tmp / PROVENANCE_FILE).write_text(provenance)

    return write_dir(out, write, overwrite=overwrite)


def load_lora_config(path: "str | os.PathLike", model) -> "peft.LoraConfig":
    """Read a directory written by ``save_lora_config`` (or its adapter_config.json) for ``model``.

    Refuses any model other than the calibrated one, and a sidecar that names other targets than
    the config beside it. A single JSON file with an embedded ``fisher_select`` entry (release
    0.1.0's ``lora --out FILE``) is still read.
    """
    path = Path(path)
    config_file = path / ADAPTER_CONFIG if path.is_dir() else path
    if not config_file.is_file():
        raise FisherSelectError(
            f"LoRA config {config_file} does not exist; pass the --out directory of `fisher-select lora` / `export --format peft`"
        )
    fields = json.loads(config_file.read_text())
    meta = fields.pop("fisher_select", None)  # 0.1.0's single file
    sidecar = config_file.with_name(PROVENANCE_FILE)
    if meta is None and sidecar.is_file():
        meta = json.loads(sidecar.read_text())
    if not isinstance(meta, dict) or "model" not in meta:
        raise FisherSelectError(
            f"{config_file} has no {PROVENANCE_FILE} beside it; it was not written by fisher-select "
            "(use peft.LoraConfig.from_pretrained for a foreign adapter config)"
        )
    targets = [t["name"] for t in meta.get("targets", [])]
    if targets and sorted(targets) != sorted(fields.get("target_modules") or []):
        raise FisherSelectError(
            f"{sidecar} lists other targets than {config_file}; the config was edited or the files mixed up: "
            "write the hint again with `fisher-select lora ... --overwrite`"
        )
    check_fingerprint(meta["model"].get("fingerprint"), model, f"LoRA config {config_file}")
    return peft.LoraConfig.from_peft_type(**fields)


# ---------------------------------------------------------------------------
# SHiRA


class FisherShiraMask:
    """SHiRA ``mask_fn``: each targeted layer's top ``r * (m + n)`` coordinates by bound (i.e. by F).

    PEFT 0.21 calls ``mask_fn(base_layer, r, **kwargs)`` with the layer module, not its name.
    The masks are computed by full name up front; the module -> name map is keyed by the
    identity of the model's own ``nn.Linear`` objects (PEFT hands over that very object as
    ``base_layer``), held through weak references so the config never keeps the model alive.
    A layer of any other model object (a reloaded or deep-copied model included) is refused.
    """

    def __init__(self, masks: dict[str, torch.Tensor], names: dict, r: int, provenance: dict):
        self.masks = masks  # full name -> bool (out, in), exactly r * (out + in) True
        self.r = r
        self.provenance = provenance  # run id, model fingerprint, caveat
        self._names = weakref.WeakKeyDictionary(names)  # nn.Module -> full name

    def __call__(self, base_layer, r: int, **kwargs) -> torch.Tensor:
        name = self._names.get(base_layer)
        if name is None:
            raise FisherSelectError(
                "SHiRA asked for the mask of a layer that is not a target of the model given to "
                "shira_config (another model object?); build the config with shira_config(run, this_model)"
            )
        if r != self.r:
            raise FisherSelectError(
                f"ShiraConfig.r is {r} but its Fisher masks were built for r={self.r}; "
                f"rebuild it with shira_config(run, model, r={r})"
            )
        weight = base_layer.weight
        return self.masks[name].to(device=weight.device, dtype=weight.dtype)

    def __deepcopy__(self, memo):
        # Immutable reference data; a deep copy would copy the modules and break the identity map.
        return self


def shira_config(
    run: "Run | str | os.PathLike",
    model,
    *,
    r: int = 32,
    coverage: float | None = None,
    top_n: int | None = None,
    layers_to_transform: list[int] | None = None,
    modules: list[str] | None = None,
    task_type: str | None = "CAUSAL_LM",
) -> "peft.ShiraConfig":
    """``peft.ShiraConfig`` whose masks keep each target's top ``r * (m + n)`` coordinates.

    Targets (``nn.Linear`` only, as SHiRA supports) are chosen as in ``lora_hints``. ``model``
    must be the model the run was computed on (fingerprint-checked) and the very object later
    passed to ``peft.get_peft_model``. Coordinates rank by F (the bound's order for any objective);
    ties go to the lower flat index. The mask function
    (``config.mask_fn``, a ``FisherShiraMask``) records the run id and fingerprint.
    """
    run = load_run(run)
    layers = sorted({int(i) for i in layers_to_transform}) if layers_to_transform is not None else None
    found = _eligible(run, module_types=("Linear",), model=model, layers=layers, modules=modules)
    if coverage is None and top_n is None:
        coverage = LoraHintSettings.coverage
    targets, _ = _choose(found, coverage, top_n)
    _check_unambiguous(targets, run, model)
    masks = {t.name: _shira_mask(t, run.fisher[f"{t.name}.weight"], r) for t in targets}
    names = {model.get_submodule(t.name): t.name for t in targets}
    with warnings.catch_warnings():
        # PEFT warns that it has no built-in mask for any mask_type but "random"; we supply one.
        warnings.filterwarnings("ignore", message=r".*mask_type.*not recognized")
        config = peft.ShiraConfig(r=r, mask_type="fisher", target_modules=[t.name for t in targets],
                                  task_type=task_type)
    config.mask_fn = FisherShiraMask(masks, names, r, run.provenance(CAVEAT))
    return config


def _shira_mask(target: _Module, fisher: torch.Tensor, r: int) -> torch.Tensor:
    out_features, in_features = target.shape
    count = r * (out_features + in_features)
    if int(r) != r or r < 1 or count > out_features * in_features:
        raise FisherSelectError(
            f"SHiRA r={r} needs {count} coordinates of {target.name} {target.shape}, "
            "more than it has; lower r"
        )
    return top_k_mask(fisher, count)  # (out, in) bool
