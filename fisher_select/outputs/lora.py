"""LoRA from a run: target modules and per-module ranks, as PEFT's own ``LoraConfig`` fields.

``lora_hints(run, ...)`` chooses targets (``outputs.targets``: Linear-like modules by decreasing
module mass, the first ``top_n`` or the fewest covering ``coverage`` of the eligible mass) and
splits a rank budget in proportion to the same mass. The mass is the bound mass (sum of sqrt(F))
by default, the Fisher mass with ``ranking="fisher_mass"``; both are recorded per target.

The result is a typed ``LoraHints``: PEFT's fields (``target_modules``, ``r``, ``lora_alpha``,
``rank_pattern``, ``alpha_pattern``, ``layers_to_transform``, ``fan_in_fan_out``, ``task_type``) and
the provenance PEFT has no field for (run id, model fingerprint, selection, per-target masses).
``save_pretrained(dir)`` writes ``adapter_config.json`` (PEFT's fields only, so
``LoraConfig.from_pretrained(dir)`` loads it without an unknown-key warning) and
``fisher_select_provenance.json`` beside it; ``LoraHints.from_pretrained(dir, model)`` reads both
and checks the model.

**MoE experts.** A fused 3-D expert weight (``model.layers.0.mlp.experts.gate_up_proj``) has no Linear
module; PEFT adapts it through ``target_parameters`` (its ``lora.ParamWrapper``): one rank-r adapter
per expert, the same r for every expert of the tensor. Such targets are listed there by full
parameter name, ranked with the modules by the tensor's mass, and their rank is allocated by the
mass per expert (``targets.Target.rank_mass``). PEFT's limits for them (``EXPERT_LIMITS``) are written
into the provenance (``peft_limits``) and printed by ``fisher-select lora``.

``rank_pattern`` / ``alpha_pattern`` keys are ``re.escape(full name)``. PEFT (0.21) looks a
module's key up with ``re.match(rf"(.*\\.)?({key})$", module_name)`` (``get_pattern_key``), so an
escaped full name matches exactly the modules the same ``target_modules`` entry matches; for a
``target_parameters`` entry PEFT looks up the full parameter name, which the same key matches.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import peft  # the PEFT library

from fisher_select.atomic import check_dir_target, write_dir
from fisher_select.caveats import MASK_CAVEAT as CAVEAT
from fisher_select.errors import FisherSelectError
from fisher_select.models import check_fingerprint
from fisher_select.outputs import targets as tg
from fisher_select.outputs.config import DEFAULT_COVERAGE, LoraHintConfig
from fisher_select.run.io import read_json
from fisher_select.run.load import Run, load_run
from fisher_select.run.names import LORA_CONFIG_FILE, LORA_PROVENANCE_FILE, LORA_PROVENANCE_FORMAT
from fisher_select.stats.experts import fused_experts
from fisher_select.stats.naming import module_of


# PEFT's LoraConfig fields a hint sets (everything else keeps PEFT's default).
PEFT_FIELDS = ("task_type", "target_modules", "r", "lora_alpha", "rank_pattern", "alpha_pattern",
               "layers_to_transform", "fan_in_fan_out", "target_parameters")
# What PEFT 0.21 (lora.ParamWrapper, tuners_utils._inject_parameters) allows for target_parameters; read from its source.
EXPERT_LIMITS = (
    "PEFT adapts a fused expert tensor (target_parameters) with one rank for every expert of the tensor: "
    "the rank written here is per expert, and no per-expert rank or alpha is possible",
    "lora_dropout must stay 0, and fan_in_fan_out, lora_bias, use_dora and other LoRA variants are refused "
    "for these targets (PEFT raises ValueError)",
    "all adapters of one model that use target_parameters must target the same parameters; mixed adapter "
    "batches (adapter_names=...) are not supported",
    "the adapter is applied through a parametrization while the experts module runs: reading the parameter "
    "directly (module.gate_up_proj) gives the base weight; merge_and_unload() merges it into the base weight",
    "under torch.compile, expect recompilations or graph breaks",
    "get_peft_model warns that the rank_pattern / alpha_pattern keys of these targets 'did not match any targeted "
    "module and were ignored': PEFT 0.21 checks that warning against modules only; the ranks are applied "
    "(PEFT looks each key up by the full parameter name)",
)


@dataclass
class LoraHints:
    """A LoRA configuration chosen from a run: PEFT's fields plus where they came from."""

    target_modules: list[str]  # full module names, by decreasing ranking mass
    r: int  # the most common rank (PEFT's bookkeeping; every target is in rank_pattern)
    lora_alpha: float
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    layers_to_transform: list[int] | None = None
    fan_in_fan_out: bool = False  # GPT-2 style Conv1D weights
    task_type: str | None = "CAUSAL_LM"
    provenance: dict = field(default_factory=dict)  # run id, model, caveats, selection, ranks, per-target rows
    target_parameters: list[str] | None = None  # fused MoE expert weights (full parameter names); None: none

    @property
    def targets(self) -> list[dict]:
        """Per target: name, bound and Fisher mass with their shares, rank, alpha."""
        return self.provenance.get("targets", [])

    @property
    def ranks(self) -> dict[str, int]:
        return {t["name"]: t["rank"] for t in self.targets}

    def peft_config(self) -> "peft.LoraConfig":
        """The ``peft.LoraConfig`` (PEFT's own class) holding these fields."""
        return peft.LoraConfig(**{k: getattr(self, k) for k in PEFT_FIELDS})

    def adapter_config(self) -> dict:
        """The ``adapter_config.json`` dict: PEFT's LoraConfig fields, nothing else."""
        fields = self.peft_config().to_dict()
        for key, value in fields.items():
            if isinstance(value, (set, frozenset)):
                fields[key] = sorted(value)
        fields["peft_type"] = peft.PeftType.LORA.value
        fields["target_modules"] = list(self.target_modules)  # keep the ranking's order
        return fields

    def save_pretrained(self, out: "str | os.PathLike", *, overwrite: bool = False) -> Path:
        """Write directory ``out`` (adapter_config.json + fisher_select_provenance.json), atomically.

        ``peft.LoraConfig.from_pretrained(out)`` reads it as any adapter directory (no weights
        inside: PEFT initialises the adapters); ``LoraHints.from_pretrained(out, model)`` also
        checks the model.
        """
        out = Path(out)
        check_lora_out(out, overwrite)
        config = json.dumps(self.adapter_config(), indent=2) + "\n"
        provenance = json.dumps({"format": LORA_PROVENANCE_FORMAT, "adapter_config": LORA_CONFIG_FILE,
                                 **self.provenance}, indent=2) + "\n"

        def write(tmp: Path) -> None:
            (tmp / LORA_CONFIG_FILE).write_text(config)
            (tmp / LORA_PROVENANCE_FILE).write_text(provenance)

        return write_dir(out, write, overwrite=overwrite)

    @classmethod
    def from_pretrained(cls, path: "str | os.PathLike", model=None) -> "LoraHints":
        """Read a directory written by ``save_pretrained`` (or its adapter_config.json).

        With ``model``, refuses any model other than the calibrated one. Refuses a sidecar that
        names other targets than the config beside it. A single JSON file with an embedded
        ``fisher_select`` entry (release 0.1.0's ``lora --out FILE``) is still read.
        """
        config_file, fields, meta = _read_hint_files(Path(path))
        if model is not None:
            check_fingerprint(meta["model"].get("fingerprint"), model, f"LoRA config {config_file}")
        meta = {k: v for k, v in meta.items() if k not in ("format", "adapter_config")}
        return cls(**{k: fields.get(k) for k in PEFT_FIELDS if k in fields}, provenance=meta)


