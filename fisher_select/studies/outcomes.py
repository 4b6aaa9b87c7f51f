"""The matched-budget outcome study, protocol 1: how much of full fine-tuning's held-out gain each selection recovers.

Deprecated: its results are withdrawn (one calibration, seeds that only reorder batches, grids that
stop at their edges); protocol 2 is ``fisher_select.studies`` (docs/OUTCOMES.md). Kept for one release.

``outcome_study(run, OutcomeConfig(...))`` trains the run's objective (``studies.loop``) from the
calibration point with every method of ``METHODS`` and full fine-tuning as the reference:

- masks at each density from the bound (F ranks as ``sqrt(F S)``), from ``|g_hat|`` (the run's own
  Monte Carlo gradient estimate, ``grad_estimate.safetensors``), from single-batch ``|grad|`` (SIFT's
  rule: the first training batch of that seed), random and ``|theta|``; trained through the
  sparse-delta mode (``train(..., sparse=True)``), as users run them;
- module choices at their own share: Spectrum's (top 50% per type by weight SNR + head and
  embeddings) and KappaTune's (PEFT's ``find_kappa_target_modules``);
- LoRA at equal trainable parameters: ``lora_config`` (targets + ``rank_pattern``), then PEFT
  ``all-linear`` and attention-only with the largest uniform rank whose count does not exceed it;
  SHiRA with the Fisher mask against SHiRA's random mask, same targets and r (the same count).

Every method gets its own learning rate: the grid is full fine-tuning's chosen lr times
``lr_multipliers``; full fine-tuning's own lr is chosen the same way from ``base_lr`` times
``full_lr_multipliers``. The lr with the best mean over seeds on the *validation* prompts is
chosen; the *held-out* prompts (disjoint from it and from training) are only reported. A method's
share recovered, per seed, is ``(after - before) / (full_after - before)`` on the held-out prompts,
against full fine-tuning with the same seed at its chosen lr.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from scipy import stats as sps

from fisher_select.calibration.objectives.base import Context
from fisher_select.calibration.prompts import check_disjoint
from fisher_select.atomic import write_file
from fisher_select.errors import FisherSelectError
from fisher_select.report.build import regenerate
from fisher_select.run.io import write_json
from fisher_select.run.load import Run, load_run, load_run_report
from fisher_select.run.names import OUTCOMES_FILE, OUTCOMES_PLOT, outcomes_dir
from fisher_select.studies import plots
from fisher_select.studies.loop import OnPolicyTask, TrainConfig, make_task, train
from fisher_select.studies.movement import load_snapshot, snapshot
from fisher_select.studies.outcome_methods import (ADAPTER_METHODS, MASK_METHODS, METHODS, MODULE_METHODS, Method,
                                                   Selections, attention_modules, uniform_rank)
from fisher_select.studies.validate import EVAL_STREAM, Setup, load_setup, recovered_share

# Imported from here by bench/outcomes.py and the tests (they lived here before outcome_methods.py).
__all__ = ["ADAPTER_METHODS", "KINDS", "MASK_METHODS", "METHODS", "MODULE_METHODS", "Method", "OutcomeConfig",
           "attention_modules", "check_kind", "choose_lr", "keep_in_run", "outcome_study", "split_prompts",
           "uniform_rank", "write_outcomes"]

KINDS = ("sft", "rl", "opd-pg", "opd-full")


@dataclass
class OutcomeConfig:
    """What the study trains, at which budgets, learning rates and seeds."""

    densities: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 0.1)
    lr_multipliers: tuple[float, ...] = (1.0, 3.0, 10.0, 30.0)  # x full fine-tuning's chosen lr
    base_lr: float = 1e-5
    full_lr_multipliers: tuple[float, ...] = (0.3, 1.0, 3.0)  # full fine-tuning's own sweep, x base_lr
    steps: int = 8
    seeds: int = 3  # seeds seed .. seed + seeds - 1
    seed: int = 0
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    methods: tuple[str, ...] = METHODS
    validation_prompts: int = 8  # chooses the lr
    heldout_prompts: int = 8  # reported
    sparse: bool = True  # masks through the sparse-delta mode (training.sparse)
    lora_mean_rank: int = 8  # lora_config's rank budget per target
    shira_r: int = 32
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    max_new_tokens: int | None = None  # None: the run's
    batch_size: int = 8
    calibration_seconds: float | None = None  # the calibration's wall time, when known (report.json has none)

    def problems(self) -> list[str]:
        out = [f"density {d} is not in (0, 1)" for d in self.densities if not 0 < d < 1]
        out += [f"lr multiplier {m} is not positive" for m in (*self.lr_multipliers, *self.full_lr_multipliers)
                if not m > 0]
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            out.append(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
        for name in ("seeds", "validation_prompts", "heldout_prompts", "lora_mean_rank", "shira_r"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.lr_multipliers or not self.full_lr_multipliers:
            out.append("lr_multipliers and full_lr_multipliers need at least one value each")
        return out


def outcome_study(run, config: OutcomeConfig | None = None, *, setup: Setup | None = None,
                  grad_estimate: dict | None = None, device: str = "cpu", progress: bool = False) -> dict:
    """Train every method of ``config`` from the run's calibration point; the study's JSON dict.

    ``setup``: model, tokenizer, objective and prompts (default: loaded from the run; its
    ``eval_prompts`` are split into validation then held-out). ``grad_estimate``: the run's
    ``|g_hat|`` source (default: the run directory's gradient-estimate file).
    """
    run = load_run(run)
    config = config or OutcomeConfig()
    settings = _settings(run, config, config.base_lr, config.seed)
    problems = config.problems() + settings.problems()
    if problems:
        raise FisherSelectError("invalid outcome-study settings: " + "; ".join(problems))
    setup = setup or load_setup(run, device, config.validation_prompts + config.heldout_prompts)
    return _Study(run, setup, config, grad_estimate, progress).measure()


def _settings(run: Run, config: OutcomeConfig, lr: float, seed: int) -> TrainConfig:
    tokens = config.max_new_tokens or run.report.max_new_tokens or 32
    return TrainConfig(config.steps, config.optimizer, lr, config.weight_decay, seed, config.prompts_per_step,
                       config.samples_per_prompt, tokens, config.batch_size)


def split_prompts(setup: Setup, validation: int, heldout: int) -> tuple[list, list]:
    """(validation, held-out) prompts: the first ``validation`` prompts after training's, then ``heldout``."""
    if not setup.eval_disjoint:
        raise FisherSelectError("the study needs prompts beyond the calibration's (validation and held-out must "
                                "be disjoint from training); calibrate fewer prompts or add prompts to the file")
    if len(setup.eval_prompts) < validation + heldout:
        raise FisherSelectError(f"the study needs {validation} validation + {heldout} held-out prompts after the "
                                f"training prompts, but only {len(setup.eval_prompts)} are left; lower "
                                "validation_prompts / heldout_prompts")
    chosen = setup.eval_prompts[:validation], setup.eval_prompts[validation : validation + heldout]
    check_disjoint({"training": setup.prompts, "validation": chosen[0], "held-out": chosen[1]})
    return chosen


def choose_lr(validation_by_lr: dict[float, list[float]], higher_is_better: bool) -> float:
    """The lr whose mean validation outcome over seeds is best (ties: the smaller lr)."""
    sign = 1.0 if higher_is_better else -1.0
    return max(sorted(validation_by_lr), key=lambda lr: (sign * statistics.fmean(validation_by_lr[lr]), -lr))


class _Study:
    """One study: the model at theta_0, its task, the splits and the runs' results."""

    def __init__(self, run: Run, setup: Setup, config: OutcomeConfig, grad_estimate, progress: bool):
        self.run, self.setup, self.config, self.progress = run, setup, config, progress
        self.validation, self.heldout = split_prompts(setup, config.validation_prompts, config.heldout_prompts)
        self.seeds = [config.seed + i for i in range(config.seeds)]
        self.base = _settings(run, config, config.base_lr, config.seed)
        self.task = self._task_on(setup.model)
        self.theta0 = snapshot(setup.model)
        self.total = sum(t.numel() for t in self.theta0.values())
        self.logs: list[list[dict]] = []
        self.selections = Selections(self, grad_estimate)

    def _task_on(self, model):
        """The run's objective as a task on ``model``; a teacher loaded from elsewhere is reused, not reloaded."""
        objective = copy.copy(self.setup.objective)  # prepare() binds a 'self' teacher to this model only
        teacher = getattr(self.setup.objective, "teacher", None)
        if teacher is not None and teacher.model is not self.setup.model:
            objective.spec = teacher
        ctx = Context(model, self.setup.tokenizer, self.setup.device)
        return make_task(objective, ctx, self.setup.prompts, self.base.samples_per_prompt, self.base.max_new_tokens)

    def measure(self) -> dict:
        started = time.time()
        before = {"validation": self._evaluate(self.task, self.validation),
                  "held_out": self._evaluate(self.task, self.heldout)}
        full = self._full(before)
        methods = {}
        for method in self.selections.methods():
            methods[_key(method)] = self._method_entry(method, before, full)
        load_snapshot(self.setup.model, self.theta0)
        return self._report(before, full, methods, time.time() - started)

    # -- training runs ----------------------------------------------------------------------------

    def _evaluate(self, task, records) -> float:
        # one fixed sampling seed for every evaluation: before and after share their sampling noise
        return task.evaluate(records, self.config.seed + EVAL_STREAM, self.base.batch_size)

    def _run(self, method: Method | None, lr: float, seed: int) -> dict:
        """One training run from theta_0: its validation and held-out outcome after training."""
        load_snapshot(self.setup.model, self.theta0)
        settings = dataclasses.replace(self.base, lr=lr, seed=seed)
        model, task, masks = self.setup.model, self.task, None
        if method is not None and method.adapter is not None:
            model = method.adapter(seed, copy.deepcopy(self.setup.model))
            task = self._task_on(model)
        elif method is not None:
            masks = method.masks(seed)
        task.restart()  # same seed, same batches, whatever ran before
        label = f"{method.name if method else 'full'} lr {lr:.3g} seed {seed}"
        started = time.time()
        log = train(model, task, settings, masks=masks, sparse=masks is not None and self.config.sparse,
                    progress=self.progress, desc=label)
        seconds = time.time() - started
        out = {"validation": self._evaluate(task, self.validation), "held_out": self._evaluate(task, self.heldout),
               "seconds": seconds, "log": log}
        load_snapshot(self.setup.model, self.theta0)
        return out

    def _sweep(self, method: Method | None, grid: list[float]) -> dict:
        """Every lr of the grid over every seed; the lr chosen on validation and its held-out outcomes."""
        runs = {lr: [self._run(method, lr, s) for s in self.seeds] for lr in grid}
        chosen = choose_lr({lr: [r["validation"] for r in rs] for lr, rs in runs.items()}, self.task.higher_is_better)
        return {"lr_grid": grid, "lr_chosen": chosen,
                "lr_sweep": [{"lr": lr, "validation": [r["validation"] for r in rs],
                              "held_out": [r["held_out"] for r in rs]} for lr, rs in runs.items()],
                "held_out_after": [r["held_out"] for r in runs[chosen]],
                "validation_after": [r["validation"] for r in runs[chosen]],
                "training_seconds": sum(r["seconds"] for rs in runs.values() for r in rs),
                "logs": [r["log"] for r in runs[chosen]]}

    def _full(self, before: dict) -> dict:
        sweep = self._sweep(None, [self.config.base_lr * m for m in self.config.full_lr_multipliers])
        self.logs = sweep.pop("logs")
        sign = 1.0 if self.task.higher_is_better else -1.0
        gains = [sign * (a - before["held_out"]) for a in sweep["held_out_after"]]  # > 0: better
        return {"kind": "full", "density": 1.0, "trainable": self.total, "seeds": self.seeds,
                "held_out_before": before["held_out"], "validation_before": before["validation"], **sweep,
                "improvement": gains, "improvement_mean": statistics.fmean(gains),
                "improvement_std": statistics.stdev(gains) if len(gains) > 1 else None,
                "improvement_z": _z(gains)}

    def _method_entry(self, method: Method, before: dict, full: dict) -> dict:
        entry = {"method": method.name, "kind": method.kind, "density": method.density, "requested": method.requested,
                 "trainable": method.trainable, "notes": method.notes}
        if method.unavailable:
            return entry | {"unavailable": method.unavailable}
        sweep = self._sweep(method, [full["lr_chosen"] * m for m in self.config.lr_multipliers])
        sweep.pop("logs")
        shares = [recovered_share(before["held_out"], a, f)
                  for a, f in zip(sweep["held_out_after"], full["held_out_after"])]
        known = [s for s in shares if s is not None]
        return entry | {"seeds": self.seeds, **sweep, "recovered": shares,
                        "recovered_mean": statistics.fmean(known) if len(known) == len(shares) else None,
                        "recovered_std": statistics.stdev(known) if len(known) == len(shares) > 1 else None,
                        "selection_seconds": method.selection_seconds}

    # -- the report -------------------------------------------------------------------------------

    def _report(self, before: dict, full: dict, methods: dict, elapsed: float) -> dict:
        on_policy = isinstance(self.task, OnPolicyTask)
        rows = [e for log in self.logs for e in log]
        sampled = sum(e["rows"] for e in rows)
        signal = sum(e["rows_with_signal"] for e in rows) / sampled if on_policy and sampled else None
        finished = [e["finished"] for e in rows if e.get("finished") is not None]
        report = self.run.report
        return {
            "kind": self.setup.objective.kind,
            "task": {"recipe": report.recipe, "config": report.config, "objective": self.setup.objective.name,
                     "estimator": self.task.description, "metric": self.task.outcome_name,
                     "higher_is_better": self.task.higher_is_better, "run_id": self.run.run_id,
                     "model": report.model.name},
            "settings": dataclasses.asdict(self.config) | {"max_new_tokens": self.base.max_new_tokens},
            "splits": {"train_prompts": len(self.setup.prompts), "validation_prompts": len(self.validation),
                       "held_out_prompts": len(self.heldout),
                       "rule": "validation and held-out prompts follow the training prompts in the prompt file, "
                               "disjoint; the lr is chosen on validation, only held-out is reported"},
            "signal_share": signal, "finished_share": sum(finished) / sampled if finished and sampled else None,
            "shares_meaning": "over full fine-tuning's training batches at its chosen lr: rows with a nonzero "
                              "training signal, responses that ended before max_new_tokens (None: SFT, no sampling)",
            "full": full, "methods": methods,
            "selection_seconds": {"calibration": self.config.calibration_seconds,
                                  "per_method": {k: m.get("selection_seconds") for k, m in methods.items()},
                                  "meaning": "the calibration's wall time (the bound, |g_hat|, lora_config and "
                                             "shira_fisher need it; None: not given) beside each method's own "
                                             "selection (building its masks or adapters)"},
            "training_seconds": {"full_per_run": full["training_seconds"] / (len(full["lr_grid"]) * len(self.seeds)),
                                 "per_method": {k: m.get("training_seconds") for k, m in methods.items()},
                                 "total": full["training_seconds"] + sum(m.get("training_seconds") or 0
                                                                         for m in methods.values())},
            "recovered_meaning": "(after - before) / (full_after - before) of the held-out outcome, per seed against "
                                 "full fine-tuning with the same seed at its chosen lr",
            "elapsed_s": elapsed,
        }


def _key(method: Method) -> str:
    return f"{method.name}@{method.requested:g}" if method.kind == "mask" else method.name


def _z(gains: list[float]) -> float | None:
    """One-sample t statistic of the improvement over seeds (None: one seed, or no spread)."""
    if len(gains) < 2 or statistics.stdev(gains) == 0:
        return None
    return float(sps.ttest_1samp(gains, 0.0).statistic)


def check_kind(run_dir, kind: str) -> None:
    """Refuse, before any training, a run whose primary objective is not the kind asked for."""
    found = load_run_report(run_dir).objectives[0].type
    if found != kind:
        raise FisherSelectError(f"run {run_dir} was calibrated for a {found!r} objective, not {kind!r}; "
                                f"calibrate the {kind} recipe (docs/OUTCOMES.md)")


def write_outcomes(report: dict, json_path=None, plot_path=None, *, overwrite: bool = True) -> None:
    """The study's JSON and its recovery-vs-density plot, each written atomically (``keep_in_run``
    puts them where the run's report finds them)."""
    if json_path is not None:
        write_file(Path(json_path), lambda tmp: write_json(tmp, report), overwrite=overwrite)
    if plot_path is not None:
        write_file(Path(plot_path), lambda tmp: plots.recovery_curves(tmp, report), overwrite=overwrite)


def keep_in_run(report: dict, run_dir) -> Path:
    """Write the study into ``RUN/outcomes-<kind>/`` and redraw the run's report, which then shows it."""
    folder = outcomes_dir(run_dir, report["kind"])
    folder.mkdir(exist_ok=True)
    write_outcomes(report, folder / OUTCOMES_FILE, folder / OUTCOMES_PLOT)
    regenerate(run_dir)
    return folder
