"""``calibrate --shard fsdp``: weights and accumulators sharded over the ranks with FSDP2 (torchrun).

Each rank samples and scores its own share of the prompts with its own seed stream, as a
data-parallel run does, so the samples, signals and sums are those of a data-parallel run with
the same number of ranks. An FSDP2 forward is a collective (each layer all-gathers its
weights), so ranks that sample different prompts must still make the same forward calls:
``Lockstep`` has every forward of the model vote first, and a rank whose sampling is done keeps
making one-token forwards until every rank's is (synced generation). Each rank scores its own
rows through ``engine.sharded.score_sums_sharded`` (a rank with fewer rows scores padding
batches) into its rows of every parameter's sums (``Shards``). Rank 0 gathers the full sums, and
every rank's generator, statistics and samples, for a checkpoint and for the run. What is still
refused is listed by ``problems``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from fisher_select.distributed import rank_world
from fisher_select.engine.batching import micro_batches
from fisher_select.engine.scoring import Coverage, ScoreSums
from fisher_select.errors import FisherSelectError


SELFCHECK = "_fisher_select_selfcheck"  # where ``wrap`` leaves the rules' check for ``calibrate`` (checks.selfcheck)


def wrap(model: nn.Module, prompts: list[list[int]] | None = None, pad_id: int = 0, verify: bool = True) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root, on a 1-D mesh over all ranks (in place; frozen).

    First, while the full weights exist, the rules are checked against plain autograd
    (``engine.selfcheck``) on the first two of ``prompts`` (token ids, left-padded with ``pad_id``;
    their second halves as responses; None: two fixed rows of the vocabulary): a mismatch raises on
    every rank with the module named, before any sharding. ``verify=False`` skips it (as
    ``calibrate(verify=False)``). The result goes into the calibration's ``checks["selfcheck"]``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:  # checked first: it holds whatever the launcher
        raise FisherSelectError(f"--shard fsdp (calibration.fsdp.wrap): {type(model).__name__} has no model.layers "
                                "(the decoder layers FSDP2 shards one by one); calibrate it unsharded: drop --shard")
    _, world = rank_world()
    if world < 2:
        raise FisherSelectError("--shard fsdp (calibration.fsdp.wrap) shards over the ranks of a launcher: run it "
                                "under torchrun with --nproc_per_node 2 or more (one process: drop --shard)")
    checked = _check_rules(model, prompts, pad_id) if verify else None  # the same rows and weights on every rank
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (world,))
    for p in model.parameters():  # FSDP2's unsharded copies take requires_grad once, at their first forward (the
        p.requires_grad_(False)  # sampling); the engine needs them frozen: it rebuilds per-sample gradients itself
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if checked is not None:
        setattr(model, SELFCHECK, checked)
    return model


def _check_rules(model: nn.Module, prompts: list[list[int]] | None, pad_id: int) -> dict:
    """``engine.selfcheck.check_rules`` on two rows: the first prompts of two or more tokens, left-padded, their
    second halves the responses (None or none long enough: two fixed rows of token ids 1..7)."""
    from fisher_select.calibration.objectives.base import ScoringRow
    from fisher_select.calibration.sampling import pad_rows
    from fisher_select.engine.selfcheck import check_rules

    rows = [p for p in (prompts or []) if len(p) >= 2][:2] or [[1, 2, 3, 4, 5, 6, 7], [3, 5, 7, 2]]
    device = next(model.parameters()).device
    ids, mask, resp = pad_rows([ScoringRow(r, len(r) // 2) for r in rows], pad_id, device)  # (2, T) each
    was_training = model.training
    model.eval()  # as calibrate scores: no dropout makes the engine's pass and autograd's differ
    try:
        return {**check_rules(model, ids, mask, resp, rows=len(rows)), "on": "first prompts, before sharding"}
    finally:
        model.train(was_training)


def problems(model: nn.Module, config, objectives, checkpoint) -> list[str]:
    """What ``--shard fsdp`` does not run (yet), each with where it is refused and what to do instead."""
    from torch.distributed.tensor import DTensor

    out = []
    if rank_world()[1] < 2 or not any(isinstance(p, DTensor) for p in model.parameters()):
        out.append("shard=fsdp needs two or more ranks (torchrun) and a model wrapped by calibration.fsdp.wrap "
                   "(the CLI wraps it); one process: drop --shard")
    if config.accumulate_on != "device":
        out.append("--shard fsdp keeps each rank's rows of the accumulators on its device (they are 1/world of the "
                   "whole already): drop --accumulate-on cpu")
    token = [o.name for o in objectives if o.token_level]
    if token:
        out.append(f"--shard fsdp scores sequence-level objectives only; {token} are token-level (their sign draws "
                   "and token-weighted passes have no sharded accumulators yet): calibrate them without --shard")
    if checkpoint is not None and (checkpoint.every or checkpoint.resume) and checkpoint.model_id is None:
        out.append("--shard fsdp checkpoints need CheckpointConfig(model_id=fingerprint(model)['id']) computed "
                   "before calibration.fsdp.wrap (a sharded model has no full weights to fingerprint; "
                   "the CLI does this)")
    return out


class Shards:
    """This rank's rows of the calibration's sums, and the collectives that fill, measure, cut and gather them.

    Sums are plain ``ScoreSums`` whose tensors hold this rank's rows of each parameter, cut along
    its sharded dim as FSDP2 cuts it (``engine.sharded.Layout``; the whole tensor where the
    parameter is not sharded). Every method is a collective except ``zeros`` and ``cut``: all
    ranks call them in the same order.
    """

    def __init__(self, model: nn.Module, cov: Coverage, *, max_tokens: int | None, max_rows: int,
                 objectives: int | None, squares: bool = True, totals: bool = True, params: set[str] | None = None):
        from fisher_select.engine.scoring import _restricted, plan_coverage
        from fisher_select.engine.sharded import mesh_layouts, resharded

        # planned again on the sharded parameters: ``cov`` may hold the root's unsharded ones (after a forward)
        self.cov = _restricted(plan_coverage(resharded(model)), set(cov.shapes))
        self.model, self.max_tokens, self.max_rows = model, max_tokens, max_rows
        self.squares, self.totals, self.params = squares, totals, params
        self.objectives = objectives  # signal sums kept: one row per objective (None: the memory mode keeps none)
        self.layouts, self.group, self.rank, self.world = mesh_layouts(model, self.cov)

    def zeros(self, objectives: int | None, *, squares: bool | None = None, totals: bool | None = None) -> ScoreSums:
        """Zero rows of every kind this calibration keeps (signal sums: ``objectives`` rows, None: none);
        ``squares`` / ``totals`` override the memory mode (the split halves' squares alone)."""
        from fisher_select.engine.sharded import local_shape

        def rows(name: str, *lead: int) -> torch.Tensor:
            return torch.zeros(*lead, *local_shape(self.layouts[name]), device=self.cov.params[name].device)

        squares = self.squares if squares is None else squares
        totals = self.totals if totals is None else totals
        names = list(self.cov.shapes)
        return ScoreSums({n: rows(n) for n in names} if squares else None,
                         None if objectives is None else {n: rows(n, objectives) for n in names},
                         {n: rows(n) for n in names} if totals else None, 0)

    def score(self, rows: tuple | None, signal: torch.Tensor | None, into: ScoreSums | None = None) -> ScoreSums:
        """Add this rank's ``rows`` ((ids, mask, resp), each (B, T); None: it has none this call) with their
        signal (O, B) to ``into`` (new zeros when None), in micro-batches of the token budget; collective:
        every rank calls it as often as the others, each with its own rows; returns ``into``."""
        from fisher_select.engine.sharded import score_sums_sharded

        into = self.zeros(self.objectives) if into is None else into
        mine = []
        if rows is not None:
            ids, mask, resp = rows
            for part in micro_batches(mask, self.max_tokens, self.max_rows):
                pick = torch.tensor(part, device=ids.device)  # (b,)
                cut = mask.index_select(0, pick)
                start = int(cut.any(0).nonzero()[0])  # leading columns that are padding in every row
                piece = (ids.index_select(0, pick)[:, start:], cut[:, start:], resp.index_select(0, pick)[:, start:])
                mine.append(piece + (() if signal is None else (signal.index_select(1, pick),)))
        score_sums_sharded(self.model, mine, objectives=self.objectives, squares=into.squares is not None,
                           totals=into.total is not None, params=self.params, into=into)
        return into

    def masses(self, squares: dict[str, torch.Tensor]) -> list[float]:
        """Per parameter, the float64 sum of the whole accumulator over all ranks (a replicated one counted once)."""
        import torch.distributed as dist

        local = [float(t.sum(dtype=torch.float64)) if self.layouts[n].dim is not None or self.rank == 0 else 0.0
                 for n, t in squares.items()]
        total = torch.tensor(local, dtype=torch.float64, device=next(iter(squares.values())).device)
        dist.all_reduce(total, group=self.group)
        return total.tolist()

    def gather(self, sums: ScoreSums | None) -> ScoreSums | None:
        """The full sums on rank 0 (None elsewhere, and for None)."""
        from fisher_select.engine.sharded import ShardedScoreSums

        if sums is None:
            return None
        return ShardedScoreSums(sums.squares, sums.signal, sums.total, sums.count, self.layouts, 0, 0,
                                self.group, sums.expert_tokens, sums.expert_positions).gather(0)  # counts: all ranks'

    def cut(self, sums: ScoreSums | None) -> ScoreSums | None:
        """This rank's rows of full sums (a checkpoint's), on the parameters' devices."""
        from fisher_select.engine.sharded import cut_rows

        if sums is None:
            return None

        def rows(kind: str, lead: int) -> dict[str, torch.Tensor] | None:
            full = getattr(sums, kind)
            if full is None:
                return None
            return {n: cut_rows(t, self.layouts[n], lead).to(self.cov.params[n].device) for n, t in full.items()}

        # tokens per expert are every rank's already (summed over the ranks at each scoring call): kept whole
        return ScoreSums(rows("squares", 0), rows("signal", 1), rows("total", 0), sums.count,
                         {n: c.clone() for n, c in sums.expert_tokens.items()},
                         {n: c.clone() for n, c in sums.expert_positions.items()})


class Lockstep:
    """Ranks sampling different prompts make the same FSDP2 forwards: ``with lockstep(): ...sample...``.

    Inside the block every forward of the model first votes "busy" (an all-reduce of one integer,
    made before FSDP2's all-gathers: the hook is prepended to theirs). Leaving the block, a rank
    votes "done" and, while any other rank still voted busy, makes one-token forwards (no cache)
    to match that rank's forward; when every rank votes done, all leave together. So each round
    is one vote and one forward on every rank, however many prefill buckets and decoding steps
    each rank's own prompts need, and the dummy forwards change no rank's samples.
    """

    def __init__(self, model: nn.Module, pad_id: int):
        self.model, self.pad = model, pad_id
        self.device = next(model.parameters()).device
        self.dummies = 0  # one-token forwards this rank made to keep step (tests, logs)

    def _any_busy(self, busy: bool) -> bool:
        import torch.distributed as dist

        flag = torch.tensor([int(busy)], dtype=torch.long, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _vote(self, module, args, kwargs):
        self._any_busy(True)

    @contextmanager
    def __call__(self):
        handle = self.model.register_forward_pre_hook(self._vote, prepend=True, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()
        self._drain()  # not after an exception: that rank's error ends the run (its peers' collectives fail)

    @torch.no_grad()
    def _drain(self) -> None:
        ids = torch.full((1, 1), self.pad, dtype=torch.long, device=self.device)  # (1, 1)
        while self._any_busy(False):
            self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            self.dummies += 1