def _read_hint_files(path: Path) -> tuple[Path, dict, dict]:
    config_file = path / LORA_CONFIG_FILE if path.is_dir() else path
    if not config_file.is_file():
        raise FisherSelectError(f"LoRA config {config_file} does not exist; pass the --out directory of "
                                "`fisher-select lora` / `export --format peft`")
    fields = read_json(config_file)
    meta = fields.pop("fisher_select", None)  # 0.1.0's single file
    sidecar = config_file.with_name(LORA_PROVENANCE_FILE)
    if meta is None and sidecar.is_file():
        meta = read_json(sidecar)
    if not isinstance(meta, dict) or "model" not in meta:
        raise FisherSelectError(
            f"{config_file} has no {LORA_PROVENANCE_FILE} beside it; it was not written by fisher-select "
            "(use peft.LoraConfig.from_pretrained for a foreign adapter config)")
    names = [t["name"] for t in meta.get("targets", [])]
    if names and sorted(names) != sorted((fields.get("target_modules") or []) + (fields.get("target_parameters") or [])):
        raise FisherSelectError(
            f"{sidecar} lists other targets than {config_file}; the config was edited or the files mixed up: "
            "write the hint again with `fisher-select lora ... --overwrite`")
    return config_file, fields, meta


def load_lora_config(path: "str | os.PathLike", model) -> "peft.LoraConfig":
    """The ``peft.LoraConfig`` of a hint directory, after checking that ``model`` is the calibrated one."""
    config_file, fields, meta = _read_hint_files(Path(path))
    check_fingerprint(meta["model"].get("fingerprint"), model, f"LoRA config {config_file}")
    return peft.LoraConfig.from_peft_type(**fields)


