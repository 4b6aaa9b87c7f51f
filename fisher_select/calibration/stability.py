"""The stability diagnostics of a calibration (``calibrate(stability=True)``): split halves and per-call masses."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fisher_select.distributed import all_reduce_int, all_reduce_sums, gather_objects
from fisher_select.engine.memory import MemoryMode
from fisher_select.engine.scoring import Coverage, ScoreSums
from fisher_select.stats.stability import SplitHalf, compare_halves


@dataclass
class HalvesState:
    """What a checkpoint keeps of ``Stability`` (``squares_a``: None before any half-A prompt)."""

    samples: list[int]
    prompts: list[int]
    unit_masses: list[list[float]]
    unit_counts: list[int]
    running: list[list[float]]
    squares_a: dict[str, torch.Tensor] | None = field(default=None, repr=False)


class Stability:
    """Split halves of the prompts and per-call masses of the squared scores (``calibrate(stability=True)``).

    Prompts with an even ``PromptRecord.index`` form half A, odd ones half B; each batch is scored
    in two calls, B then A, at no extra backward cost. Half A's squared scores go to their own fp32
    accumulator, 4 bytes per covered parameter coordinate for the whole calibration (beside the
    4 + 4 + 4 O of the shared squares, score sums and O signal sums); its score and signal sums join
    the shared ones. The shared squares hold half B alone until ``close`` folds A in, so both
    halves are exact sums (no total - half cancellation). Each call is one unit of the spread of
    module masses: its per-parameter sum of h^2 and its sample count.

    ``parallel`` (``calibration.parallel``) makes the scoring calls and sums the masses: under
    fsdp every accumulator holds this rank's rows, the bookkeeping is every rank's, and every call
    is a collective made even by a rank without rows of that half.
    """

    def __init__(self, cov: Coverage, memory: MemoryMode, parallel):
        self.cov, self.memory, self.parallel = cov, memory, parallel
        self.names = list(cov.shapes)
        self.squares_a: dict[str, torch.Tensor] | None = None
        self.samples, self.prompts = [0, 0], [0, 0]  # [half A, half B]
        self.unit_masses: list[list[float]] = []
        self.unit_counts: list[int] = []
        self._running = [[0.0] * len(self.names), [0.0] * len(self.names)]  # per half: running sums per parameter

    def state(self) -> HalvesState:
        return HalvesState(self.samples, self.prompts, self.unit_masses, self.unit_counts, self._running,
                           self.squares_a)

    def restore(self, state: HalvesState) -> None:
        self.samples, self.prompts, self.unit_masses = state.samples, state.prompts, state.unit_masses
        self.unit_counts, self._running, self.squares_a = state.unit_counts, state.running, state.squares_a

    def _squares(self) -> dict[str, torch.Tensor]:
        if self.squares_a is None:
            self.squares_a = self.parallel.squares_zeros()
        return self.squares_a

    def score(self, model, batch, signal: torch.Tensor | None, sums: ScoreSums | None) -> ScoreSums:
        """Score ``batch`` (a ``batches.Batch``; signal: (O, B)) into ``sums`` (created on the first call).

        fsdp: both halves' calls are collectives, made on every rank even where this rank has no rows
        of a half (``batch`` None: a rank past its own prompts); a call is one unit of the spread of
        module masses over all ranks' rows (``Shards.masses``), counted when any rank had rows."""
        groups = [] if batch is None else batch.groups
        for half in (1, 0):
            picked = [j for j, g in enumerate(groups) if g.record.index % 2 == half]
            if not picked and not self.parallel.collective:
                continue
            sums = self.parallel.signal_zeros(signal) if sums is None else sums
            # half A's squares apart; its score and signal sums and its tokens per expert (the same dicts) shared
            target = sums if half == 1 else ScoreSums(self._squares(), sums.signal, sums.total, 0, sums.expert_tokens,
                                                      sums.expert_positions)
            before = target.count
            rows = self._rows(batch, picked)  # (b,) or None
            part = None if rows is None else tuple(t.index_select(0, rows) for t in
                                                   (batch.input_ids, batch.attention_mask, batch.response_mask))
            if part is not None:
                start = int(part[1].any(0).nonzero()[0])  # padding columns these rows share
                part = tuple(t[:, start:] for t in part)  # (b, T') each
            self.parallel.add(part, None if rows is None or signal is None else signal.index_select(1, rows), target)
            counted = target.count - before  # fsdp: every rank's rows of this call
            if half == 0:
                sums.count += target.count
            self.samples[half] += 0 if rows is None else len(rows)
            self.prompts[half] += len(picked)
            if counted:
                self._unit(half, target.squares, counted)
        return sums

    @staticmethod
    def _rows(batch, picked: list[int]) -> torch.Tensor | None:
        """The row indices (b,) of the ``picked`` groups' responses; None when none are picked."""
        if not picked:
            return None
        k = batch.input_ids.shape[0] // len(batch.groups)  # rows per group
        return torch.tensor([j * k + i for j in picked for i in range(k)], device=batch.input_ids.device)

    def _unit(self, half: int, squares: dict[str, torch.Tensor], count: int) -> None:
        now = self.parallel.masses({n: squares[n] for n in self.names})
        self.unit_masses.append([a - b for a, b in zip(now, self._running[half])])
        self.unit_counts.append(count)
        self._running[half] = now

    def merge_ranks(self) -> None:
        """Data parallel: every rank's half-A squares summed, counts summed and units gathered (collective)."""
        device = self.parallel.device
        all_reduce_sums(self._squares())
        self.samples = [all_reduce_int(c, device) for c in self.samples]
        self.prompts = [all_reduce_int(c, device) for c in self.prompts]
        parts = gather_objects((self.unit_masses, self.unit_counts))
        self.unit_masses = [u for masses, _ in parts for u in masses]
        self.unit_counts = [c for _, counts in parts for c in counts]

    def take_gathered(self, squares_a: dict[str, torch.Tensor] | None) -> None:
        """fsdp: the full half-A squares gathered on rank 0 and every rank's counts (the per-call masses are
        every rank's already, ``Shards.masses``); rank 0 then closes the halves as one process does."""
        device = self.parallel.device
        self.samples = [all_reduce_int(c, device) for c in self.samples]
        self.prompts = [all_reduce_int(c, device) for c in self.prompts]
        self.squares_a = squares_a

    def close(self, sums: ScoreSums) -> SplitHalf | None:
        """After the ranks are merged: compare the halves, then fold half A into ``sums.squares``."""
        squares_a = self.squares_a
        if squares_a is None:  # no half-A prompt anywhere
            squares_a = ScoreSums.zeros(self.cov, None, totals=False, device=self.memory.device).squares
        split = compare_halves(squares_a, sums.squares, self.samples, self.prompts) if min(self.prompts) else None
        for name, t in squares_a.items():
            sums.squares[name].add_(t)
        self.squares_a = None
        return split
