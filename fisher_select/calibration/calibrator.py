"""The calibration pass: sample from the model, score every sample exactly, estimate F, S, g, bounds.

For each batch of prompt groups (K responses per prompt, plain ancestral sampling), every
objective turns its group into signals a_n; one scoring pass (``score_sums``) adds the exact
per-sample squared scores (shared Fisher), the signal-weighted scores of every objective and
the plain score sums. At the end everything is divided by the number of samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from fisher_select.distributed import (all_reduce_int, all_reduce_sums, gather_objects, merge_statistics,
                                                   rank_world, seed_for_rank, shard)
from fisher_select.caveats import ZERO_SCALE_WARNING
from fisher_select.engine.batching import auto_max_tokens, micro_batches, score_in_budget
from fisher_select.engine.scoring import Coverage, ScoreSums, plan_coverage
from fisher_select.engine.memory import MemoryMode
from fisher_select.errors import DegenerateResultWarning, FisherSelectError
from fisher_select.engine.logprob import response_logprobs
from fisher_select.calibration.objectives import Context, Group, GroupSignal, Objective, ScoringRow
from fisher_select.calibration.settings import CalibrationConfig, SamplingConfig
from fisher_select.calibration import fsdp
from fisher_select.calibration.budget import check_memory, estimate_memory, sampling_rows
from fisher_select.calibration.prompts import PromptRecord, check_context, render_prompt
from fisher_select.engine.rules import guard_model
from fisher_select.stats.bounds import BoundsView
from fisher_select.stats.conformity import ScoreMeanConformity, score_mean_conformity
from fisher_select.stats.naming import module_of
from fisher_select.stats.stability import SplitHalf, compare_halves
from fisher_select.calibration.sampling import eos_ids_of, pad_id_of, pad_rows, sample_responses
from fisher_select.calibration.checkpoint import (CheckpointConfig, Checkpointer, capture, capture_ranks, digest,
                                                  rank_view, restore_state)
from fisher_select.calibration.rollouts import Rollouts, mismatch_summary, tokenize_rollouts
from fisher_select.calibration.teachers import sequence_logprobs


@dataclass
class ObjectiveResult:
    """One objective's scale, gradient estimate and report fields."""

    name: str
    signal_scale: float | None
    grad_estimate: dict[str, torch.Tensor]
    summary: dict
    token_level: bool = False  # bounded with the token-level Fisher


@dataclass
class Calibration(BoundsView):
    """Result of ``calibrate``: means over all N*K samples (not sums). Bounds: ``BoundsView``."""

    fisher: dict[str, torch.Tensor]  # F_i = mean_n h_{n,i}^2
    score_mean: dict[str, torch.Tensor]  # mean_n h_n, ~0 (a check of the sampling)
    objectives: list[ObjectiveResult]
    num_prompts: int
    num_samples: int
    num_truncated: int
    samples: list[dict] = field(default_factory=list)
    coverage: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    token_fisher: dict[str, torch.Tensor] | None = None  # F^tok, when a token-level objective ran
    diagnostics: "CalibrationDiagnostics | None" = None  # what the report's uncertainty and stability need
    warnings: list[str] = field(default_factory=list)  # degenerate results, one line each (also warnings.warn)
    # this process's seconds sampling and scoring, and what they handled (response tokens, samples)
    timings: dict = field(default_factory=dict)

    @property
    def grad_estimate(self) -> dict[str, torch.Tensor]:
        return self.objectives[0].grad_estimate

    @property
    def truncation_rate(self) -> float:
        return self.num_truncated / max(1, self.num_samples)


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
    its gradient estimate and summary fields. ``verify`` compares the engine's score sums with
    plain autograd on the first batch (catches a parameter used outside its module, which no
    hook could see). What a reduced memory mode lacks is listed in ``checks["memory"]["missing"]``
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
    if rollouts is not None:  # the file's prompts and K; its responses are not sampled here
        prompts, sampling = rollouts.prompts, None
        config = dataclasses.replace(config, samples_per_prompt=rollouts.k)
    check_inputs(prompts, objectives, config.samples_per_prompt,
                 sampling if rollouts else sampling or SamplingConfig())
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


def _refuse(problems: list[str]) -> None:
    if problems:
        raise FisherSelectError("; ".join(problems))


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


@dataclass
class _Batch:
    """A scoring batch: prompt + response rows, left padded, with every objective's group signals."""

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    response_mask: torch.Tensor  # (B, T) True at response tokens
    groups: list[Group]
    signals: list[list[GroupSignal]]  # [objective][group]

    def sequence_signal(self, device) -> torch.Tensor:
        """(O, B) sequence-level signals; token-level objectives contribute zeros here."""
        return torch.stack([torch.cat([s.signal for s in row]) for row in self.signals]).to(device)