def check_lora_out(out: "str | os.PathLike", overwrite: bool) -> None:
    """Refuse, before any work, an ``--out`` that is a .json file name or an existing directory."""
    out = Path(out)
    if out.suffix == ".json":
        raise FisherSelectError(
            f"--out {out} names a .json file, but a LoRA hint is a directory ({LORA_CONFIG_FILE} + "
            f"{LORA_PROVENANCE_FILE}, what LoraConfig.from_pretrained reads); pass a directory such as "
            f"{out.with_suffix('')}")
    check_dir_target(out, overwrite)


# ---------------------------------------------------------------------------
# Choosing targets and ranks


def pattern_key(name: str) -> str:
    """rank_pattern / alpha_pattern key for one full module name (see module docstring)."""
    return re.escape(name)


def lora_hints(run: "Run | str | os.PathLike", config: LoraHintConfig | None = None, *,
               layers_to_transform: list[int] | None = None, modules: list[str] | None = None,
               module_types: tuple[str, ...] | None = None, task_type: str | None = "CAUSAL_LM",
               model=None, **fields) -> LoraHints:
    """LoRA targets (full names) and per-module ranks from a run's module masses.

    ``config`` (``LoraHintConfig``), or its fields as keyword arguments, says how: targets are the
    eligible modules by decreasing ``ranking`` mass, the first ``top_n`` or the fewest covering
    ``coverage`` (default ``DEFAULT_COVERAGE``); ``total_rank`` (default ``mean_rank`` per target) is split in
    proportion to the same mass, each rank in [``min_rank``, ``max_rank``], a multiple of
    ``rank_step``, summing to ``total_rank`` rounded to a multiple of the step (less only when
    every module is at its cap); ``lora_alpha = alpha_ratio * r`` per module.
    ``layers_to_transform``, ``modules`` (full names or suffixes) and ``module_types`` (class names;
    None: every Linear-like module) restrict the candidates. ``model``, when given, is checked
    against the run's fingerprint and supplies module classes.
    """
    run = load_run(run)
    cfg = LoraHintConfig.with_fields(config, fields)
    step, min_rank = _check_ranks(cfg)
    layers = sorted({int(i) for i in layers_to_transform}) if layers_to_transform is not None else None
    found = tg.eligible(run, module_types=module_types, model=model, layers=layers, modules=modules, experts=True)
    coverage = DEFAULT_COVERAGE if cfg.coverage is None and cfg.top_n is None else cfg.coverage
    chosen, covered = tg.choose(found, coverage, cfg.top_n, cfg.ranking)
    tg.check_unambiguous(chosen, run, model)
    requested = cfg.mean_rank * len(chosen) if cfg.total_rank is None else int(cfg.total_rank)
    ranks = allocate_ranks([t.rank_mass(cfg.ranking) for t in chosen], [t.shape for t in chosen],
                           [t.name for t in chosen], requested, step, min_rank, cfg.max_rank)
    alphas = [_alpha(cfg.alpha_ratio, r) for r in ranks]
    experts = [t.name for t in chosen if t.num_experts]
    if experts and any(t.kind == "Conv1D" for t in chosen):
        raise FisherSelectError(f"targets {experts[0]} (a fused expert weight) and Conv1D modules need PEFT's "
                                "fan_in_fan_out both off and on; restrict --modules to one kind")
    common = max(Counter(ranks).items(), key=lambda kv: (kv[1], kv[0]))[0]
    selection = {"coverage": coverage, "top_n": cfg.top_n, "ranking": cfg.ranking, "covered": covered,
                 "layers_to_transform": layers, "modules": modules}
    provenance = {**run.provenance(CAVEAT), "selection": selection, "total_rank": sum(ranks),
                  "requested_total_rank": requested, "rank_step": step, "alpha_ratio": cfg.alpha_ratio,
                  "targets": _target_rows(chosen, ranks, alphas, found),
                  **({"peft_limits": list(EXPERT_LIMITS)} if experts else {})}
    return LoraHints(target_modules=[t.name for t in chosen if not t.num_experts], target_parameters=experts or None,
                     r=common, lora_alpha=_alpha(cfg.alpha_ratio, common),
                     rank_pattern={pattern_key(t.name): r for t, r in zip(chosen, ranks)},
                     alpha_pattern={pattern_key(t.name): a for t, a in zip(chosen, alphas)},
                     layers_to_transform=layers, fan_in_fan_out=any(t.kind == "Conv1D" for t in chosen),
                     task_type=task_type, provenance=provenance)


