"""How a calibration's work is spread over processes: one process, data parallel, or FSDP (``calibrate(shard=...)``).

The calibration loop (``calibrator._Calibrator``) is the same in every mode; what differs is one
of these objects, chosen once by ``choose``, with the same few methods:

- ``split``: this process's share of the prompts; ``batch_count``: how many batches it runs;
- ``step``: the context of one batch's sampling and signals (fsdp: forwards in lockstep);
- ``add`` / ``signal_zeros`` / ``squares_zeros`` / ``masses``: score rows into the sums and measure them;
- ``share`` / ``reduce``: the rows an objective asks for, and their sums over the processes;
- ``checkpointer`` / ``save`` / ``own_rows``: whose checkpoint, how it is written and resumed;
- ``merge``: every process's sums, statistics and samples, once sampling and scoring are done.
"""

from __future__ import annotations

import contextlib

import torch

from fisher_select.calibration import fsdp
from fisher_select.calibration.checkpoint import CalibrationState, Checkpointer, capture_ranks, write_state
from fisher_select.distributed import (all_reduce_counts, all_reduce_int, all_reduce_sums, gather_objects,
                                       merge_statistics, rank_world, shard)
from fisher_select.engine.batching import score_in_budget
from fisher_select.engine.memory import MemoryMode
from fisher_select.engine.scoring import Coverage, ScoreSums
from fisher_select.errors import FisherSelectError


class Single:
    """One process: every prompt here, sums in token budgets on this device (or the memory mode's)."""

    collective = False  # a scoring call without rows of this process is skipped, not joined
    verifies = True  # the first batch's score sums can be compared with plain autograd of the full weights

    def __init__(self, model, cov: Coverage, memory: MemoryMode, engine: dict, device):
        self.model, self.cov, self.memory, self.engine, self.device = model, cov, memory, engine, device
        self.rank, self.world = 0, 1
        self.restore_on = memory.device  # where a checkpoint's sums go (None: each parameter's device)

    def selfcheck(self) -> dict | None:
        """A check of the rules run before this object existed (only FSDP's, before sharding)."""
        return None

    def split(self, prompts: list) -> list:
        return shard(prompts, self.rank, self.world)

    def batch_count(self, all_prompts: list, per_batch: int) -> int | None:
        """Batches to run (None: as many as this process's prompts fill)."""
        return None

    def keyed(self, every: list, mine: list) -> list:
        """The rendered prompts a checkpoint's key records: this process's."""
        return mine

    def step(self):
        return contextlib.nullcontext()

    def add(self, rows: tuple | None, signal: torch.Tensor | None, into: ScoreSums | None) -> ScoreSums | None:
        """Score ``rows`` ((ids, mask, resp), each (B, T); signal (O, B) or None) into ``into`` (created when
        None, in the memory mode); ``rows`` None: this process has none in this call, nothing to do."""
        if rows is None:
            return into
        if into is None:
            return score_in_budget(self.model, *rows, signal, coverage=self.cov, **self.engine,
                                   **self.memory.score_kwargs())
        score_in_budget(self.model, *rows, signal, coverage=self.cov, into=into, **self.engine)
        return into

    def signal_zeros(self, signal: torch.Tensor | None) -> ScoreSums:
        """Empty sums of the memory mode for ``signal``'s rows (O, B) of objectives."""
        return self.memory.zeros(self.cov, 0 if signal is None else signal.shape[0])

    def squares_zeros(self) -> dict[str, torch.Tensor]:
        return ScoreSums.zeros(self.cov, None, totals=False, device=self.memory.device).squares

    def masses(self, squares: dict[str, torch.Tensor]) -> list[float]:
        """Per parameter, the float64 sum of ``squares``."""
        return [float(t.sum(dtype=torch.float64)) for t in squares.values()]

    def share(self, rows: list) -> list:
        """This process's share of the rows an objective asks for (``extra_rows``)."""
        return shard(rows, self.rank, self.world)

    def reduce(self, sums: ScoreSums) -> None:
        """The shares' plain score sums summed over the processes (in place)."""

    def checkpointer(self, cfg, key: dict) -> Checkpointer:
        return Checkpointer(cfg, self.rank, self.world, key)

    def save(self, ckpt: Checkpointer, done: int, state: CalibrationState) -> None:
        ckpt.save(done, *write_state(state), state.samples)

    def own_rows(self, sums: ScoreSums | None) -> ScoreSums | None:
        """This process's part of a checkpoint's full sums: all of them."""
        return sums

    def merge(self, loop) -> bool:
        """Every process's state in ``loop`` (``calibrator._Calibrator``); True where the result is built."""
        return True


class DataParallel(Single):
    """torchrun / accelerate: each rank samples and scores its share of the prompts; the sums add up at the end."""

    def __init__(self, model, cov: Coverage, memory: MemoryMode, engine: dict, device):
        super().__init__(model, cov, memory, engine, device)
        self.rank, self.world = rank_world()

    def reduce(self, sums: ScoreSums) -> None:
        sums.count = all_reduce_int(sums.count, self.device)
        all_reduce_sums(sums.total)

    def merge(self, loop) -> bool:
        """Sum every rank's accumulators and merge statistics and samples (collective)."""
        if loop.sums is None:  # more ranks than prompt batches: this rank saw none
            loop.sums = self.memory.zeros(self.cov, len(loop.objectives))
        loop.sums.count = all_reduce_int(loop.sums.count, self.device)
        all_reduce_sums(*(d for d in (loop.sums.squares, loop.sums.total, loop.sums.signal) if d is not None))
        all_reduce_counts(loop.sums.expert_tokens)  # MoE: tokens per expert, every rank's
        all_reduce_counts(loop.sums.expert_positions)
        if loop.token is not None:
            loop.token.merge_ranks()
        merge_records(loop)
        for name in ("autograd", "selfcheck"):  # each rank checked its own first batch: the worst one stands
            checks = [c for c in gather_objects(loop.checks.get(name)) if c]
            if checks:
                loop.checks[name] = max(checks, key=lambda c: c["max_relative_error"])
        if loop.stability is not None:
            loop.stability.merge_ranks()
        return True


