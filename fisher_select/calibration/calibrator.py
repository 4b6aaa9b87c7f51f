"""The calibration pass: sample from the model, score every sample exactly, estimate F, S, g, bounds.

For each batch of prompt groups (K responses per prompt, plain ancestral sampling), every
objective turns its group into signals a_n; one scoring pass (``score_sums``) adds the exact
per-sample squared scores (shared Fisher), the signal-weighted scores of every objective and
the plain score sums. At the end everything is divided by the number of samples.

One loop (``_Calibrator``) runs in every mode; how the work is spread over processes (one, data
parallel, FSDP) is a ``calibration.parallel`` object chosen once. Its parts: ``batches`` (groups,
signals, rows, records), ``token_level`` (F^tok), ``stability`` (split halves), ``checkpoint``
(the typed ``CalibrationState``), ``result`` (``Calibration``), ``engine.reference`` (the
first-batch check against plain autograd).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import warnings

import torch
from tqdm.auto import tqdm

from fisher_select.caveats import ZERO_SCALE_WARNING
from fisher_select.calibration import batches, parallel
from fisher_select.calibration.batches import Batch, Groups
from fisher_select.calibration.budget import check_memory, estimate_memory, sampling_rows
from fisher_select.calibration.checkpoint import CalibrationState, CheckpointConfig, Checkpointer, digest, read_state
from fisher_select.calibration.objectives import Context, Objective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.calibration.result import (Calibration, CalibrationDiagnostics, ObjectiveResult,  # noqa: F401
                                              build_result, calibration_diagnostics, score_mean_summary)
from fisher_select.calibration.rollouts import Rollouts, mismatch_summary
from fisher_select.calibration.sampling import eos_ids_of, pad_id_of, pad_rows
from fisher_select.calibration.config import CalibrationConfig, SamplingConfig
from fisher_select.calibration.stability import Stability
from fisher_select.calibration.token_level import TokenLevel
from fisher_select.distributed import seed_for_rank
from fisher_select.engine.batching import auto_max_tokens, score_in_budget
from fisher_select.engine.memory import MemoryMode
from fisher_select.engine.reference import verify_against_autograd  # noqa: F401  (its old home; tests import it)
from fisher_select.engine.rules import guard_model
from fisher_select.engine.scoring import Coverage, ScoreSums, plan_coverage
from fisher_select.engine.selfcheck import check_rules
from fisher_select.errors import DegenerateResultWarning, FisherSelectError


SELFCHECK_ROWS = 2  # rows of the first batch the rules are checked on: a backward each


def calibrate(
    model,
    tokenizer,
    prompts: list[PromptRecord],
    objective: Objective | list[Objective],
    config: CalibrationConfig | None = None,
    *,
    sampling: SamplingConfig | None = None,
    progress: bool = True,
    verify: bool = True,
    rollouts: Rollouts | None = None,
    checkpoint: CheckpointConfig | None = None,
    log=None,
    **fields,
) -> Calibration:
    """Estimate the model Fisher from the model's own samples and each objective's signal scale.

    ``config`` (a ``CalibrationConfig``: samples per prompt, response length, seed, batch size,
    memory mode, stability diagnostics; every field's meaning is its help text) may be given whole,
    or field by field as keyword arguments (``samples_per_prompt=8``), which override it; an unknown
    or invalid field is one ``FisherSelectError`` listing every problem.

    ``objective`` may be a list: F is computed once, each objective gets its own S and gradient
    estimate. Objective instances hold no statistics (the calibration does), so one may be used
    in several calibrations. ``prepare(ctx, prompts)`` runs before sampling (load a teacher,
    check its data against the prompts; raise FisherSelectError). An objective with
    ``extra_rows(ctx)`` (SFT from demonstrations) gets those rows scored here, with this
    calibration's coverage, and ``extra_result(mean_score, fisher)`` turns their mean score into
    its gradient estimate and summary fields. ``verify`` checks the engine against plain autograd
    on the first batch scored: the rules' per-sample sums on its first rows (``checks["selfcheck"]``,
    ``engine.selfcheck``: every memory mode; under ``shard: fsdp`` ``calibration.fsdp.wrap`` runs it
    before sharding), and with ``accumulators=full`` its score sums too (``checks["autograd"]``:
    catches a parameter used outside its module, which no hook could see); a mismatch is one error
    naming the module. What a reduced memory mode lacks is listed in ``checks["memory"]["missing"]``
    (report warnings), never a crash.
    ``rollouts`` (``rollouts.load_rollouts``): score these responses instead of sampling; their prompts
    and K replace ``prompts`` and ``samples_per_prompt`` (``checks["rollouts"]``: the on-policy check).
    ``checkpoint``: write the state every ``checkpoint.every`` batches and, with ``resume``, continue from
    the newest checkpoint (``calibration.checkpoint``; bit-identical to an uninterrupted pass on the CPU).
    ``log(line)``: called once per phase (sampling done, scoring done, checks) with its numbers, for runs
    without progress bars (``calibrate --no-progress``).
    """
    config = CalibrationConfig.with_fields(config, fields)
    objectives = objective if isinstance(objective, list) else [objective]
    prompts, config = resolve_inputs(prompts, objectives, config, sampling or SamplingConfig(), rollouts)
    was_training = model.training
    model.eval()
    try:
        with guard_model(model):  # layers stay differentiable while sampling (bitsandbytes)
            cal = _Calibrator(model, tokenizer, objectives, config, progress, verify, rollouts=rollouts,
                              checkpoint=checkpoint, log=log).execute(prompts)
    finally:
        model.train(was_training)
    if cal is not None:  # None: a rank other than 0 under shard: fsdp
        _warn_degenerate(cal)
    return cal


def _warn_degenerate(cal: Calibration) -> None:
    """S = 0 for an objective with a known scale: every bound is 0. Said in ``cal.warnings`` and once through
    ``warnings.warn``, since a Python caller may never write or read a report."""
    for o in cal.objectives:
        if o.signal_scale == 0.0:
            cal.warnings.append(f"({o.name}) {ZERO_SCALE_WARNING}")
    if cal.warnings:
        warnings.warn("; ".join(cal.warnings), DegenerateResultWarning, stacklevel=3)


def resolve_inputs(prompts: list[PromptRecord] | None, objectives: list[Objective], config: CalibrationConfig,
                   sampling: SamplingConfig | None, rollouts: Rollouts | None = None
                   ) -> tuple[list[PromptRecord], CalibrationConfig]:
    """The prompts and settings a calibration runs with, checked (every problem as one error, before any model work).

    ``rollouts``: the file's prompts and K replace ``prompts`` and ``samples_per_prompt`` (its responses are not
    sampled, so ``sampling`` is not checked); ``sampling=None``: checked already (a recipe checks it when it loads).
    ``calibrate`` calls this; a job that loads a model calls it first, to refuse before minutes of loading.
    """
    if rollouts is not None:
        prompts, sampling = rollouts.prompts, None
        config = dataclasses.replace(config, samples_per_prompt=rollouts.k)
    check_inputs(prompts, objectives, config.samples_per_prompt, sampling)
    return prompts, config


def check_inputs(prompts, objectives, k, sampling: SamplingConfig | None) -> None:
    """Every problem with the calibration settings, as one error (before any model work).

    ``sampling=None``: its settings were checked already (a recipe checks them when it loads).
    """
    problems = sampling.problems() if sampling is not None else []
    if not prompts:
        problems.append("no prompts to calibrate on")
    for o in objectives:
        if k < o.min_samples_per_prompt:
            problems.append(
                f"objective {o.name!r} needs samples_per_prompt >= {o.min_samples_per_prompt} "
                f"(got {k}): its signal is centred by the other samples of the same prompt"
            )
    names = [o.name for o in objectives]
    if len(set(names)) != len(names):
        problems.append(f"objective names must be unique, got {names}")
    if problems:
        raise FisherSelectError("; ".join(problems))




class _Calibrator:
    """One calibration pass, in every mode: batches sampled (or read) and scored into the sums, checkpoints,
    the ranks' merge (``parallel``: one process, data parallel or fsdp, chosen once), the result."""

    def __init__(self, model, tokenizer, objectives, config: CalibrationConfig, progress: bool, verify: bool,
                 rollouts: Rollouts | None = None, checkpoint: CheckpointConfig | None = None, log=None):
        self.log, self.announce = log or (lambda line: None), log or (_bar_line if progress else None)
        self.clock = {"sampling": 0.0, "scoring": 0.0, "tokens": 0, "samples": 0}  # this process's phases
        self.model, self.objectives, self.config, self.rollouts = model, objectives, config, rollouts
        self.checkpoint, self.progress = checkpoint, progress
        self.ckpt: Checkpointer | None = None  # opened when the batches start (its key needs the rendered prompts)
        self.k, self.batch_size = config.samples_per_prompt, config.batch_size
        self.groups_per_batch = max(1, self.batch_size // self.k)
        rows = self.groups_per_batch * self.k  # K > batch size: one prompt's K rows, sampled and scored in chunks
        self.sample_rows, self.score_rows = sampling_rows(rows, self.batch_size), min(rows, self.batch_size)
        # rows x padded length of one scoring pass; signals are known per row before scoring, so any split is exact
        self.max_tokens = config.max_batch_tokens or auto_max_tokens(model)
        self.engine = {"max_tokens": self.max_tokens, "compile": config.compile}  # every scoring call's settings
        self.device = next(model.parameters()).device
        self.memory = MemoryMode(config.accumulators, config.modules, config.accumulate_on)
        whole = plan_coverage(model)
        self.cov: Coverage = self.memory.restrict(whole)  # only the parameters the memory mode keeps
        self.checks: dict = {"memory": {**self.memory.describe(),
                                        "missing": self.memory.missing(self.cov, len(whole.shapes))}}
        pad = pad_id_of(model, tokenizer)
        self.parallel = parallel.choose(model, config, objectives, checkpoint, cov=self.cov, memory=self.memory,
                                        engine=self.engine, device=self.device, score_rows=self.score_rows, pad=pad)
        self.verify = verify
        checked = self.parallel.selfcheck() if verify else None  # fsdp: checked on the full model before sharding
        if checked is not None:
            self.checks["selfcheck"] = checked
        self.generator = torch.Generator(device=self.device).manual_seed(seed_for_rank(config.seed,
                                                                                       self.parallel.rank))
        self.groups = Groups(model, tokenizer, k=self.k, max_new_tokens=config.max_new_tokens,
                             sample_rows=self.sample_rows, generator=self.generator, eos=eos_ids_of(model, tokenizer),
                             pad=pad, device=self.device, rollouts=rollouts)
        self.ctx = Context(model, tokenizer, self.device)
        self.sums: ScoreSums | None = None
        self.stats = [o.new_statistics() for o in objectives]  # one per objective, group by group
        self.token_index = [i for i, o in enumerate(objectives) if o.token_level]
        self.token = self._token_level() if self.token_index else None
        self.samples: list[dict] = []
        self.stability = Stability(self.cov, self.memory, self.parallel) if config.stability else None

    def execute(self, all_prompts: list[PromptRecord]) -> Calibration | None:
        """The whole pass; None on a rank that does not build the result (fsdp: all but rank 0)."""
        every, cut = self.groups.render(all_prompts, self.config.truncate_prompts)
        if cut:
            self.checks["prompts_truncated"] = cut
        prompts, rendered = self.parallel.split(all_prompts), self.parallel.split(every)  # this process's share
        for o in self.objectives:  # load a teacher, check data against the prompts
            o.prepare(self.ctx, all_prompts)  # all of them: what it resolves must not depend on the rank
        self._check_memory(rendered)
        self._run_batches(prompts, rendered, self.parallel.batch_count(all_prompts, self.groups_per_batch),
                          self.parallel.keyed(every, rendered))
        extra = [self._extra_mean_score(o) for o in self.objectives]
        if not self.parallel.merge(self):
            return None  # fsdp: rank 0 holds the gathered sums and every rank's records, and writes the run
        if self.rollouts is not None:  # from the merged sample records: every rank's responses
            self.checks["rollouts"] = {**self.rollouts.describe(), **mismatch_summary(self.samples)}
        split = self.stability.close(self.sums) if self.stability else None
        cal, conformity = build_result(self, len(all_prompts), extra)
        cal.timings = {"sampling_s": self.clock["sampling"], "scoring_s": self.clock["scoring"],
                       "response_tokens": self.clock["tokens"], "samples": self.clock["samples"]}
        for line in _phase_lines(self.clock, self.checks, self.rollouts is not None):
            self.log(line)
        cal.diagnostics = calibration_diagnostics(self.stats, self.stability, split)
        cal.diagnostics.conformity = conformity
        if self.ckpt is not None and not self.checkpoint.keep_when_done:
            self.ckpt.discard()
        return cal

    def _check_memory(self, rendered: list[list[int]]) -> None:
        """Refuse, before any sampling, settings whose memory clearly exceeds what the device has free."""
        covered = sum(math.prod(shape) for shape in self.cov.shapes.values())
        estimate = estimate_memory(self.model, self.memory, covered, objectives=len(self.objectives),
                                   stability=self.stability is not None, sample_rows=self.sample_rows,
                                   score_rows=self.score_rows, tokens=self.groups.longest(rendered),
                                   max_tokens=self.max_tokens)
        check_memory(estimate, self.device)

    def _run_batches(self, prompts: list[PromptRecord], rendered: list[list[int]], count: int | None,
                     keyed: list[list[int]]) -> None:
        """Sample (or read) and score batch by batch, checkpointing; a resumed pass skips the batches done.

        ``count``: how many to run (fsdp: rank 0's count on every rank; a rank past its own prompts
        still joins each batch's forwards and scoring calls with none of its own); ``keyed``: the
        prompts the checkpoint key records."""
        starts = list(range(0, len(prompts), self.groups_per_batch))
        count = len(starts) if count is None else count
        done = self._resume(keyed)
        total, seen = len(prompts) * self.k, min(len(prompts), done * self.groups_per_batch) * self.k
        if done and self.announce is not None:
            self.announce(_resumed_line(self.ckpt.loaded, seen, total, self.parallel))
        what = "rollouts" if self.rollouts is not None else "sampling"
        bar_s = tqdm(total=total, initial=seen, desc=what, unit="sample", disable=not self.progress)
        bar_f = tqdm(total=total, initial=seen, desc="scoring ", unit="sample", disable=not self.progress)
        with bar_s, bar_f:
            for b in range(done, count):
                i = starts[b] if b < len(starts) else len(prompts)  # past this rank's prompts: none
                started = time.perf_counter()
                with self.parallel.step():
                    groups = self.groups.groups(prompts[i : i + self.groups_per_batch],
                                                rendered[i : i + self.groups_per_batch])
                    self._timed("sampling", started, tokens=sum(len(y) for g in groups for y in g.responses))
                    signals = batches.signals(self.objectives, self.stats, groups, self.ctx)
                bar_s.update(len(groups) * self.k)
                started = time.perf_counter()
                self._score(self.groups.batch(groups, signals) if groups else None)
                self._timed("scoring", started, samples=len(groups) * self.k)
                bar_f.update(len(groups) * self.k)
                if self.ckpt is not None and self.ckpt.due(b + 1, count):
                    self._save_checkpoint(b + 1)
                if b == done:  # without bars (which show their own ETA), the first batch times the rest
                    self.log(_eta_line(self.clock, count - b - 1))

    def _timed(self, phase: str, started: float, **counts) -> None:
        self.clock[phase] += time.perf_counter() - started
        for key, n in counts.items():
            self.clock[key] += n

    def state(self) -> CalibrationState:
        """This pass's state between batches (what a checkpoint holds; this process's rows of the sums under fsdp)."""
        return CalibrationState(self.generator.get_state(), self.sums, self.checks, self.stats, self.samples,
                                None if self.token is None else self.token.state(),
                                None if self.stability is None else self.stability.state())

    def restore(self, state: CalibrationState) -> None:
        """Put a state back (a checkpoint's, with full sums: each process keeps its rows)."""
        self.generator.set_state(state.generator)
        self.sums, self.checks, self.stats, self.samples = (self.parallel.own_rows(state.sums), state.checks,
                                                            state.stats, state.samples)
        if self.token is not None:
            self.token.restore(state.token)
        if self.stability is not None:
            half_a = state.halves.squares_a
            if half_a is not None:
                half_a = self.parallel.own_rows(ScoreSums(half_a, None, None, 0)).squares
            self.stability.restore(dataclasses.replace(state.halves, squares_a=half_a))

    def _resume(self, keyed: list[list[int]]) -> int:
        """Prompt batches already done: restored from the newest checkpoint (0 without one)."""
        if self.checkpoint is None:
            return 0
        self.ckpt = self.parallel.checkpointer(self.checkpoint, self._checkpoint_key(keyed))
        found = self.ckpt.load()
        if found is None:
            return 0
        done, tensors, meta, samples = found
        self.restore(read_state(tensors, meta, samples, rank=self.parallel.rank, names=list(self.cov.shapes),
                                place=self._place, stat_types=[type(s) for s in self.stats]))
        return done

    def _place(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Where a checkpoint's tensor goes: the mode's device for sums (a memory mode's CPU), else its parameter's."""
        param = self.cov.params.get(name)
        return t.to(self.parallel.restore_on or (param.device if param is not None else self.device))

    def _save_checkpoint(self, done: int) -> None:
        """The state after ``done`` batches (fsdp: gathered on rank 0, which writes it)."""
        self.parallel.save(self.ckpt, done, self.state())

    def _checkpoint_key(self, rendered: list[list[int]]) -> dict:
        """What the state depends on; a checkpoint whose key differs is refused."""
        model_id = self.checkpoint.model_id
        if model_id is None:
            from fisher_select.models import fingerprint  # reads every weight once: only when asked to checkpoint
            model_id = fingerprint(self.model)["id"]
        c = self.config
        return {"model": model_id, "samples_per_prompt": self.k, "max_new_tokens": c.max_new_tokens,
                "seed": c.seed, "batch_size": self.batch_size, "max_batch_tokens": self.max_tokens,
                "prompts": digest(rendered),
                "objectives": digest([o.describe() for o in self.objectives]),
                "rollouts": self.rollouts.sha256 if self.rollouts is not None else None,
                "stability": self.stability is not None, "memory": self.memory.describe()}

    def _token_level(self) -> TokenLevel:
        # the sign stream's seed comes from the sampling generator, drawn before any sampling
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.device))
        draws = max(self.objectives[i].sign_draws for i in self.token_index)
        return TokenLevel(self.model, self.cov, self.device, seed, draws, len(self.token_index), self.engine)

    def _score(self, batch: Batch | None) -> None:
        """Score one batch into the sums; None: this rank has no rows this batch (fsdp: it joins the calls)."""
        if batch is None:  # as many calls as ``row_chunks`` makes of any batch
            for _ in range(-(-self.k // self.score_rows) if self.k > self.batch_size else 1):
                self._score_part(None)
            return
        for part in batches.row_chunks(batch, self.score_rows):
            self._score_part(part)
        self.samples += batches.records(batch, [o.name for o in self.objectives])

    def _score_part(self, batch: Batch | None) -> None:
        signal = None if batch is None else self.memory.signal(batch.sequence_signal(self.device))  # (O, B) or None
        first = self.sums is None
        if self.stability is not None:  # the two halves' prompts in two calls
            self.sums = self.stability.score(self.model, batch, signal, self.sums)
        else:
            self.sums = self.parallel.add(None if batch is None else batch.rows, signal, self.sums)
        if batch is None:
            return
        if first and self.verify and self.parallel.verifies:
            self._first_batch_check(batch, signal)
        if self.token is not None:
            token_signals = [[t for s in batch.signals[i] for t in s.token_signal] for i in self.token_index]
            self.token.add(*batch.rows, token_signals)

    def _first_batch_check(self, batch: Batch, signal: torch.Tensor | None) -> None:
        """The first batch against plain autograd, one clear error naming the module before the rest of the pass:
        the rules' per-sample sums on its first rows with the objectives' signal (``engine.selfcheck``, every
        memory mode), and its score sums (``engine.reference``: a parameter used outside its module, which no
        hook sees; ``full`` alone keeps them)."""
        self.checks["selfcheck"] = {**check_rules(self.model, *batch.rows, rows=SELFCHECK_ROWS, signal=signal,
                                                  coverage=self.cov), "on": "first batch"}
        if self.sums.total is not None:  # the gradient / fisher memory modes keep no score sums to compare
            self.checks["autograd"] = verify_against_autograd(self.model, *batch.rows, self.sums, self.cov,
                                                              self.max_tokens)

    def _extra_mean_score(self, o: Objective) -> dict[str, torch.Tensor] | None:
        """Mean score of the rows an objective asks for (None: it asks for none), scored like the
        samples (this calibration's coverage and padding); ranks score a share each and sum."""
        rows = o.extra_rows(self.ctx)
        if rows is None:
            return None
        sums = ScoreSums.zeros(self.cov, None, squares=False)
        mine = self.parallel.share(rows)
        for i in range(0, len(mine), self.batch_size):
            ids, mask, resp = pad_rows(mine[i : i + self.batch_size], self.groups.pad, self.device)  # (B, T) each
            score_in_budget(self.model, ids, mask, resp, coverage=self.cov, into=sums, squares=False, **self.engine)
        self.parallel.reduce(sums)
        return {name: t / sums.count for name, t in sums.total.items()}


def _bar_line(line: str) -> None:
    """A line above the progress bars (on stderr, where they are)."""
    tqdm.write(line, file=sys.stderr)


def _resumed_line(path, seen: int, total: int, par) -> str:
    share = "" if par.world == 1 else f" (rank {par.rank} of {par.world}: its share of the prompts)"
    return f"resumed from checkpoint {path}: {seen:,} of {total:,} samples done, {total - seen:,} left{share}"


def _eta_line(clock: dict, left: int) -> str:
    spent = clock["sampling"] + clock["scoring"]
    return (f"first batch: {clock['samples']:,} samples sampled and scored in {spent:.1f}s; the other {left:,} "
            f"batch(es) take about {spent * left / 60:.1f} min")


def _phase_lines(clock: dict, checks: dict, rollouts: bool) -> list[str]:
    """One line per phase: sampling with tokens/s, scoring with samples/s, the checks."""
    c = clock
    checks_run = [f"{name} {_check_word(value)}" for name, value in checks.items() if name != "memory"]
    return [f"{'read rollouts' if rollouts else 'sampling done'}: {c['tokens']:,} response tokens in "
            f"{c['sampling']:.1f}s ({c['tokens'] / max(c['sampling'], 1e-9):,.0f} tokens/s)",
            f"scoring done: {c['samples']:,} samples in {c['scoring']:.1f}s "
            f"({c['samples'] / max(c['scoring'], 1e-9):,.1f} samples/s)",
            "checks: " + (", ".join(checks_run) if checks_run else "none ran")]


def _check_word(value) -> str:
    """A check's headline for the phase line: its verdict, else its largest error, else its count."""
    if isinstance(value, dict):
        if "verdict" in value:
            return str(value["verdict"])
        if "max_relative_error" in value:
            return f"ok (max relative error {value['max_relative_error']:.1e})"
    return str(value)