def lora_config(run: "Run | str | os.PathLike", config: LoraHintConfig | None = None, **kwargs) -> "peft.LoraConfig":
    """``peft.LoraConfig`` built from ``lora_hints(run, config, **kwargs)``."""
    return lora_hints(run, config, **kwargs).peft_config()


def _target_rows(chosen: list[tg.Target], ranks, alphas, found: list[tg.Target]) -> list[dict]:
    bound_total = sum(t.bound_mass for t in found) or 1.0
    fisher_total = sum(t.fisher_mass for t in found) or 1.0
    return [{"name": t.name, "bound_mass": t.bound_mass, "bound_share": t.bound_mass / bound_total,
             "fisher_mass": t.fisher_mass, "fisher_share": t.fisher_mass / fisher_total, "rank": r, "alpha": a,
             **({"experts": t.num_experts} if t.num_experts else {})}
            for t, r, a in zip(chosen, ranks, alphas)]


def _check_ranks(cfg: LoraHintConfig) -> tuple[int, int]:
    min_rank = cfg.rank_step if cfg.min_rank is None else cfg.min_rank
    if cfg.max_rank is not None and cfg.max_rank < min_rank:
        raise FisherSelectError(f"rank bounds min {min_rank} / max {cfg.max_rank} are invalid; need min <= max")
    if not cfg.alpha_ratio > 0:
        raise FisherSelectError(f"--alpha-ratio {cfg.alpha_ratio} must be positive")
    return int(cfg.rank_step), int(min_rank)


def _alpha(ratio: float, r: int):
    alpha = ratio * r
    return int(alpha) if float(alpha).is_integer() else alpha


def allocate_ranks(masses: list[float], shapes: list[tuple[int, int]], names: list[str], total_rank: int,
                   step: int, min_rank: int, max_rank: int | None) -> list[int]:
    """Ranks in proportion to mass, clamped to [min_rank, cap], multiples of ``step``.

    Works in units of ``step``: U = total_rank / step rounded to nearest. The continuous
    allocation ``clamp(lam * mass, lo, hi)`` summing to U (lam by bisection) is floored, and the
    units still missing go to the largest remainders. The sum is exactly ``U * step`` unless
    every module is at its cap. A module's cap is ``max_rank`` and never above min(out, in).
    """
    lo = math.ceil(min_rank / step)
    hi = [math.floor(min(min(shape), max_rank or math.inf) / step) for shape in shapes]
    for name, shape, h in zip(names, shapes, hi):
        if h < lo:
            raise FisherSelectError(f"module {name} {shape} cannot take rank {lo * step} (cap {h * step}); "
                                    "lower --min-rank / --rank-step or raise --max-rank")
    units = math.floor(total_rank / step + 0.5)
    if len(masses) * lo > units:
        raise FisherSelectError(
            f"total rank {total_rank} cannot give {len(masses)} modules rank >= {lo * step} each; "
            f"pass --total-rank >= {len(masses) * lo * step} or target fewer modules")
    if sum(hi) <= units:
        return [h * step for h in hi]
    shares = _water_fill(masses, lo, hi, units)
    alloc = [math.floor(s) for s in shares]
    # Missing units to the largest fractional parts (then larger mass, then earlier).
    order = sorted(range(len(masses)), key=lambda i: (alloc[i] - shares[i], -masses[i], i))
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
# Checked against PEFT's own matcher (`fisher-select lora`, `export --format peft`)