class Fsdp(Single):
    """``shard: fsdp`` (``calibration.fsdp``): ranks sample their own prompts, forwards in lockstep, each keeps its
    rows of every sum; rank 0 gathers them, and every rank's state, for a checkpoint and for the result."""

    collective = True  # every scoring call is a collective: a rank without rows joins it with none
    verifies = False  # plain autograd would reach the all-gathered weights, not the shards

    def __init__(self, model, cov: Coverage, memory: MemoryMode, engine: dict, device, *, objectives: int,
                 score_rows: int, modules: bool, pad: int):
        super().__init__(model, cov, memory, engine, device)
        self.rank, self.world = rank_world()
        self.restore_on = "cpu"  # the full sums stay on the CPU; each rank moves its rows to its device
        keep = set(cov.shapes) if modules else None
        self.shards = fsdp.Shards(model, cov, max_tokens=engine["max_tokens"], max_rows=score_rows,
                                  objectives=objectives if memory.signals else None, totals=memory.totals,
                                  params=keep)
        self.lockstep = fsdp.Lockstep(model, pad)

    def selfcheck(self) -> dict | None:
        """The rules' check ``fsdp.wrap`` ran on the full model before sharding (None: it did not run)."""
        return getattr(self.model, fsdp.SELFCHECK, None)

    def batch_count(self, all_prompts: list, per_batch: int) -> int | None:
        """Rank 0's count (the most prompts) on every rank: a rank past its own prompts joins with none."""
        return -(-len(shard(all_prompts, 0, self.world)) // per_batch)

    def keyed(self, every: list, mine: list) -> list:
        return every  # one checkpoint holds every rank's state

    def step(self):
        return self.lockstep()  # rewards and teachers may run the model too

    def add(self, rows, signal, into):
        return self.shards.score(rows, signal, into=into)

    def signal_zeros(self, signal):
        return self.shards.zeros(self.shards.objectives)  # the objectives whose signal sums the memory mode keeps

    def squares_zeros(self):
        return self.shards.zeros(None, squares=True, totals=False).squares

    def masses(self, squares):
        return self.shards.masses(squares)  # the whole accumulator's sums: every rank's rows

    def share(self, rows: list) -> list:
        return rows  # every rank scores them all, in step

    def reduce(self, sums: ScoreSums) -> None:
        pass

    def checkpointer(self, cfg, key: dict) -> Checkpointer:
        # one checkpoint holding every rank's state (folder of rank 0 of 1), which rank 0 alone writes and removes;
        # only as many FSDP ranks can resume it
        return Checkpointer(cfg, 0, 1, {**key, "fsdp_ranks": self.world}, owner=self.rank == 0)

    def save(self, ckpt: Checkpointer, done: int, state: CalibrationState) -> None:
        """Rank 0 gathers the full sums and every rank's state, and writes them (collective)."""
        sums = self.shards.gather(state.sums)
        half = self._gather_half_a(None if state.halves is None else state.halves.squares_a)
        joined = capture_ranks(state, sums, half)
        if joined is not None:
            ckpt.save(done, *joined)

    def own_rows(self, sums: ScoreSums | None) -> ScoreSums | None:
        return self.shards.cut(sums)  # every rank read the full sums; it keeps its rows

    def _gather_half_a(self, half: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """The split halves' half-A squares, full on rank 0 (None elsewhere, and before any half-A prompt)."""
        if half is None:  # the same on every rank: every rank makes both halves' calls (before any: None)
            return None
        full = self.shards.gather(ScoreSums(half, None, None, 0))
        return None if full is None else full.squares

    def merge(self, loop) -> bool:
        """Rank 0 gets the full sums (and half-A squares), every rank's statistics and samples, and the
        split-half counts of all ranks; True there, False on the other ranks."""
        half = self._gather_half_a(None if loop.stability is None else loop.stability.squares_a)
        loop.sums = self.shards.gather(loop.sums)
        merge_records(loop)
        if loop.stability is not None:
            loop.stability.take_gathered(half)  # rank 0 closes the halves as one process does
        return loop.sums is not None


def merge_records(loop) -> None:
    """Every rank's objective statistics merged and sample records gathered, in rank order (collective)."""
    loop.stats = [merge_statistics(s) for s in loop.stats]
    loop.samples = [s for part in gather_objects(loop.samples) for s in part]


def choose(model, config, objectives, checkpoint, *, cov: Coverage, memory: MemoryMode, engine: dict, device,
           score_rows: int, pad: int) -> Single:
    """The mode of ``config.shard`` and the launcher: fsdp, data parallel (two or more ranks), or one process."""
    if config.shard == "fsdp":
        problems = fsdp.problems(model, config, objectives, checkpoint)
        if problems:
            raise FisherSelectError("; ".join(problems))
        return Fsdp(model, cov, memory, engine, device, objectives=len(objectives), score_rows=score_rows,
                    modules=bool(config.modules), pad=pad)
    if rank_world()[1] > 1:
        return DataParallel(model, cov, memory, engine, device)
    return Single(model, cov, memory, engine, device)