class _Calibrator:
    """State of one calibration pass (accumulators, generator, progress bars)."""

    def __init__(self, model, tokenizer, objectives, config: CalibrationConfig, progress: bool, verify: bool,
                 rollouts: Rollouts | None = None, checkpoint: CheckpointConfig | None = None, log=None):
        self.log = log or (lambda line: None)
        self.clock = {"sampling": 0.0, "scoring": 0.0, "tokens": 0, "samples": 0}  # this process's phases
        self.model, self.tokenizer, self.objectives, self.config = model, tokenizer, objectives, config
        self.seed, self.rollouts, self.checkpoint = config.seed, rollouts, checkpoint
        self.ckpt: Checkpointer | None = None
        self.k, self.max_new_tokens, self.verify = config.samples_per_prompt, config.max_new_tokens, verify
        self.batch_size = config.batch_size
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
        self.eos = eos_ids_of(model, tokenizer)
        self.pad = pad_id_of(model, tokenizer)
        self.fsdp = config.shard == "fsdp"  # calibration.fsdp: ranks sample their own prompts, forwards in lockstep
        self.rank, self.world = rank_world()
        self.shards: fsdp.Shards | None = None  # fsdp: this rank's rows of every accumulator
        self.lockstep: fsdp.Lockstep | None = None  # fsdp: every rank makes the same forwards while sampling
        if self.fsdp:
            _refuse(fsdp.problems(model, config, objectives, checkpoint))
            self.verify = False  # plain autograd would reach the all-gathered weights, not the shards
            keep = set(self.cov.shapes) if config.modules else None
            self.shards = fsdp.Shards(model, self.cov, max_tokens=self.max_tokens, max_rows=self.score_rows,
                                      objectives=len(objectives) if self.memory.signals else None,
                                      totals=self.memory.totals, params=keep)
            self.lockstep = fsdp.Lockstep(model, self.pad)
        self.generator = torch.Generator(device=self.device).manual_seed(seed_for_rank(self.seed, self.rank))
        self.ctx = Context(model, tokenizer, self.device)
        self.progress, self.truncate_prompts = progress, config.truncate_prompts
        self.sums: ScoreSums | None = None
        self.stats = [o.new_statistics() for o in objectives]  # one per objective, group by group
        self.token_index = [i for i, o in enumerate(objectives) if o.token_level]
        self.token = self._token_level() if self.token_index else None
        self.samples: list[dict] = []
        self.stability = _Stability(self.cov, self.memory, self.engine, self.shards) if config.stability else None

    def execute(self, all_prompts: list[PromptRecord]) -> Calibration:
        every = self._render(all_prompts)
        prompts = shard(all_prompts, self.rank, self.world)  # this rank's share (all of them alone)
        rendered = shard(every, self.rank, self.world)
        for o in self.objectives:  # load a teacher, check data against the prompts
            o.prepare(self.ctx, all_prompts)  # all of them: what it resolves must not depend on the rank
        self._check_memory(rendered)
        # fsdp: every rank runs as many batches as rank 0 (the most prompts), and one checkpoint holds all ranks
        batches = -(-len(shard(all_prompts, 0, self.world)) // self.groups_per_batch) if self.fsdp else None
        self._run_batches(prompts, rendered, batches, every if self.fsdp else rendered)
        extra = [self._extra_mean_score(o) for o in self.objectives]
        if self.fsdp and not self._merge_shards():
            return None  # rank 0 holds the gathered sums and every rank's records, and writes the run
        if self.world > 1 and not self.fsdp:
            self._merge_ranks()
        if self.rollouts is not None:  # from the merged sample records: every rank's responses
            self.checks["rollouts"] = {**self.rollouts.describe(), **mismatch_summary(self.samples)}
        world = 1 if self.fsdp else self.world  # fsdp: the halves are gathered and counted already
        split = self.stability.close(self.sums, world, self.device) if self.stability else None
        cal = self._result(len(all_prompts), extra)
        cal.timings = {"sampling_s": self.clock["sampling"], "scoring_s": self.clock["scoring"],
                       "response_tokens": self.clock["tokens"], "samples": self.clock["samples"]}
        self._log_phases()
        cal.diagnostics = calibration_diagnostics(self.stats, self.stability, split)
        cal.diagnostics.conformity = self.conformity
        if self.ckpt is not None and not self.checkpoint.keep_when_done:
            self.ckpt.discard()
        return cal

    def _check_memory(self, rendered: list[list[int]]) -> None:
        """Refuse, before any sampling, settings whose memory clearly exceeds what the device has free."""
        if self.rollouts is not None:  # the file's longest prompt + response
            tokens = max((len(t.prompt_ids) + max(map(len, t.responses)) for t in self.tokens.values()), default=1)
        else:
            tokens = max(map(len, rendered), default=0) + self.max_new_tokens
        covered = sum(math.prod(shape) for shape in self.cov.shapes.values())
        estimate = estimate_memory(self.model, self.memory, covered, objectives=len(self.objectives),
                                   stability=self.stability is not None, sample_rows=self.sample_rows,
                                   score_rows=self.score_rows, tokens=tokens, max_tokens=self.max_tokens)
        check_memory(estimate, self.device)

    def _render(self, all_prompts: list[PromptRecord]) -> list[list[int]]:
        """Every prompt's token ids (all prompts: every rank agrees on the checks)."""
        if self.rollouts is not None:  # the file's tokens, checked against the model's vocabulary and context
            self.tokens = tokenize_rollouts(self.rollouts, self.model, self.tokenizer, self.eos)
            self.rows = {g.record.index: g.rows for g in self.rollouts.groups}
            return [self.tokens[r.index].prompt_ids for r in all_prompts]
        every = [render_prompt(self.tokenizer, r) for r in all_prompts]
        every, cut = check_context(self.model, all_prompts, every, self.max_new_tokens, self.truncate_prompts)
        if cut:
            self.checks["prompts_truncated"] = cut
        return every

    def _run_batches(self, prompts: list[PromptRecord], rendered: list[list[int]], batches: int | None,
                     keyed: list[list[int]]) -> None:
        """Sample (or read) and score batch by batch, checkpointing; a resumed pass skips the batches done.

        ``batches``: how many to run (fsdp: rank 0's count on every rank; a rank past its own prompts
        still joins each batch's forwards and scoring calls with none of its own); ``keyed``: the
        prompts the checkpoint key records."""
        starts = list(range(0, len(prompts), self.groups_per_batch))
        batches = len(starts) if batches is None else batches
        done = self._resume(keyed)
        total, seen = len(prompts) * self.k, min(len(prompts), done * self.groups_per_batch) * self.k
        what = "rollouts" if self.rollouts is not None else "sampling"
        bar_s = tqdm(total=total, initial=seen, desc=what, unit="sample", disable=not self.progress)
        bar_f = tqdm(total=total, initial=seen, desc="scoring ", unit="sample", disable=not self.progress)
        with bar_s, bar_f:
            for b in range(done, batches):
                i = starts[b] if b < len(starts) else len(prompts)  # past this rank's prompts: none
                started = time.perf_counter()
                with self._in_step():  # fsdp: rewards and teachers may run the model too
                    groups = self._groups(prompts[i : i + self.groups_per_batch],
                                          rendered[i : i + self.groups_per_batch])
                    self._timed("sampling", started, tokens=sum(len(y) for g in groups for y in g.responses))
                    signals = self._signals(groups)
                bar_s.update(len(groups) * self.k)
                started = time.perf_counter()
                if groups:
                    self._score(self._batch(groups, signals))
                else:
                    self._score_nothing()
                self._timed("scoring", started, samples=len(groups) * self.k)
                bar_f.update(len(groups) * self.k)
                if self.ckpt is not None and self.ckpt.due(b + 1, batches):
                    self._save_checkpoint(b + 1)
                if b == done:  # without bars (which show their own ETA), the first batch times the rest
                    self._log_eta(batches - b - 1)

    def _in_step(self):
        """fsdp: the forwards of sampling and signals in lockstep with the other ranks; else nothing."""
        return self.lockstep() if self.lockstep is not None else contextlib.nullcontext()

    def _timed(self, phase: str, started: float, **counts) -> None:
        self.clock[phase] += time.perf_counter() - started
        for key, n in counts.items():
            self.clock[key] += n

    def _log_eta(self, left: int) -> None:
        c = self.clock
        spent = c["sampling"] + c["scoring"]
        self.log(f"first batch: {c['samples']:,} samples sampled and scored in {spent:.1f}s; the other {left:,} "
                 f"batch(es) take about {spent * left / 60:.1f} min")

    def _log_phases(self) -> None:
        """One line per phase (``log``): sampling with tokens/s, scoring with samples/s, the checks."""
        c = self.clock
        what = "read rollouts" if self.rollouts is not None else "sampling done"
        self.log(f"{what}: {c['tokens']:,} response tokens in {c['sampling']:.1f}s "
                 f"({c['tokens'] / max(c['sampling'], 1e-9):,.0f} tokens/s)")
        self.log(f"scoring done: {c['samples']:,} samples in {c['scoring']:.1f}s "
                 f"({c['samples'] / max(c['scoring'], 1e-9):,.1f} samples/s)")
        checks = [f"{name} {_check_word(value)}" for name, value in self.checks.items() if name != "memory"]
        self.log("checks: " + (", ".join(checks) if checks else "none ran"))

    def _resume(self, rendered: list[list[int]]) -> int:
        """Prompt batches already done: restored from the newest checkpoint (0 without one)."""
        if self.checkpoint is None:
            return 0
        # fsdp: one checkpoint holding every rank's state (folder of rank 0 of 1), which rank 0 alone writes
        owner = self.shards is None or self.shards.rank == 0
        rank, world = (0, 1) if self.fsdp else (self.rank, self.world)
        self.ckpt = Checkpointer(self.checkpoint, rank, world, self._checkpoint_key(rendered), owner=owner)
        state = self.ckpt.load()
        if state is None:
            return 0
        done, tensors, meta, samples = state
        if self.fsdp:
            tensors, meta, samples = rank_view(tensors, meta, samples, self.rank)
        restore_state(self, tensors, meta, samples)
        if self.shards is not None:  # every rank read the full sums; it keeps its rows
            self.sums = self.shards.cut(self.sums)
            if self.stability is not None and self.stability.squares_a is not None:
                self.stability.squares_a = self.shards.cut(ScoreSums(self.stability.squares_a, None, None, 0)).squares
        return done

    def _save_checkpoint(self, done: int) -> None:
        """The state after ``done`` batches; fsdp: rank 0 gathers the full sums and every rank's state, and writes them."""
        if self.shards is None:
            self.ckpt.save(done, *capture(self), self.samples)
            return
        sums = self.shards.gather(self.sums)  # collectives: every rank
        half = self._gather_half_a()
        joined = capture_ranks(self, sums, half)
        if joined is not None:
            self.ckpt.save(done, *joined)

    def _gather_half_a(self) -> dict[str, torch.Tensor] | None:
        """fsdp: the split halves' half-A squares, full on rank 0 (None elsewhere, and before any half-A prompt)."""
        half = None if self.stability is None else self.stability.squares_a
        if half is None:  # the same on every rank: every rank makes both halves' calls (before any: None)
            return None
        full = self.shards.gather(ScoreSums(half, None, None, 0))
        return None if full is None else full.squares

    def _checkpoint_key(self, rendered: list[list[int]]) -> dict:
        """What the state depends on; a checkpoint whose key differs is refused."""
        model_id = self.checkpoint.model_id
        if model_id is None:
            from fisher_select.models import fingerprint  # reads every weight once: only when asked to checkpoint
            model_id = fingerprint(self.model)["id"]
        key = {"model": model_id, "samples_per_prompt": self.k, "max_new_tokens": self.max_new_tokens,
               "seed": self.seed, "batch_size": self.batch_size, "max_batch_tokens": self.max_tokens,
               "prompts": digest(rendered),
               "objectives": digest([o.describe() for o in self.objectives]),
               "rollouts": self.rollouts.sha256 if self.rollouts is not None else None,
               "stability": self.stability is not None, "memory": self.memory.describe()}
        if self.fsdp:  # every rank's samples are in it: only as many FSDP ranks can resume it
            key["fsdp_ranks"] = self.world
        return key

    def _groups(self, records, rendered) -> list[Group]:
        if not records:  # fsdp: a rank past its own prompts
            return []
        return self._rollout_groups(records) if self.rollouts is not None else self._sample(records, rendered)

    def _rollout_groups(self, records: list[PromptRecord]) -> list[Group]:
        """The file's groups, with this model's log-probability of every response recomputed (fp32, summed)."""
        toks = [self.tokens[r.index] for r in records]
        contexts = [t.prompt_ids for t in toks for _ in t.responses]
        logp = sequence_logprobs(self.model, contexts, [y for t in toks for y in t.responses]).tolist()  # (B,)
        groups, at = [], 0
        for r, t in zip(records, toks):
            k = len(t.responses)
            groups.append(Group(r, t.prompt_ids, t.responses, t.texts, logp[at : at + k], t.ended,
                                rollout=self.rows[r.index]))
            at += k
        return groups

    def _token_level(self) -> "TokenLevel":
        # the sign stream's seed comes from the sampling generator, drawn before any sampling
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.device))
        draws = max(self.objectives[i].sign_draws for i in self.token_index)
        return TokenLevel(self.model, self.cov, self.device, seed, draws, len(self.token_index), self.engine)

    def _sample(self, records, rendered) -> list[Group]:
        rows = [ids for ids in rendered for _ in range(self.k)]
        drawn = []  # in calls of at most sample_rows rows: one call unless K exceeds the batch size
        for start in range(0, len(rows), self.sample_rows):
            drawn += sample_responses(self.model, rows[start : start + self.sample_rows], eos_ids=self.eos,
                                      pad_id=self.pad, max_new_tokens=self.max_new_tokens, generator=self.generator)
        groups = []
        for g, (record, ids) in enumerate(zip(records, rendered)):
            part = drawn[g * self.k : (g + 1) * self.k]
            texts = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in part]
            groups.append(Group(record, ids, [s.response_ids for s in part], texts,
                                [s.logprob for s in part], [s.ended for s in part]))
        return groups

    def _signals(self, groups: list[Group]) -> list[list[GroupSignal]]:
        """[objective][group] signals, each folded into that objective's statistics."""
        out = []
        for o, stats in zip(self.objectives, self.stats):
            row = [o.signals(g, self.ctx) for g in groups]
            for s in row:
                stats.add(s)
            out.append(row)
        return out

    def _batch(self, groups: list[Group], signals: list[list[GroupSignal]]) -> _Batch:
        rows = [ScoringRow(g.prompt_ids + resp, len(g.prompt_ids)) for g in groups for resp in g.responses]
        return _Batch(*pad_rows(rows, self.pad, self.device), groups, signals)

    def _score(self, batch: _Batch) -> None:
        for part in _row_chunks(batch, self.score_rows):
            self._score_part(part)
        self._record(batch)

    def _score_part(self, batch: _Batch) -> None:
        signal = self.memory.signal(batch.sequence_signal(self.device))  # (O, B), None: no signal sums kept
        args = (self.model, batch.input_ids, batch.attention_mask, batch.response_mask)
        first = self.sums is None
        if self.stability is not None:  # the two halves' prompts in two calls
            self.sums = self.stability.score(self.model, batch, signal, self.sums)
        elif self.shards is not None:  # fsdp: this rank scores its rows, keeps its rows of every rank's sums
            self.sums = self.shards.score(args[1:], signal, into=self.sums)
        elif first:
            self.sums = score_in_budget(*args, signal, coverage=self.cov, **self.engine, **self.memory.score_kwargs())
        else:
            score_in_budget(*args, signal, coverage=self.cov, into=self.sums, **self.engine)
        if first and self.verify and self.sums.total is not None:  # the first batch's score sums against autograd
            self.checks["autograd"] = verify_against_autograd(*args, self.sums, self.cov, self.max_tokens)
        if self.token is not None:
            token_signals = [[t for s in batch.signals[i] for t in s.token_signal] for i in self.token_index]
            self.token.add(*args[1:], token_signals)

    def _score_nothing(self) -> None:
        """fsdp, a rank past its own prompts: join the scoring calls of the other ranks' batch with no rows."""
        calls = -(-self.k // self.score_rows) if self.k > self.batch_size else 1  # _row_chunks of any batch
        for _ in range(calls):
            if self.stability is not None:
                self.sums = self.stability.score(self.model, None, None, self.sums)
            else:
                self.sums = self.shards.score(None, None, into=self.sums)

    def _merge_shards(self) -> bool:
        """fsdp: rank 0 gets the full sums (and half-A squares), every rank's statistics and samples, and
        the split-half counts of all ranks; True there, False on the other ranks."""
        half = self._gather_half_a()
        self.sums = self.shards.gather(self.sums)
        self._merge_records()
        if self.stability is not None:  # the per-call masses are every rank's already (Shards.masses)
            st = self.stability
            st.samples = [all_reduce_int(c, self.device) for c in st.samples]
            st.prompts = [all_reduce_int(c, self.device) for c in st.prompts]
            st.squares_a, st.shards = half, None  # rank 0 closes the halves as one process does
        return self.sums is not None

    def _extra_mean_score(self, o: Objective) -> dict[str, torch.Tensor] | None:
        """Mean score of the rows an objective asks for (None: it asks for none), scored like the
        samples (this calibration's coverage and padding); ranks score a share each and sum."""
        rows = o.extra_rows(self.ctx)
        if rows is None:
            return None
        sums = ScoreSums.zeros(self.cov, None, squares=False)
        rank, world = (0, 1) if self.fsdp else (self.rank, self.world)  # fsdp: every rank scores them all, in step
        mine = shard(rows, rank, world)
        for i in range(0, len(mine), self.batch_size):
            ids, mask, resp = pad_rows(mine[i : i + self.batch_size], self.pad, self.device)  # (B, T) each
            score_in_budget(self.model, ids, mask, resp, coverage=self.cov, into=sums, squares=False, **self.engine)
        if world > 1:
            sums.count = all_reduce_int(sums.count, self.device)
            all_reduce_sums(sums.total)
        return {name: t / sums.count for name, t in sums.total.items()}

    def _record(self, batch: _Batch) -> None:
        names = [o.name for o in self.objectives]
        for j, g in enumerate(batch.groups):
            signals = [row[j] for row in batch.signals]  # this group's, per objective
            for k, resp in enumerate(g.responses):
                self.samples.append({
                    "prompt_index": g.record.index,
                    "prompt": g.record.prompt if g.record.prompt is not None else g.record.messages,
                    "prompt_ids": g.prompt_ids,
                    "response_ids": resp,
                    "response": g.texts[k],
                    "logprob": g.logprobs[k],
                    "truncated": not g.ended[k],
                    "signal": {name: float(s.signal[k]) for name, s in zip(names, signals)},
                    "value": {name: (s.values[k] if s.values else None) for name, s in zip(names, signals)},
                    **({"sampler_logprob": g.rollout[k].sampler_logprob, "rollout_line": g.rollout[k].line}
                       if g.rollout else {}),
                })

    def _merge_ranks(self) -> None:
        """Sum every rank's accumulators and merge statistics and samples (torchrun / accelerate)."""
        if self.sums is None:  # more ranks than prompt batches: this rank saw none
            self.sums = self.memory.zeros(self.cov, len(self.objectives))
        self.sums.count = all_reduce_int(self.sums.count, self.device)
        all_reduce_sums(*(d for d in (self.sums.squares, self.sums.total, self.sums.signal) if d is not None))
        if self.token is not None:
            self.token.merge_ranks()
        self._merge_records()
        checks = [c for c in gather_objects(self.checks.get("autograd")) if c]
        if checks:
            self.checks["autograd"] = max(checks, key=lambda c: c["max_relative_error"])

    def _merge_records(self) -> None:
        """Every rank's objective statistics merged and sample records gathered, in rank order (collective)."""
        self.stats = [merge_statistics(s) for s in self.stats]
        self.samples = [s for part in gather_objects(self.samples) for s in part]

    def _objective_result(self, i: int, fisher: dict, extra_mean: dict | None) -> ObjectiveResult:
        o, stats, n = self.objectives[i], self.stats[i], self.sums.count
        if o.token_level:
            grad = self.token.grad_estimate(self.token_index.index(i))
        else:
            # accumulators=fisher keeps no signal sums: no gradient estimate (said in checks["memory"])
            grad = {} if self.sums.signal is None else {name: s[i] / n for name, s in self.sums.signal.items()}
        summary = o.summary(stats)
        if extra_mean is not None:  # results that need F (SFT from demonstrations)
            done = o.extra_result(extra_mean, fisher)
            summary.update(done.summary)
            grad = grad if done.grad_estimate is None else done.grad_estimate
        return ObjectiveResult(o.name, o.signal_scale(stats), grad, summary, token_level=o.token_level)

    def _result(self, num_prompts: int, extra: list[dict | None]) -> Calibration:
        n = self.sums.count
        fisher = {name: sq / n for name, sq in self.sums.squares.items()}
        total = self.sums.total or {}  # no score sums in the gradient / fisher memory modes
        score_mean = {name: t / n for name, t in total.items()}
        results = [self._objective_result(i, fisher, mean) for i, mean in enumerate(extra)]
        coverage = self.cov.summary()
        self.conformity = None
        if total:  # the score-mean check: E[h] = 0 under the model (the report shows the whole check)
            heavy = {name for name in fisher if module_of(name) in set(coverage.get("embeddings") or [])}
            self.conformity = score_mean_conformity(fisher, score_mean, n, heavy)
            self.checks["score_mean"] = score_mean_summary(self.conformity)
        cal = Calibration(fisher, score_mean, results, num_prompts, n,
                          sum(s["truncated"] for s in self.samples), self.samples, coverage, self.checks)
        if self.token is not None:
            cal.token_fisher = self.token.fisher()
        return cal


def _row_chunks(batch: _Batch, rows: int):
    """``batch`` in parts of at most ``rows`` rows. Only a batch of one prompt (K above the batch size) is
    ever larger: its group and signals are cut along the K responses; a smaller batch passes whole."""
    if batch.input_ids.shape[0] <= rows:
        yield batch
        return
    (group,), cut = batch.groups, dataclasses.replace
    for a in range(0, batch.input_ids.shape[0], rows):
        b = a + rows
        part = cut(group, responses=group.responses[a:b], texts=group.texts[a:b], logprobs=group.logprobs[a:b],
                   ended=group.ended[a:b], rollout=group.rollout[a:b])
        signals = [[cut(s, signal=s.signal[a:b], values=s.values[a:b],
                        token_signal=None if s.token_signal is None else s.token_signal[a:b])] for (s,) in batch.signals]
        yield _Batch(batch.input_ids[a:b], batch.attention_mask[a:b], batch.response_mask[a:b], [part], signals)


def _check_word(value) -> str:
    """A check's headline for the phase line: its verdict, else its largest error, else its count."""
    if isinstance(value, dict):
        if "verdict" in value:
            return str(value["verdict"])
        if "max_relative_error" in value:
            return f"ok (max relative error {value['max_relative_error']:.1e})"
    return str(value)


def verify_against_autograd(model, input_ids, attention_mask, response_mask, sums: ScoreSums, cov: Coverage,
                            max_tokens: int | None = None) -> dict:
    """Compare the engine's ``sum_n h_n`` with plain autograd of ``sum_n l_n``.

    A parameter used outside the module that holds it (a functional matmul with another
    module's weight) would be missed by the hooks; this catches it on the first batch.
    ``max_tokens``: the scoring's token budget, which caps this pass's activations too.
    """
    params = {n: p for n, p in cov.params.items()
              if n in cov.shapes and p.is_floating_point() and tuple(p.shape) == cov.shapes[n]}  # kept ones only
    saved = {n: p.requires_grad for n, p in params.items()}
    try:
        for p in params.values():
            p.requires_grad_(True)
        grads = _summed_grads(model, (input_ids, attention_mask, response_mask), list(params.values()), max_tokens)
    finally:
        for n, p in params.items():
            p.requires_grad_(saved[n])
    half = next(iter(params.values())).dtype in (torch.bfloat16, torch.float16) if params else False
    tol = 5e-2 if half else 1e-3
    worst, worst_name = 0.0, None
    for (name, _), g in zip(params.items(), grads):
        ref = torch.zeros(cov.shapes[name]) if g is None else g.float().cpu()
        mine = sums.total[name].cpu()
        err = float((mine - ref).norm() / (ref.norm() + mine.norm() + 1e-12))
        if err > worst:
            worst, worst_name = err, name
    if worst > tol:
        raise FisherSelectError(
            f"score sums for {worst_name} differ from autograd (relative error {worst:.2e} > {tol:g}): "
            "the parameter is probably used outside the module that holds it; please report this model"
        )
    return {"max_relative_error": worst, "parameter": worst_name, "tolerance": tol}


def _summed_grads(model, batch: tuple, params: list, max_tokens: int | None) -> list:
    """Autograd of the batch's summed log-probabilities (batch: (B, T) ids, mask, response mask), a
    micro-batch at a time when the batch exceeds ``max_tokens``; None for a parameter without gradient."""
    parts = micro_batches(batch[1], max_tokens)
    total = [None] * len(params)
    for rows in parts:
        pick = torch.tensor(rows, device=batch[0].device)
        part = batch if len(parts) == 1 else tuple(t.index_select(0, pick) for t in batch)  # (b, T) each
        grads = torch.autograd.grad(response_logprobs(model, *part).sum(), params, allow_unused=True)
        total = [g if t is None else t if g is None else t + g for t, g in zip(total, grads)]
    return total


def score_mean_summary(c: ScoreMeanConformity) -> dict:
    """``checks["score_mean"]``: the check's headline numbers (``stats.conformity`` computes it)."""
    return {"rms_z": c.all.rms_z, "coordinates": c.all.coordinates, "share_above_3": c.robust.share_above,
            "expected_share": c.expected_share, "verdict": c.verdict,
            "meaning": "z = mean(h) / stderr per coordinate, about standard normal when E[h] = 0 holds (samples "
                       "from the model); rms_z over all coordinates, share_above_3 outside the embeddings and head"}


class TokenLevel:
    """Token-level Fisher and gradients for token-level objectives (full-vocabulary distillation).

    ``F^tok_i = E_y sum_t h_{t,i}^2`` from Rademacher signs: backprop of ``sum_t eps_t log pi(y_t|s_t)``
    has ``E_eps[(d_i u)^2] = sum_t h_{t,i}^2``, so the per-sample squares of one signed backward
    estimate it at the cost of the sequence Fisher (``sign_draws`` backwards reduce the noise).
    The gradient estimate ``mean_n sum_t A_t h_{n,t}`` is the plain score sum of one backward
    with token weights ``A_t``. Gradients are kept per token-level objective, by position.
    """

    def __init__(self, model, coverage: Coverage, device, seed: int, draws: int, objectives: int,
                 engine: dict | None = None):
        self.model, self.cov, self.device, self.draws = model, coverage, device, draws
        self.engine = engine or {"max_tokens": None}  # micro-batches; the signs are drawn for the whole batch first
        self.signs = torch.Generator(device=device).manual_seed(seed)
        self.squares: ScoreSums | None = None
        self.grads: list[ScoreSums | None] = [None] * objectives

    def add(self, input_ids, attention_mask, response_mask, token_signals: list[list[torch.Tensor]]) -> None:
        """input_ids, attention_mask, response_mask: (B, T); ``token_signals[j][b]``: (L_b,) signal of
        the j-th token-level objective at row b's response tokens."""
        args = (self.model, input_ids, attention_mask, response_mask)
        for _ in range(self.draws):
            eps = torch.randint(0, 2, input_ids.shape, generator=self.signs, device=self.device) * 2.0 - 1
            self.squares = score_in_budget(*args, token_weights=eps, coverage=self.cov, into=self.squares,
                                           **self.engine)
        for j, rows in enumerate(token_signals):
            weights = torch.zeros(input_ids.shape, dtype=torch.float32, device=self.device)  # (B, T)
            for b, a in enumerate(rows):
                weights[b, response_mask[b]] = a.to(weights)
            self.grads[j] = score_in_budget(*args, token_weights=weights, coverage=self.cov, into=self.grads[j],
                                            squares=False, **self.engine)

    def merge_ranks(self) -> None:
        if self.squares is None:
            self.squares = ScoreSums.zeros(self.cov, None)
        self.squares.count = all_reduce_int(self.squares.count, self.device)
        all_reduce_sums(self.squares.squares)
        for j, sums in enumerate(self.grads):
            if sums is None:
                sums = self.grads[j] = ScoreSums.zeros(self.cov, None, squares=False)
            sums.count = all_reduce_int(sums.count, self.device)
            all_reduce_sums(sums.total)

    def fisher(self) -> dict[str, torch.Tensor]:
        n = self.squares.count  # samples x draws
        return {name: sq / n for name, sq in self.squares.squares.items()}

    def grad_estimate(self, j: int) -> dict[str, torch.Tensor]:
        """Mean over samples of sum_t A_t h_t for the j-th token-level objective."""
        sums = self.grads[j]
        return {k: t / sums.count for k, t in sums.total.items()}


# ---------------------------------------------------------------------------
# Diagnostics for the report: per-prompt scale terms, split halves, per-batch spread


@dataclass
class CalibrationDiagnostics:
    """What the report's uncertainty and stability sections need beyond F, S and g."""

    scale_terms: list[list[float]]  # per objective, per prompt: its estimate of E[a^2 | x]
    split_half: SplitHalf | None = None  # None: stability off, or a half without prompts
    conformity: ScoreMeanConformity | None = None  # None: no score sums (memory modes gradient / fisher)
    unit_names: list[str] = field(default_factory=list)  # parameter order of ``unit_masses``
    unit_masses: list[list[float]] = field(default_factory=list)  # per scoring unit: sum of h^2 per parameter
    unit_counts: list[int] = field(default_factory=list)  # per scoring unit: its samples


def calibration_diagnostics(stats, stability: "_Stability | None", split: SplitHalf | None) -> CalibrationDiagnostics:
    out = CalibrationDiagnostics([list(s.terms) for s in stats], split)
    if stability is not None:
        out.unit_names, out.unit_masses, out.unit_counts = stability.names, stability.unit_masses, stability.unit_counts
    return out


class _Stability:
    """Split halves of the prompts and per-call masses of the squared scores (``calibrate(stability=True)``).

    Prompts with an even ``PromptRecord.index`` form half A, odd ones half B; each batch is scored
    in two calls, B then A, at no extra backward cost. Half A's squared scores go to their own fp32
    accumulator, 4 bytes per covered parameter coordinate for the whole calibration (beside the
    4 + 4 + 4 O of the shared squares, score sums and O signal sums); its score and signal sums join
    the shared ones. The shared squares hold half B alone until ``close`` folds A in, so both
    halves are exact sums (no total - half cancellation). Each call is one unit of the spread of
    module masses: its per-parameter sum of h^2 and its sample count.
    """

    def __init__(self, cov: Coverage, memory: MemoryMode | None = None, engine: dict | None = None,
                 shards: "fsdp.Shards | None" = None):
        self.cov, self.memory, self.engine = cov, memory or MemoryMode(), engine or {"max_tokens": None}
        self.shards = shards  # fsdp: every accumulator holds this rank's rows; the bookkeeping is every rank's
        self.names = list(cov.shapes)
        self.squares_a: dict[str, torch.Tensor] | None = None
        self.samples, self.prompts = [0, 0], [0, 0]  # [half A, half B]
        self.unit_masses: list[list[float]] = []
        self.unit_counts: list[int] = []
        self._running = [[0.0] * len(self.names), [0.0] * len(self.names)]  # per half: running sums per parameter

    def _squares(self) -> dict[str, torch.Tensor]:
        if self.squares_a is None:
            self.squares_a = (self.shards.zeros(None, squares=True, totals=False) if self.shards is not None else
                              ScoreSums.zeros(self.cov, None, totals=False, device=self.memory.device)).squares
        return self.squares_a

    def _zeros(self, signal: torch.Tensor | None) -> ScoreSums:
        if self.shards is not None:  # the objectives whose signal sums the memory mode keeps
            return self.shards.zeros(self.shards.objectives)
        return self.memory.zeros(self.cov, 0 if signal is None else signal.shape[0])

    def _add(self, model, rows: tuple | None, signal, into: ScoreSums) -> None:
        """Score ``rows`` ((ids, mask, resp), each (B, T); signal (O, B) or None) into ``into``: sharded under
        fsdp (where ``rows`` may be None: this rank joins the call with none), else in token budgets."""
        if self.shards is not None:
            self.shards.score(rows, signal, into=into)
        else:
            score_in_budget(model, *rows, signal, coverage=self.cov, into=into, **self.engine)

    def score(self, model, batch: _Batch | None, signal: torch.Tensor | None, sums: ScoreSums | None) -> ScoreSums:
        """Score ``batch`` (signal: (O, B)) into ``sums`` (created on the first call) and return it.

        fsdp: both halves' calls are collectives, made on every rank even where this rank has no rows
        of a half (``batch`` None: a rank past its own prompts); a call is one unit of the spread of
        module masses over all ranks' rows (``Shards.masses``), counted when any rank had rows."""
        groups = [] if batch is None else batch.groups
        for half in (1, 0):
            picked = [j for j, g in enumerate(groups) if g.record.index % 2 == half]
            if not picked and self.shards is None:
                continue
            sums = self._zeros(signal) if sums is None else sums
            target = sums if half == 1 else ScoreSums(self._squares(), sums.signal, sums.total, 0)
            before = target.count
            rows = self._rows(batch, picked)  # (b,) or None
            part = None if rows is None else tuple(t.index_select(0, rows) for t in
                                                   (batch.input_ids, batch.attention_mask, batch.response_mask))
            if part is not None:
                start = int(part[1].any(0).nonzero()[0])  # padding columns these rows share
                part = tuple(t[:, start:] for t in part)  # (b, T') each
            self._add(model, part, None if rows is None or signal is None else signal.index_select(1, rows), target)
            counted = target.count - before  # fsdp: every rank's rows of this call
            if half == 0:
                sums.count += target.count
            self.samples[half] += 0 if rows is None else len(rows)
            self.prompts[half] += len(picked)
            if counted:
                self._unit(half, target.squares, counted)
        return sums

    @staticmethod
    def _rows(batch: _Batch | None, picked: list[int]) -> torch.Tensor | None:
        """The row indices (b,) of the ``picked`` groups' responses; None when none are picked."""
        if not picked:
            return None
        k = batch.input_ids.shape[0] // len(batch.groups)  # rows per group
        return torch.tensor([j * k + i for j in picked for i in range(k)], device=batch.input_ids.device)

    def _unit(self, half: int, squares: dict[str, torch.Tensor], count: int) -> None:
        if self.shards is not None:  # the whole accumulator's sums: every rank's rows
            now = self.shards.masses({n: squares[n] for n in self.names})
        else:
            now = [float(squares[n].sum(dtype=torch.float64)) for n in self.names]
        self.unit_masses.append([a - b for a, b in zip(now, self._running[half])])
        self.unit_counts.append(count)
        self._running[half] = now

    def close(self, sums: ScoreSums, world: int, device) -> SplitHalf | None:
        """After the ranks are merged: compare the halves, then fold half A into ``sums.squares``."""
        squares_a = self._squares()
        if world > 1:
            all_reduce_sums(squares_a)
            self.samples = [all_reduce_int(c, device) for c in self.samples]
            self.prompts = [all_reduce_int(c, device) for c in self.prompts]
            parts = gather_objects((self.unit_masses, self.unit_counts))
            self.unit_masses = [u for masses, _ in parts for u in masses]
            self.unit_counts = [c for _, counts in parts for c in counts]
        split = compare_halves(squares_a, sums.squares, self.samples, self.prompts) if min(self.prompts) else None
        for name, t in squares_a.items():
            sums.squares[name].add_(t)
        self.squares_a = None
        return split