@dataclass
class LoraExport:
    """A checked LoRA hint and what its adapters train."""

    hints: LoraHints
    trainable: int  # LoRA parameters: sum of r * (in + out) over the targets
    numel: int  # parameters of the base model (the run's)
    matched: dict[str, list[str]]  # target -> module names PEFT's own matcher adapts


def lora_export(run: "Run | str | os.PathLike", config: LoraHintConfig | None = None, *, model=None,
                **kwargs) -> LoraExport:
    """``lora_hints(run, config, **kwargs)``, checked with PEFT's matcher against the run's (and model's) modules."""
    run = load_run(run)
    hints = lora_hints(run, config, model=model, **kwargs)
    peft_config = hints.peft_config()
    names = sorted({module_of(n) for n in run.fisher} | {e.name for e in run.report.modules})
    matched = check_lora_targets(peft_config, names, f"the modules of run {run.run_id}", list(run.fisher))
    if model is not None:
        matched = check_lora_targets(peft_config, [n for n, _ in model.named_modules()],
                                     f"the model's named_modules() ({type(model).__name__})",
                                     [n for n, _ in model.named_parameters()])
    trainable = lora_trainable({n: tuple(f.shape) for n, f in run.fisher.items()}, hints.ranks)
    return LoraExport(hints=hints, trainable=trainable, numel=sum(t.numel() for t in run.fisher.values()),
                      matched=matched)


def lora_trainable(shapes: dict[str, tuple], ranks: dict[str, int]) -> int:
    """Trainable parameters of LoRA at ``ranks`` (module -> rank) on parameters of ``shapes`` (name -> shape):
    rank x (fan-in + fan-out) per target; a fused expert tensor (E, a, b) takes one adapter per expert."""
    fused = fused_experts(shapes)
    return sum(r * (sum(fused[name].shape[1:]) * fused[name].num_experts if name in fused
                    else sum(shapes[f"{name}.weight"])) for name, r in ranks.items())


def check_lora_targets(config, names: list[str], where: str, parameters: list[str] = ()) -> dict[str, list[str]]:
    """Target -> module (or, for ``target_parameters``, parameter) names PEFT adapts; refuses unmatched targets.

    Modules are matched by PEFT's ``check_target_module_exists``; parameters as PEFT's ``_inject_parameters``
    matches them (the full name or a ``.``-suffix of it). Also refuses a ``rank_pattern`` / ``alpha_pattern``
    key that PEFT would give no adapted module or parameter.
    """
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    adapted = [n for n in names if check_target_module_exists(config, n)]
    matched = {t: [n for n in adapted if n == t or n.endswith("." + t)] for t in list(config.target_modules)}
    wanted = list(config.target_parameters or [])
    matched.update({t: [p for p in parameters if p == t or p.endswith("." + t)] for t in wanted})
    adapted += [p for t in wanted for p in matched[t]]
    refuse_unmatched([t for t, hits in matched.items() if not hits], where, "LoRA target")
    for patterns, what in ((config.rank_pattern, "rank_pattern"), (config.alpha_pattern, "alpha_pattern")):
        used = {get_pattern_key(list(patterns), n) for n in adapted}
        refuse_unmatched([k for k in patterns if k not in used], where, f"{what} key")
    return matched


_SHOWN = 5  # names listed in an error before "... and N more"


def refuse_unmatched(missing: list[str], where: str, what: str) -> None:
    """One error for every pattern / target that matches nothing (the commonest complaint of both tools)."""
    if not missing:
        return
    shown = ", ".join(missing[:_SHOWN]) + (f" ... and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else "")
    raise FisherSelectError(
        f"{len(missing)} {what}(s) match nothing in {where}: {shown}; the run and the model differ "
        "(recalibrate on this model, or export for the model the run was computed on)")


def trainable_lora_parameters(model) -> int:
    """Trainable parameters of a PEFT-adapted model (tied ones once): what the adapters cost."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total

