"""`fisher-select validate`: train for real from the calibration point and measure what moved.

``validate(run, steps, optimizer, lr, weight_decay, seed)`` loads the run's model (fp32 master
weights) and recipe, trains with the run's primary objective (``studies.loop``), records the
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
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fisher_select.atomic import check_dir_target, write_dir
from fisher_select.calibration.objectives.base import Context, Objective
from fisher_select.calibration.prompts import PromptRecord, check_disjoint, load_prompts
from fisher_select.recipe import build_objectives, parse_recipe
from fisher_select.errors import FisherSelectError
from fisher_select.models import check_fingerprint, load_model
from fisher_select.run.io import write_json
from fisher_select.run.load import Run, load_run
from fisher_select.run.names import VALIDATION_FILE, VALIDATION_PLOTS, validation_dir
from fisher_select.run.validation import ValidationRecord
from fisher_select.stats.bounds import coordinate_bound, module_masses
from fisher_select.stats.correlation import spearman
from fisher_select.stats.naming import module_of
from fisher_select.stats.ranking import global_top_masks
from fisher_select.studies import baselines, plots
from fisher_select.studies.first_step import minibatch_snr, row_score_sums, sgd_step, split_half_gradient
from fisher_select.studies.loop import Streams, TrainConfig, backward, make_task, train
from fisher_select.studies.metrics import Realized, Subsample, first_step_check, ranking_metrics
from fisher_select.studies.movement import LazyMovement, bf16_lost, gradients, load_snapshot, movement, snapshot
from fisher_select.studies.rankings import CURVE_FRACTIONS, Reduced, Rankings, auroc_by_step, reduce

# Offsets of the random streams derived from the seed (each use gets its own, all reproducible).
FIRST_STEP_STREAM, SINGLE_BATCH_STREAM, EVAL_STREAM, METRIC_STREAM, MASK_STREAM = (
    1_000_003, 1_000_033, 1_000_037, 1_000_039, 1_000_081)


@dataclass
class ValidationConfig:
    """What to measure besides the main run."""

    subsample: int | None = 2_000_000  # coordinates scored (None: all of them)
    second_seed: bool = True  # a second run with seed + 1: how well one run predicts another
    first_step_prompts: int | None = None  # the first-step batch (default 2 x prompts_per_step), in two halves
    eval_prompts: int = 8  # held-out prompts after the calibration's, for the training outcome
    mask_densities: tuple[float, ...] = ()  # masked fine-tuning: fisher / random / magnitude at these, + Spectrum
    mask_seeds: int = 1  # masked fine-tuning repeated over seeds seed .. seed + n - 1: its spread over seeds
    sparse_masks: bool = False  # masked fine-tuning through the sparse-delta mode (training.sparse), as users run it
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
    record: ValidationRecord  # validation.json
    figures: dict  # data of the plots
    out: Path | None = None

    @property
    def report(self) -> dict:
        """Deprecated (one release): validation.json as a dict; use ``record`` (or ``record.to_json()``)."""
        return self.record.to_json()


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
        record, figures = self._assemble(main, second, single, adam, first, first_rows, before, masked)
        if main["summary"]["max"] == 0:
            record.caveats.insert(0, "no coordinate moved: the training signal was zero on every step (e.g. "
                                     "all rewards of each prompt equal); the metrics are undefined")
        record.elapsed_s = time.time() - started
        return ValidationResult(record, figures)

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
                "mode": "sparse delta (training.sparse)" if self.options.sparse_masks else "dense (apply_masks)",
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
        scores = self.sub.take(self.fisher)  # (M,)
        masses = module_masses(self.fisher)
        modules = sorted(moved.modules)
        target = [moved.modules[m] for m in modules]
        self.realized = Realized(moved.sub, CURVE_FRACTIONS, seed)  # the moved sets, once for every ranking
        metrics, curve = ranking_metrics(scores, self.realized, seed + 1, CURVE_FRACTIONS)
        rho_root = spearman([masses[m].bound_mass for m in modules], target)
        rho_mass = spearman([masses[m].fisher_mass for m in modules], target)
        chosen = "bound_mass" if (rho_root or -2) >= (rho_mass or -2) else "fisher_mass"
        rankings = Rankings(self.sub, self.realized, moved, seed, {"fisher": curve})
        curves = rankings.curves
        base = rankings.baselines(self.theta0, self.model, single, second)
        record = ValidationRecord(
            run_id=self.run.run_id, model=self.run.report.model.name,
            objective={"name": self.setup.objective.name, "type": self.setup.objective.kind},
            settings={**dataclasses.asdict(self.settings), **dataclasses.asdict(self.options),
                      "first_step_rows": first_rows},
            training={"estimator": self.task.description, "weights": "fp32 master weights, eval mode (no dropout)",
                      "movement": "|theta_T - theta_0| per coordinate in fp32 after all steps",
                      "moved": "AUROC: above the q-quantile of realized movement; precision/recall@k: against "
                               "the realized top 1%; jaccard@k: predicted vs realized top-k"},
            subsample=self.sub.describe(self.settings.seed),
            ranking="the run's F (fisher.safetensors; for one objective the bound sqrt(F S) ranks identically)",
            metrics=metrics,
            spearman_modules={"bound_mass": rho_root, "fisher_mass": rho_mass, "chosen": chosen,
                              "modules": len(modules),
                              "meaning": "Spearman over modules of the aggregate (bound mass: sum of sqrt(F); "
                                         "Fisher mass: sum of F) against module movement (sum of |delta| over "
                                         "the module's coordinates)"},
            module_table=[{"module": m, "fisher_mass": masses[m].fisher_mass, "bound_mass": masses[m].bound_mass,
                           "movement": moved.modules[m]} for m in modules],
            auroc_by_step=auroc_by_step(scores, main["by_step"]),
            first_step=first, training_outcome=self._outcome(main, second, before, masked), baselines=base,
            adam_aware=rankings.adam(adam),
            movement_summary={"main": main["summary"], "second_seed": second["summary"] if second else None},
            caveats=_caveats(self.run, self.setup, self.settings, self.logs))
        scale, _ = self._scale()
        bound_sub = coordinate_bound({"x": scores}, scale)["x"]
        scale_known = scale is not None
        figures = {"bound": bound_sub, "moved": moved.sub, "curves": curves, "logs": dict(self.logs),
                   "bound_label": "bound sqrt(F S)" if scale_known else "sqrt(F) (S unknown)",
                   "outcome_label": self.task.outcome_name}
        return record, figures

    def _outcome(self, main, second, before, masked) -> dict:
        runs = {"main": {"seed": main["seed"], "per_step": main["log"], "held_out_after": main["after"]}}
        if second is not None:
            runs["second_seed"] = {"seed": second["seed"], "per_step": second["log"], "held_out_after": second["after"]}
        return {"per_step_metric": f"{self.task.outcome_name}, on each step's own batch (before its update)",
                "held_out_metric": f"{self.task.outcome_name}, on the held-out prompts (on-policy: K samples each, fixed seed)",
                "held_out_prompts": len(self.setup.eval_prompts), "held_out_disjoint": self.setup.eval_disjoint,
                "held_out_before": before, "runs": runs, "masked_fine_tuning": masked}


def _caveats(run: Run, setup: Setup, settings: TrainConfig, logs: dict[str, list[dict]]) -> list[str]:
    """What the reader of validation.json must keep in mind about this run's measurements."""
    out = ["The bound is for the expected gradient at the calibration point, one step; realized movement "
           "over several steps also reflects sampling noise and the parameters' drift."]
    if settings.optimizer == "adamw":
        out.append("AdamW divides by a running RMS: over a few steps almost every coordinate with a nonzero "
                   "gradient moves by about lr, so a ranking by F or |g| is not expected to predict its "
                   "movement (see auroc; the Adam-aware ranking is measured beside it, under adam_aware). "
                   "Module movement then tracks module size: even the random ranking's module sums "
                   "correlate with it (baselines.random.spearman_modules). Whether a mask still trains "
                   "well is measured separately (training_outcome.masked_fine_tuning).")
    if settings.weight_decay > 0:
        out.append(f"weight decay {settings.weight_decay} moves every coordinate by about lr*wd*|theta|, "
                   "independently of its gradient.")
    if len(run.objectives) > 1:
        out.append(f"trained on the primary objective {setup.objective.name!r} only; the run has "
                   f"{len(run.objectives)} objectives")
    silent = sum(e["rows"] - e["rows_with_signal"] for log in logs.values() for e in log)
    total = sum(e["rows"] for log in logs.values() for e in log)
    if total and silent > total / 2:
        out.append(f"{silent} of {total} training rows carried no signal (e.g. every reward of their prompt "
                   "equal): movement rests on few samples, so every ranking's metrics are noisy")
    cut = run.report.truncation_rate
    if cut > 0.1:
        out.append(f"{cut:.0%} of the calibration's responses were cut at max_new_tokens: F describes the "
                   "truncated distribution")
    if not setup.eval_disjoint:
        out.append("no prompt was left after the calibration's: the held-out outcome reuses the training prompts")
    return out


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
        write_json(tmp / VALIDATION_FILE, result.record.to_json())

    return write_dir(out, writer, overwrite=overwrite)
