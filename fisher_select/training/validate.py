"""`fisher-select validate`: train for real from the calibration point and measure what moved.

``validate(run, steps, optimizer, lr, weight_decay, seed)`` loads the run's model (fp32 master
weights) and recipe, trains with the run's primary objective (``training.loop``), records the
realized movement ``|theta_T - theta_0|`` of every coordinate in fp32 and scores the run's ranking
(F; for one objective the bound ``sqrt(F S)`` ranks identically) against it, beside baselines on
the same subsample of coordinates: random, ``|theta|``, one batch's ``|grad|``, Spectrum's weight SNR,
PEFT's KappaTune, a second run with another seed (the ceiling), and an Adam-aware ranking (beyond
the seed's bound; see ``_adam_aware``). It also runs the first-step check (one SGD step on a large
batch: ``|delta|/lr`` against the bound, with the noise level) and, when asked, masked fine-tuning
with fisher_select's, a random and a magnitude mask and Spectrum's module choice (``_masked``).
Output: ``validation.json`` and plots, written atomically into one directory (default
``RUN/validation-<optimizer>-seed<seed>``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fisher_select.atomic import check_dir_target, write_dir
from fisher_select.calibration.objectives.base import Context, Objective
from fisher_select.calibration.prompts import PromptRecord, check_disjoint, load_prompts
from fisher_select.config import build_objectives, parse_recipe
from fisher_select.engine.scoring import plan_coverage, score_sums
from fisher_select.errors import FisherSelectError
from fisher_select.models import check_fingerprint, load_model
from fisher_select.rundir import VALIDATION_FILE, VALIDATION_PLOTS, Run, coordinate_bound, load_run, validation_dir
from fisher_select.stats.correlation import spearman
from fisher_select.stats.naming import module_of
from fisher_select.stats.ranking import global_top_masks
from fisher_select.training import baselines, plots
from fisher_select.training.loop import Streams, TrainConfig, backward, make_task, pad_rows, token_weights, train
from fisher_select.training.metrics import (QUANTILES, TOP_K, Realized, Subsample, auroc, first_step_check,
                                            moved_mask, ranking_metrics, selection_metrics)
from fisher_select.training.movement import LazyMovement, bf16_lost, gradients, load_snapshot, movement, snapshot

# Offsets of the random streams derived from the seed (each use gets its own, all reproducible).
FIRST_STEP_STREAM, SINGLE_BATCH_STREAM, EVAL_STREAM, METRIC_STREAM, MASK_STREAM = (
    1_000_003, 1_000_033, 1_000_037, 1_000_039, 1_000_081)
CURVE_FRACTIONS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3)


@dataclass
class ValidationConfig:
    """What to measure besides the main run."""

    subsample: int | None = 2_000_000  # coordinates scored (None: all of them)
    second_seed: bool = True  # a second run with seed + 1: how well one run predicts another
    first_step_prompts: int | None = None  # the first-step batch (default 2 x prompts_per_step), in two halves
    eval_prompts: int = 8  # held-out prompts after the calibration's, for the training outcome
    mask_densities: tuple[float, ...] = ()  # masked fine-tuning: fisher / random / magnitude at these, + Spectrum
    mask_seeds: int = 1  # masked fine-tuning repeated over seeds seed .. seed + n - 1: its spread over seeds
    sparse_masks: bool = False  # masked fine-tuning through the sparse-delta mode (outputs.sparse), as users run it
    adam_aware: bool = True


@dataclass
class Setup:
    """What training needs: the model (fp32), tokenizer, objective and prompts."""

    model: object
    tokenizer: object
    objective: Objective
    prompts: list[PromptRecord]
    eval_prompts: list[PromptRecord]
    eval_disjoint: bool  # False: no prompt was left after the calibration's; the held-out set repeats them
    device: object = "cpu"


@dataclass
class ValidationResult:
    report: dict  # validation.json
    figures: dict  # data of the plots
    out: Path | None = None


@dataclass
class Reduced:
    """A parameter-shaped quantity reduced to what the metrics use: the subsample and module sums."""

    sub: torch.Tensor  # (M,) fp32
    modules: dict[str, float]  # module -> sum over its coordinates (fp64)


def reduce(tensors: dict[str, torch.Tensor], sub: Subsample, transform=None) -> Reduced:
    """Subsample values and per-module sums of ``transform(tensor)`` (default: the tensor)."""
    modules: dict[str, float] = {}
    values = {}
    for name, t in tensors.items():
        v = t if transform is None else transform(t)
        values[name] = v
        modules[module_of(name)] = modules.get(module_of(name), 0.0) + float(v.double().sum())
    return Reduced(sub.take(values), modules)


def validate(run, steps: int, optimizer: str = "sgd", lr: float = 1e-4, weight_decay: float = 0.0, seed: int = 0,
             *, out=None, overwrite: bool = False, config: ValidationConfig | None = None,
             setup: Setup | None = None, device: str = "cpu", progress: bool = True, **batch) -> ValidationResult:
    """Train from the calibration point and score the run's ranking against realized movement.

    ``batch``: ``TrainConfig`` fields (prompts_per_step, samples_per_prompt, max_new_tokens,
    batch_size; max_new_tokens defaults to the run's). ``setup``: the model, tokenizer, objective and
    prompts (default: loaded from the run's report). ``out``: the output directory (default
    ``RUN/validation-<optimizer>-seed<seed>``; nothing is written when the run has no directory).
    """
    run = load_run(run)
    options = config or ValidationConfig()
    batch.setdefault("max_new_tokens", run.report.max_new_tokens or 32)
    settings = TrainConfig(steps, optimizer, lr, weight_decay, seed, **batch)
    problems = settings.problems() + _option_problems(options)
    if problems:
        raise FisherSelectError("invalid validation settings: " + "; ".join(problems))
    if out is None and run.path is not None:
        out = validation_dir(run.path, optimizer, seed)
    if out is not None:
        check_dir_target(Path(out), overwrite)  # refuse before minutes of training
    setup = setup or load_setup(run, device, options.eval_prompts)
    result = _Validation(run, setup, settings, options, progress).measure()
    if out is not None:
        result.out = write_validation(Path(out), result, overwrite)
    return result


def _option_problems(o: ValidationConfig) -> list[str]:
    out = []
    if o.subsample is not None and o.subsample < 100:
        out.append(f"subsample must be at least 100 coordinates, got {o.subsample}")
    if o.first_step_prompts is not None and o.first_step_prompts < 2:
        out.append("first_step_prompts must be at least 2 (the batch is split in two halves)")
    out += [f"mask density {d} is not in (0, 1)" for d in o.mask_densities if not 0 < d < 1]
    if o.mask_seeds < 1:
        out.append(f"mask_seeds must be at least 1, got {o.mask_seeds}")
    return out


def load_setup(run: Run, device: str, eval_prompts: int) -> Setup:
    """The run's model in fp32, its primary objective and prompts, from report.json."""
    report = run.report
    if report.config is None:
        raise FisherSelectError(f"run {run.run_id} records no recipe (report.json: config); pass setup= to validate")
    if report.model.quantization:
        raise FisherSelectError(f"run {run.run_id} was calibrated on a {report.model.quantization}-quantized model; "
                                "validate trains fp32 master weights: calibrate the unquantized model to validate")
    recipe = parse_recipe(report.config, f"(the recipe recorded in run {run.run_id})")
    objective = build_objectives(recipe)[0]  # the primary objective: the one the run's ranking is for
    model, tokenizer, _ = load_model(report.model.path or report.model.name, device, "float32")
    check_fingerprint(run.fingerprint, model, f"run {run.run_id}")
    every = load_prompts(recipe.prompts)
    n = recipe.num_prompts or len(every)
    held = every[n : n + eval_prompts]
    check_disjoint({"training": every[:n], "held-out": held})
    return Setup(model, tokenizer, objective, every[:n], held or every[:n], bool(held), device)


class _Validation:
    """One validation: the snapshot, the subsample, the task, and the runs' reduced results."""

    def __init__(self, run: Run, setup: Setup, settings: TrainConfig, options: ValidationConfig, progress: bool):
        self.run, self.setup, self.settings, self.options, self.progress = run, setup, settings, options, progress
        self.model = setup.model
        self.ctx = Context(setup.model, setup.tokenizer, setup.device)
        self.task = make_task(setup.objective, self.ctx, setup.prompts, settings.samples_per_prompt,
                              settings.max_new_tokens)
        self.fisher = run.fisher_for(None)
        self.theta0 = snapshot(self.model)
        missing = set(self.theta0) ^ set(self.fisher)
        if missing:
            raise FisherSelectError(f"run {run.run_id} and the model disagree on parameters (e.g. "
                                    f"{sorted(missing)[0]}); load the model the run was computed for")
        self.sub = Subsample({n: tuple(t.shape) for n, t in self.theta0.items()}, options.subsample, settings.seed)
        self.logs: dict[str, list[dict]] = {}
        self.realized: Realized | None = None  # the main run's moved sets (set when the report is assembled)

    def measure(self) -> ValidationResult:
        started = time.time()
        before = self.task.evaluate(self.setup.eval_prompts, self.settings.seed + EVAL_STREAM, self.settings.batch_size)
        first, adam, first_rows = self._first_step()
        single = self._single_batch()
        main = self._train(self.settings.seed, "training", record_steps=True)
        second = self._train(self.settings.seed + 1, "second seed") if self.options.second_seed else None
        masked = self._masked(before, main, second)
        load_snapshot(self.model, self.theta0)
        report, figures = self._assemble(main, second, single, adam, first, first_rows, before, masked)
        if main["summary"]["max"] == 0:
            report["caveats"].insert(0, "no coordinate moved: the training signal was zero on every step (e.g. "
                                        "all rewards of each prompt equal); the metrics are undefined")
        report["elapsed_s"] = time.time() - started
        return ValidationResult(report, figures)

    # -- measurements ---------------------------------------------------------------------------

    def _first_step(self):
        """One SGD step on a large fresh batch (two halves): the first-step check and the Adam-aware ranking."""
        s = self.settings
        count = self.options.first_step_prompts or 2 * s.prompts_per_step
        batch = self.task.batch(count, Streams.from_seed(s.seed + FIRST_STEP_STREAM, self.setup.device))
        grad, noise, rows = split_half_gradient(self.model, batch, self.task.pad, s.batch_size)
        delta = sgd_step(self.model, grad, s.lr, self.theta0)
        del grad
        first = self._first_step_result(delta, noise)
        del delta, noise
        adam = self._adam_aware(batch) if self.options.adam_aware else None
        return first, adam, rows

    def _scale(self) -> tuple[float | None, str]:
        """The run's S when it belongs to the trained objective (else None) and why not."""
        entry, trained = self.run.objective(None), self.setup.objective
        if entry.type != trained.kind:
            return None, (f"the run's signal scale belongs to its {entry.type!r} objective, not to the trained "
                          f"{trained.kind!r} objective: no absolute bound")
        scale = entry.signal_scale
        if scale is None or not math.isfinite(scale):
            return None, f"the objective's signal scale S is {'unknown' if scale is None else 'infinite'}: no absolute bound"
        if scale == 0:  # an estimate: no calibration prompt's sampled signal varied, not a proof that E[g] = 0
            return None, ("the run's estimated signal scale S is 0 (no calibration prompt's sampled signal varied): "
                          "the bound would be 0 everywhere; calibrate with more samples or tokens for an absolute bound")
        return scale, ""

    def _first_step_result(self, delta, noise) -> dict:
        scale, why = self._scale()
        if scale is None:
            return {"violation_rate": None, "reason": why}
        bound = coordinate_bound(self.fisher, scale)
        out = first_step_check(delta, noise, bound, self.theta0, self.settings.lr)
        b, nz = self.sub.take(bound), self.sub.take(noise)
        seen = b > 0
        out["noise_to_bound_median"] = float((nz[seen] / b[seen]).median()) if seen.any() else None
        out["signal_scale"] = scale
        return out

    def _adam_aware(self, batch) -> Reduced:
        """The Adam-aware ranking (beyond the seed's bound): ``minibatch_snr`` of a training-size
        minibatch, from the exact per-row sums on the first-step batch."""
        sums = row_score_sums(self.model, batch, self.task.pad, self.settings.batch_size)
        rows = self.task.step_rows(self.settings.prompts_per_step)
        snr = {name: minibatch_snr(sums.total[name], sums.squares[name], sums.count, rows, self.task.population)
               for name in sums.total}
        return reduce(snr, self.sub)

    def _single_batch(self) -> Reduced:
        """|gradient| of one training-size batch at the start, drawn from its own stream."""
        s = self.settings
        batch = self.task.batch(s.prompts_per_step, Streams.from_seed(s.seed + SINGLE_BATCH_STREAM, self.setup.device))
        self.model.zero_grad(set_to_none=True)
        backward(self.model, batch, self.task.pad, s.batch_size)
        out = reduce(gradients(self.model), self.sub, torch.abs)
        self.model.zero_grad(set_to_none=True)
        return out

    def _train(self, seed: int, label: str, masks: dict | None = None, record_steps: bool = False,
               sparse: bool = False) -> dict:
        """One training run from theta_0; its log, held-out outcome and reduced movement."""
        load_snapshot(self.model, self.theta0)
        settings = dataclasses.replace(self.settings, seed=seed)
        by_step = []  # subsampled movement after each step (record_steps): how the prediction drifts

        def record(step: int) -> None:
            by_step.append(self.sub.take(LazyMovement(self.model, self.theta0)))

        log = train(self.model, self.task, settings, masks=masks, sparse=sparse, progress=self.progress, desc=label,
                    after_step=record if record_steps else None)
        self.logs[label] = log
        after = self.task.evaluate(self.setup.eval_prompts, self.settings.seed + EVAL_STREAM, settings.batch_size)
        moved_count, lost = bf16_lost(self.model, self.theta0)
        delta = movement(self.model, self.theta0)
        moved = moved_count / self.sub.total
        size = math.sqrt(sum(float(d.double().square().sum()) for d in delta.values()))
        reduced = reduce(delta, self.sub)
        del delta
        load_snapshot(self.model, self.theta0)
        return {"seed": seed, "log": log, "after": after, "moved": reduced, "by_step": by_step,
                "summary": {"share_moved": moved, "l2_norm": size, "max": float(reduced.sub.max()),
                            "bf16_lost_share": lost / moved_count if moved_count else None,
                            "bf16_lost": "share of the moved coordinates whose whole update a bf16 copy of the "
                                         "weights would round away (bf16(bf16(theta_0) + delta) == bf16(theta_0))"}}

    def _masked(self, before: float, main: dict, second: dict | None) -> dict | None:
        """Masked fine-tuning, same steps as the full runs: fisher_select's, a random and a magnitude
        mask at each density, and Spectrum's module choice at its own density, each repeated over
        ``mask_seeds`` seeds (each seed beside full fine-tuning with that seed; a fresh random mask)."""
        if not self.options.mask_densities:
            return None
        seeds = [self.settings.seed + i for i in range(self.options.mask_seeds)]
        full = {main["seed"]: main["after"]} | ({second["seed"]: second["after"]} if second else {})
        for s in seeds:  # full fine-tuning per seed (the main and second-seed runs are reused)
            if s not in full:
                full[s] = self._train(s, f"full seed {s}")["after"]
        chosen = baselines.spectrum_selection(baselines.spectrum_module_scores(self.model))
        runs = []
        magnitude = {n: t.abs() for n, t in self.theta0.items()}
        for d in self.options.mask_densities:  # the fisher and magnitude masks do not depend on the seed
            fisher, mag = global_top_masks(self.fisher, d), global_top_masks(magnitude, d)
            for rule, mask_for in (("fisher", lambda s: fisher),
                                   ("random", lambda s: global_top_masks(self._random_scores(s), d)),
                                   ("magnitude", lambda s: mag)):
                runs.append(self._mask_runs(rule, mask_for, seeds, before, full))
        spectrum = {n: torch.full(t.shape, module_of(n) in chosen) for n, t in self.theta0.items()}
        runs.append(self._mask_runs("spectrum", lambda s: spectrum, seeds, before, full))
        return {"before": before, "full_fine_tuning": main["after"], "seed": self.settings.seed, "seeds": seeds,
                "mode": "sparse delta (outputs.sparse)" if self.options.sparse_masks else "dense (apply_masks)",
                "full_fine_tuning_per_seed": [full[s] for s in seeds],
                "recovered": "(after_mask - before) / (after_full - before) of the held-out objective, per seed "
                             "against full fine-tuning with the same seed; 'after' and 'recovered' are means over seeds",
                "spectrum": f"Spectrum's module choice ({len(chosen)} modules: top 50% per type by weight SNR "
                            "+ lm_head + embed_tokens); its density is what that choice holds",
                "runs": runs}

    def _random_scores(self, seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed + MASK_STREAM)  # a fresh random mask per seed
        return {n: torch.rand(t.shape, generator=gen) for n, t in self.theta0.items()}

    def _mask_runs(self, rule: str, mask_for, seeds: list[int], before: float, full: dict) -> dict:
        """One mask rule at one budget over the seeds: held-out outcome and share recovered per seed."""
        per_seed = []
        for s in seeds:
            mask = mask_for(s)
            trainable = sum(int(m.sum()) for m in mask.values())
            after = self._train(s, f"mask {rule} {trainable / self.sub.total:.3g} seed {s}", mask,
                                sparse=self.options.sparse_masks)["after"]
            per_seed.append({"seed": s, "after": after, "full_fine_tuning": full[s],
                             "recovered": recovered_share(before, after, full[s])})
        shares = [r["recovered"] for r in per_seed if r["recovered"] is not None]
        out = {"mask": rule, "density": trainable / self.sub.total, "trainable": trainable,
               "after": statistics.fmean(r["after"] for r in per_seed),
               "recovered": statistics.fmean(shares) if len(shares) == len(per_seed) else None,
               "per_seed": per_seed}
        if len(shares) == len(per_seed) > 1:
            out["recovered_spread"] = {"min": min(shares), "max": max(shares), "std": statistics.stdev(shares)}
        return out

    # -- metrics and the report -----------------------------------------------------------------

    def _assemble(self, main, second, single, adam, first, first_rows, before, masked):
        seed = self.settings.seed + METRIC_STREAM
        moved = main["moved"]
        fisher = reduce(self.fisher, self.sub)
        root = reduce(self.fisher, self.sub, lambda f: f.clamp_min(0).sqrt())
        modules = sorted(moved.modules)
        target = [moved.modules[m] for m in modules]
        self.realized = Realized(moved.sub, CURVE_FRACTIONS, seed)  # the moved sets, once for every ranking
        metrics, curve = ranking_metrics(fisher.sub, self.realized, seed + 1, CURVE_FRACTIONS)
        rho_root = spearman([root.modules[m] for m in modules], target)
        rho_mass = spearman([fisher.modules[m] for m in modules], target)
        chosen = "sum_sqrt_fisher" if (rho_root or -2) >= (rho_mass or -2) else "sum_fisher"
        curves = {"fisher": curve}
        base = self._baselines(moved, modules, target, single, second, seed, curves)
        report = {
            "run_id": self.run.run_id, "model": self.run.report.model.name,
            "objective": {"name": self.setup.objective.name, "type": self.setup.objective.kind},
            "settings": {**dataclasses.asdict(self.settings), **dataclasses.asdict(self.options),
                         "first_step_rows": first_rows},
            "training": {"estimator": self.task.description, "weights": "fp32 master weights, eval mode (no dropout)",
                         "movement": "|theta_T - theta_0| per coordinate in fp32 after all steps",
                         "moved": "AUROC: above the q-quantile of realized movement; precision/recall@k: against "
                                  "the realized top 1%; jaccard@k: predicted vs realized top-k"},
            "subsample": self.sub.describe(self.settings.seed),
            "ranking": "the run's F (fisher.safetensors; for one objective the bound sqrt(F S) ranks identically)",
            **metrics,
            "spearman_modules": {"sum_sqrt_fisher": rho_root, "sum_fisher": rho_mass, "chosen": chosen,
                                 "modules": len(modules),
                                 "meaning": "Spearman over modules of the aggregate against module movement "
                                            "(sum of |delta| over the module's coordinates)"},
            "module_table": [{"module": m, "sum_fisher": fisher.modules[m], "sum_sqrt_fisher": root.modules[m],
                              "movement": moved.modules[m]} for m in modules],
            "auroc_by_step": self._by_step(fisher.sub, main["by_step"]),
            "first_step_violation_rate": first.get("violation_rate"), "first_step": first,
            "training_outcome": self._outcome(main, second, before, masked),
            "baselines": base,
            "adam_aware": self._adam_entry(adam, moved, modules, target, seed, curves),
            "movement_summary": {"main": main["summary"], "second_seed": second["summary"] if second else None},
            "caveats": self._caveats(),
        }
        scale, _ = self._scale()
        bound_sub = coordinate_bound({"x": fisher.sub}, scale)["x"]
        scale_known = scale is not None
        figures = {"bound": bound_sub, "moved": moved.sub, "curves": curves, "logs": dict(self.logs),
                   "bound_label": "bound sqrt(F S)" if scale_known else "sqrt(F) (S unknown)",
                   "outcome_label": self.task.outcome_name}
        return report, figures

    @staticmethod
    def _by_step(scores: torch.Tensor, by_step: list[torch.Tensor]) -> dict:
        """The ranking's AUROC against the movement after each step (moved: above the q-quantile)."""
        return {"meaning": "AUROC of the run's ranking for 'moved more than the q-quantile' against the "
                           "movement after steps 1..N of the main run (how the prediction drifts with steps)",
                **{f"q{q}": [auroc(scores, moved_mask(m, q)) if float(m.max()) > 0 else None for m in by_step]
                   for q in QUANTILES}}

    def _entry(self, scores: torch.Tensor, module_scores: dict, moved: Reduced, modules, target, seed, how: str,
               curves: dict, label: str) -> dict:
        metrics, curves[label] = ranking_metrics(scores, self.realized, seed + 1, CURVE_FRACTIONS)
        entry = {"how": how, **metrics, "spearman_modules": spearman([module_scores.get(m, 0.0) for m in modules],
                                                                      target)}
        if scores.numel() and bool((scores == scores[0]).all()):  # e.g. a zero gradient: no ranking at all
            entry["degenerate"] = ("every score is equal (e.g. a batch without signal gives a zero gradient): this "
                                   "ranking is random tie-breaking, its metrics are chance by construction")
        return entry

    def _baselines(self, moved, modules, target, single, second, seed, curves) -> dict:
        names, sub = self.sub.names, self.sub
        numel: dict[str, float] = {}
        for n, t in self.theta0.items():
            numel[module_of(n)] = numel.get(module_of(n), 0.0) + t.numel()
        out = {"random": self._entry(baselines.random_scores(sub.size, seed), numel, moved, modules, target,
                                     seed, "uniform random scores (a random mask of the same density); module "
                                           "aggregate: module size", curves, "random")}
        mag = reduce(self.theta0, sub, torch.abs)
        out["magnitude"] = self._entry(mag.sub, mag.modules, moved, modules, target, seed,
                                       "|theta| at the start; module aggregate: sum of |theta|", curves, "magnitude")
        out["single_batch_gradient"] = self._entry(
            single.sub, single.modules, moved, modules, target, seed,
            "|gradient| of one training-size batch at the start (its own samples); module aggregate: sum", curves,
            "single-batch |grad|")
        out["spectrum_snr"] = self._spectrum(names, moved, modules, target, seed, curves)
        out["kappa"] = self._kappa(names, moved, modules, target, seed, curves)
        if second is not None:
            out["second_seed"] = self._entry(second["moved"].sub, second["moved"].modules, moved, modules, target,
                                             seed, f"realized |delta| of a second run with seed {second['seed']} "
                                                   "(the ceiling: how well one run predicts another)",
                                             curves, "second seed")
        else:
            out["second_seed"] = {"unavailable": "not run (second_seed=False)"}
        return out

    def _spectrum(self, names, moved, modules, target, seed, curves) -> dict:
        snr = baselines.spectrum_module_scores(self.model)
        scores = self.sub.broadcast(baselines.per_parameter(names, snr, -1.0))
        entry = self._entry(scores, {m: snr.get(m, -1.0) for m in modules}, moved, modules, target, seed,
                            f"Spectrum's weight SNR per module ({baselines.SPECTRUM_SOURCE}); modules without a "
                            "weight score -1; coordinates get their module's score", curves, "spectrum SNR")
        scored = [m for m in modules if m in snr]
        entry["spearman_modules_scored"] = spearman([snr[m] for m in scored], [moved.modules[m] for m in scored])
        chosen = baselines.spectrum_selection(snr)
        selected = self.sub.broadcast([float(module_of(n) in chosen) for n in names]) > 0
        entry["selection"] = {"rule": "top 50% per type + lm_head + embed_tokens", "modules": len(chosen),
                              **selection_metrics(selected, self.realized)}
        return entry

    def _kappa(self, names, moved, modules, target, seed, curves) -> dict:
        scores, targets, how = baselines.kappa_module_scores(self.model)
        if scores is None:
            return {"unavailable": how}
        coords = self.sub.broadcast(baselines.per_parameter(names, scores, 0.0))
        entry = self._entry(coords, scores, moved, modules, target, seed,
                            f"KappaTune: lowest condition number first ({how}); modules it does not analyse "
                            "score 0", curves, "kappa")
        scored = [m for m in modules if m in scores]
        entry["spearman_modules_scored"] = spearman([scores[m] for m in scored], [moved.modules[m] for m in scored])
        selected = self.sub.broadcast([float(module_of(n) in targets) for n in names]) > 0
        entry["selection"] = {"rule": f"find_kappa_target_modules(top_p={baselines.KAPPA_TOP_P})",
                              "modules": len(targets), **selection_metrics(selected, self.realized)}
        return entry

    def _adam_entry(self, adam, moved, modules, target, seed, curves) -> dict:
        if adam is None:
            return {"status": "not computed (adam_aware=False)"}
        entry = self._entry(adam.sub, adam.modules, moved, modules, target, seed,
                            "BEYOND THE SEED'S BOUND: per-coordinate signal-to-noise |m|/sqrt(m^2 + Var/B) of a "
                            "training-size minibatch gradient, from exact per-row sums on the first-step batch "
                            "(rows weighted by their signal); a heuristic for Adam, measured here",
                            curves, "adam-aware SNR")
        entry["label"] = "beyond the seed's bound: ship only as far as it measurably predicts"
        return entry

    def _outcome(self, main, second, before, masked) -> dict:
        runs = {"main": {"seed": main["seed"], "per_step": main["log"], "held_out_after": main["after"]}}
        if second is not None:
            runs["second_seed"] = {"seed": second["seed"], "per_step": second["log"], "held_out_after": second["after"]}
        return {"per_step_metric": f"{self.task.outcome_name}, on each step's own batch (before its update)",
                "held_out_metric": f"{self.task.outcome_name}, on the held-out prompts (on-policy: K samples each, fixed seed)",
                "held_out_prompts": len(self.setup.eval_prompts), "held_out_disjoint": self.setup.eval_disjoint,
                "held_out_before": before, "runs": runs, "masked_fine_tuning": masked}

    def _caveats(self) -> list[str]:
        out = ["The bound is for the expected gradient at the calibration point, one step; realized movement "
               "over several steps also reflects sampling noise and the parameters' drift."]
        if self.settings.optimizer == "adamw":
            out.append("AdamW divides by a running RMS: over a few steps almost every coordinate with a nonzero "
                       "gradient moves by about lr, so a ranking by F or |g| is not expected to predict its "
                       "movement (see auroc; the Adam-aware ranking is measured beside it, under adam_aware). "
                       "Module movement then tracks module size: even the random ranking's module sums "
                       "correlate with it (baselines.random.spearman_modules). Whether a mask still trains "
                       "well is measured separately (training_outcome.masked_fine_tuning).")
        if self.settings.weight_decay > 0:
            out.append(f"weight decay {self.settings.weight_decay} moves every coordinate by about lr*wd*|theta|, "
                       "independently of its gradient.")
        if len(self.run.objectives) > 1:
            out.append(f"trained on the primary objective {self.setup.objective.name!r} only; the run has "
                       f"{len(self.run.objectives)} objectives")
        silent = sum(e["rows"] - e["rows_with_signal"] for log in self.logs.values() for e in log)
        total = sum(e["rows"] for log in self.logs.values() for e in log)
        if total and silent > total / 2:
            out.append(f"{silent} of {total} training rows carried no signal (e.g. every reward of their prompt "
                       "equal): movement rests on few samples, so every ranking's metrics are noisy")
        cut = self.run.report.truncation_rate
        if cut > 0.1:
            out.append(f"{cut:.0%} of the calibration's responses were cut at max_new_tokens: F describes the "
                       "truncated distribution")
        if not self.setup.eval_disjoint:
            out.append("no prompt was left after the calibration's: the held-out outcome reuses the training prompts")
        return out


def split_half_gradient(model, batch, pad: int, micro: int):
    """(the batch's mean loss gradient, an estimate of its noise, rows), parameter-keyed fp32 CPU tensors.

    The batch is split into two halves of whole prompt groups (groups are independent; rows inside
    one are not, through the leave-one-out baseline), with mean gradients g1 (n1 rows) and g2 (n2).
    The whole batch's mean is ``(n1 g1 + n2 g2) / (n1 + n2)``, of variance ``sigma^2 / (n1 + n2)``;
    ``|g1 - g2| sqrt(n1 n2) / (n1 + n2)`` has that same variance and zero mean: one draw of the noise.
    """
    half = len(batch.groups) // 2
    if half == 0:
        raise FisherSelectError("the first-step batch needs at least two prompt groups (it is split in halves)")
    grads, sizes = [], []
    for part in (batch.part(list(range(half))), batch.part(list(range(half, len(batch.groups))))):
        model.zero_grad(set_to_none=True)
        backward(model, part, pad, micro)
        grads.append(gradients(model))
        sizes.append(len(part.rows))
    model.zero_grad(set_to_none=True)
    n1, n2 = sizes
    mean = {k: (n1 * grads[0][k] + n2 * grads[1][k]) / (n1 + n2) for k in grads[0]}
    noise = {k: (grads[0][k] - grads[1][k]).abs() * (math.sqrt(n1 * n2) / (n1 + n2)) for k in grads[0]}
    return mean, noise, n1 + n2


def sgd_step(model, grad: dict, lr: float, start: dict) -> dict:
    """Take one plain SGD step along ``grad`` from ``start``; return ``|delta|`` (fp32) and restore ``start``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.grad = grad[name].to(p.device, p.dtype)
    torch.optim.SGD(list(model.parameters()), lr=lr).step()
    delta = movement(model, start)
    load_snapshot(model, start)
    return delta


def row_score_sums(model, batch, pad: int, micro: int):
    """Exact sums over the batch's rows of the per-row gradients ``u_n`` and of ``u_n^2`` (engine hooks).

    ``u_n`` is the gradient of row n's weighted log-probability ``sum_t w_{n,t} log pi(y_t|s_t)``:
    ``a_n h_n`` for a sequence-level signal, ``sum_t A_t h_t`` at token level, ``h_n`` for a
    demonstration (no weights). So ``total / count`` is the mean step direction (up to sign) and
    ``squares / count`` its per-row second moment.
    """
    cov, sums = plan_coverage(model), None
    device = next(model.parameters()).device
    for i in range(0, len(batch.rows), micro):
        rows = batch.rows[i : i + micro]
        ids, mask, resp = pad_rows(rows, pad, device)  # (B, T) each
        tw = None if batch.weights is None else token_weights(rows, batch.weights[i : i + micro], ids.shape[1], device)
        sums = score_sums(model, ids, mask, resp, token_weights=tw, coverage=cov, into=sums)
    return sums


def minibatch_snr(total: torch.Tensor, squares: torch.Tensor, count: int, rows: int,
                  population: int | None) -> torch.Tensor:
    """Per coordinate ``|m| / sqrt(m^2 + c Var / B)``: the signal-to-noise of a B-row minibatch gradient.

    ``m = total / count`` and ``Var = squares / count - m^2`` are the per-row mean and (plug-in)
    variance over ``count`` rows; ``B = rows`` rows per training step. Adam's step is about
    ``lr E[g_B] / sqrt(E[g_B^2])`` and ``E[g_B^2] = m^2 + c Var / B``. ``c`` is the finite-population
    correction ``(N - B) / (N - 1)`` when steps draw B of N rows without replacement (demonstrations;
    ``population`` = N), else 1. Coordinates with no gradient at all score 0. Same shape as ``total``.
    """
    c = 1.0 if population is None else max(population - rows, 0) / max(population - 1, 1)
    m = total.double() / count
    var = (squares.double() / count - m.square()).clamp_min(0)  # rounding can make it slightly negative
    denom = (m.square() + c * var / rows).sqrt()
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))  # 0/0 where nothing moved the coordinate
    return torch.where(denom > 0, m.abs() / safe, torch.zeros_like(denom)).float()


def recovered_share(before: float, after: float, full_after: float) -> float | None:
    """The share of full fine-tuning's held-out improvement a masked run recovers:
    ``(after - before) / (full_after - before)`` (None when full fine-tuning left the objective unchanged).
    The sign convention cancels, so it reads the same for a reward (up) and a loss (down)."""
    full = full_after - before
    return (after - before) / full if full != 0 else None


def write_validation(out: Path, result: ValidationResult, overwrite: bool) -> Path:
    """validation.json and the plots, as one directory written atomically."""

    def writer(tmp: Path) -> None:
        fig = result.figures
        plots.bound_vs_movement(tmp / VALIDATION_PLOTS["bound"], fig["bound"], fig["moved"], fig["bound_label"], 0)
        plots.overlap_curves(tmp / VALIDATION_PLOTS["curves"], list(CURVE_FRACTIONS), fig["curves"])
        plots.objective_curves(tmp / VALIDATION_PLOTS["objective"], fig["logs"], fig["outcome_label"])
        (tmp / VALIDATION_FILE).write_text(json.dumps(result.report, indent=2, default=_json_default) + "\n")

    return write_dir(out, writer, overwrite=overwrite)


def _json_default(obj):
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def validation_summary_lines(report: dict) -> list[str]:
    """The CLI's table: each ranking's AUROC (q = 0.99), precision@1% and module Spearman."""
    rows = [("fisher (F / bound)", report)] + [(k, v) for k, v in report["baselines"].items()]
    if "auroc" in report.get("adam_aware", {}):
        rows.append(("adam-aware SNR (beyond the bound)", report["adam_aware"]))
    lines = [f"{'ranking':<34} {'AUROC@q0.99':>11} {'AUROC@q0.9':>10} {'prec@1%':>8} {'module rho':>10}"]
    for label, e in rows:
        if "auroc" not in e:
            lines.append(f"{label:<34} unavailable: {e.get('unavailable', '')}")
            continue
        rho = e["spearman_modules"]
        rho = rho["sum_sqrt_fisher"] if isinstance(rho, dict) else rho
        lines.append(f"{label:<34} {_fmt(e['auroc']['q0.99']):>11} {_fmt(e['auroc']['q0.9']):>10} "
                     f"{_fmt(e['precision_at_k'][str(TOP_K[1])]):>8} {_fmt(rho):>10}")
    sm = report["spearman_modules"]
    lines.append(f"module aggregates vs module movement: sum sqrt(F) rho = {_fmt(sm['sum_sqrt_fisher'])}, "
                 f"sum F rho = {_fmt(sm['sum_fisher'])} (chosen: {sm['chosen']})")
    fs = report["first_step"]
    if fs.get("violation_rate") is None:
        lines.append(f"first-step check: not applicable ({fs.get('reason')})")
    else:
        lines.append(f"first-step check: {fs['violation_rate']:.2e} of coordinates above the bound "
                     f"({fs['violation_rate_beyond_rounding']:.2e} beyond fp32 rounding); noise alone: "
                     f"{fs['noise_violation_rate']:.2e}")
    steps = report.get("auroc_by_step", {}).get("q0.99")
    if steps:
        lines.append("F AUROC@q0.99 after each step: " + ", ".join(_fmt(x) for x in steps))
    lost = report["movement_summary"]["main"].get("bf16_lost_share")
    if lost is not None:
        lines.append(f"bf16: {lost:.1%} of the moved coordinates' updates would round away in bf16 weights "
                     "(fp32 master weights keep them)")
    return lines + masked_lines(report)


def masked_lines(report: dict) -> list[str]:
    """The masked fine-tuning table: each mask's density, trainable count, held-out objective and share recovered."""
    masked = report["training_outcome"].get("masked_fine_tuning")
    if not masked:
        return []
    lines = [f"masked fine-tuning (held-out {report['training_outcome']['held_out_metric'].split(',')[0]}: "
             f"before {masked['before']:.4f}, full fine-tuning {masked['full_fine_tuning']:.4f}; "
             f"recovered = {masked['recovered']})",
             f"{'mask':<10} {'density':>8} {'trainable':>11} {'held-out after':>14} {'recovered':>9} "
             f"{'over seeds (min..max)':>22}"]
    for r in masked["runs"]:
        spread = r.get("recovered_spread")
        spread = f"{_fmt(spread['min'])}..{_fmt(spread['max'])}" if spread else "one seed"
        lines.append(f"{r['mask']:<10} {r['density']:>8.4f} {r['trainable']:>11,} {r['after']:>14.4f} "
                     f"{_fmt(r['recovered']):>9} {spread:>22}")
    return lines


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"
