"""Scoring an FSDP2-sharded model (``torch.distributed.fsdp.fully_shard``) with sharded accumulators.

Samples split across ranks, coordinates do not (docs/SCALING.md): each rank scores its own
samples with the ordinary engine, whose layer hooks see the all-gathered weights of each layer,
so every rank builds complete per-sample contributions for its samples. As soon as a
parameter's sums for the batch are complete (``score_sums(done=)``, inside the backward for
rule-covered parameters), the full-shape buffer is reduce-scattered: summed over ranks and cut
along the parameter's sharded dim exactly as FSDP2 cuts it (``torch.chunk`` rows, the last ranks
getting fewer or none when the dim does not divide), then freed. Each rank keeps only the rows of
the parameters' shards it owns; ``ShardedScoreSums.gather`` assembles the full sums on one rank.

Every rank must call :func:`score_sums_sharded` with the same model layout; ranks with fewer
batches score padding batches (one row, empty response mask: zero contribution), so all ranks
enter the same collectives in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fisher_select.distributed import all_reduce_counts
from fisher_select.engine.scoring import DEFAULT_BLOCK, Coverage, ScoreSums, _restricted, plan_coverage, score_sums
from fisher_select.errors import FisherSelectError

KINDS = ("squares", "signal", "total")
# torch 2.13 renamed reduce_scatter_tensor (same arguments) and warns on the old name
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Layout:
    """Which part of one parameter's accumulators this rank keeps.

    ``dim`` is the parameter's sharded dim (None: not sharded, the sums are all-reduced and every
    rank keeps all of them); this rank holds indices ``start:stop`` of that dim; ``chunk`` is
    FSDP2's padded shard size, ``ceil(size / world)``.
    """

    shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0
    chunk: int = 0


def _mesh_of(model: nn.Module):
    from torch.distributed.tensor import DTensor

    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    if not meshes:
        raise FisherSelectError("score_sums_sharded needs a model wrapped with torch.distributed.fsdp.fully_shard "
                                "(no parameter is a DTensor)")
    if len(meshes) > 1:
        raise FisherSelectError("score_sums_sharded supports one device mesh for all parameters, got "
                                f"{len(meshes)}")
    (mesh,) = meshes.values()
    if mesh.ndim != 1:
        raise FisherSelectError(f"score_sums_sharded supports a 1-D mesh (plain FSDP), got {mesh.ndim} dims (HSDP)")
    return mesh


def layout_of(p: nn.Parameter, shape: tuple[int, ...], rank: int, world: int) -> Layout:
    """This rank's part of the accumulators of ``p``, cut as FSDP2 cuts its ``Shard(d)`` placement."""
    from torch.distributed.tensor import DTensor, Shard

    shape = tuple(shape)
    if not isinstance(p, DTensor) or tuple(p.shape) != shape:
        return Layout(shape)  # not sharded (or a packed weight whose Fisher shape differs): replicated
    (placement,) = p.placements
    if not isinstance(placement, Shard):
        return Layout(shape)
    dim = placement.dim % len(shape)
    size = shape[dim]
    chunk = math.ceil(size / world)
    start = min(size, rank * chunk)
    stop = min(size, start + chunk)
    local = tuple(p.to_local().shape)
    if local[dim] != stop - start:
        raise FisherSelectError(f"unexpected FSDP2 shard of {tuple(shape)} on rank {rank} of {world}: local shape "
                                f"{local}, expected {stop - start} of dim {dim}")
    return Layout(shape, dim, start, stop, chunk)


def resharded(model: nn.Module) -> nn.Module:
    """``model`` with every FSDP2 module's sharded parameters registered (in place).

    The root keeps its parameters unsharded after a forward without backward (FSDP2 expects the
    backward to need them at once), so after sampling its embedding, norm and head are plain
    tensors; read then, their layouts would say "replicated" while earlier calls kept shards.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()  # not recursive; a no-op where already sharded
    return model


def mesh_layouts(model: nn.Module, cov: Coverage) -> tuple[dict[str, Layout], object, int, int]:
    """(layouts of every covered parameter, process group, rank, world) of the model's FSDP2 mesh.

    ``cov``: the coverage planned on the model with its sharded parameters registered (``resharded``)."""
    mesh = _mesh_of(model)
    rank, world = mesh.get_local_rank(), mesh.size()
    layouts = {n: layout_of(cov.params[n], cov.shapes[n], rank, world) for n in cov.shapes}
    return layouts, mesh.get_group(), rank, world


def local_shape(lay: Layout) -> tuple[int, ...]:
    """The shape of this rank's rows of a parameter's accumulator (no objectives axis)."""
    shape = list(lay.shape)
    if lay.dim is not None:
        shape[lay.dim] = lay.stop - lay.start
    return tuple(shape)


def cut_rows(t: torch.Tensor, lay: Layout, lead: int = 0) -> torch.Tensor:
    """This rank's rows of a full-shape accumulator ``t`` (``lead`` leading axes before the parameter's
    shape: 1 for signal sums), a copy, so the full tensor can be freed."""
    if lay.dim is None:
        return t.clone()
    return t.narrow(lay.dim + lead, lay.start, lay.stop - lay.start).clone()


def _padded(t: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """``t`` moved to put ``dim`` first, zero-padded to ``rows`` along it, contiguous."""
    x = t.movedim(dim, 0)
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros(rows, *x.shape[1:])
    out[: x.shape[0]] = x
    return out


class _Buffers(dict):
    """Full-shape per-batch sums, allocated when the engine first adds to a parameter."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, name):
        value = self[name] = self.make(name)
        return value


class _Scatter:
    """Per-rank state: the shards kept, the full-shape buffers of the batch, the collectives."""

    def __init__(self, cov: Coverage, layouts: dict[str, Layout], kinds: tuple[str, ...], objectives: int | None,
                 group, rank: int, world: int, dtype: torch.dtype, into: ScoreSums | None = None):
        self.cov, self.layouts, self.kinds, self.objectives = cov, layouts, kinds, objectives
        self.group, self.rank, self.world, self.dtype = group, rank, world, dtype
        self.live = self.peak = 0
        self.shards = {k: self._kept(k, into) for k in kinds}
        self.full = {k: _Buffers(lambda n, k=k: self._zeros(n, k)) for k in kinds}

    def _kept(self, kind: str, into: ScoreSums | None) -> dict[str, torch.Tensor]:
        """The rows this rank keeps: ``into``'s (running sums of earlier calls), else new zeros."""
        if into is None:
            return {n: self._zeros(n, kind, local=True) for n in self.cov.shapes}
        kept = getattr(into, kind)
        for n in self.cov.shapes:
            want = (*self._lead(kind), *local_shape(self.layouts[n]))
            if kept is None or n not in kept or tuple(kept[n].shape) != want:
                got = None if kept is None or n not in kept else tuple(kept[n].shape)
                raise FisherSelectError(f"into= holds no rows {want} of {kind} sums of {n} (got {got}): pass the "
                                        "sums of an earlier call with the same model, kinds and objectives")
            self._count(kept[n].numel() * kept[n].element_size())
        return kept

    def _lead(self, kind: str) -> tuple[int, ...]:
        return (self.objectives,) if kind == "signal" else ()

    def _zeros(self, name: str, kind: str, local: bool = False) -> torch.Tensor:
        lay = self.layouts[name]
        shape = local_shape(lay) if local else lay.shape
        t = torch.zeros(*self._lead(kind), *shape, dtype=self.dtype, device=self.cov.params[name].device)
        self._count(t.numel() * t.element_size())
        return t

    def _count(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sums(self) -> ScoreSums:
        """What ``score_sums(into=)`` adds to: the full-shape buffers."""
        get = lambda k: self.full[k] if k in self.kinds else None  # noqa: E731
        return ScoreSums(get("squares"), get("signal"), get("total"), 0)

    def done(self, name: str) -> None:
        """The batch's sums of ``name`` are complete: reduce them to their owners and free them."""
        lay = self.layouts[name]
        for kind in self.kinds:
            buf = self.full[kind].pop(name, None)
            if buf is None:  # nothing added on this rank (yet every rank joins the collective)
                buf = self._zeros(name, kind)
            nbytes = buf.numel() * buf.element_size()
            shard = self.shards[kind][name]
            if lay.dim is None:
                dist.all_reduce(buf, group=self.group)
                shard.add_(buf)
            else:
                dim = lay.dim + len(self._lead(kind))
                send = _padded(buf, dim, lay.chunk * self.world)
                out = send.new_empty(lay.chunk, *send.shape[1:])
                extra = out.numel() * out.element_size()
                extra += 0 if send.data_ptr() == buf.data_ptr() else send.numel() * send.element_size()
                self._count(extra)  # transient: the padded copy and the received rows
                _reduce_scatter(out, send, group=self.group)
                shard.add_(out[: lay.stop - lay.start].movedim(0, dim))
                del send, out
                self._count(-extra)
            del buf
            self._count(-nbytes)

    def leftover(self) -> list[str]:
        return sorted({n for k in self.kinds for n in self.full[k]})


@dataclass
class ShardedScoreSums:
    """This rank's part of the sums over all ranks' samples (``ScoreSums`` cut like the shards).

    ``squares[name]`` holds indices ``layouts[name].start:stop`` of the parameter's sharded dim
    (all of it where ``layouts[name].dim`` is None); ``signal`` values have a leading objectives
    axis. ``count``: real rows over all ranks (padding batches excluded). ``peak_bytes``: the
    most accumulator memory this rank held at once (shards plus full-shape buffers in flight);
    ``full_bytes``: what unsharded accumulators of the same kinds take.
    """

    squares: dict[str, torch.Tensor] | None
    signal: dict[str, torch.Tensor] | None
    total: dict[str, torch.Tensor] | None
    count: int
    layouts: dict[str, Layout]
    peak_bytes: int
    full_bytes: int
    group: object = None
    # tokens per expert of each MoE experts module, summed over every rank's real rows (as ScoreSums)
    expert_tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    expert_positions: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.squares, self.signal, self.total) if d for t in d.values())

    def gather(self, dst: int = 0) -> ScoreSums | None:
        """The full sums on group rank ``dst`` (for writing a run), None on the other ranks.

        Collective: every rank must call it. One parameter at a time, so no rank holds more than
        one parameter's full sums beyond what ``dst`` assembles.
        """
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        root = dist.get_global_rank(self.group, dst) if self.group is not None else dst
        out = {}
        for kind in KINDS:
            sums = getattr(self, kind)
            if sums is None:
                out[kind] = None
                continue
            out[kind] = {}
            lead = 1 if kind == "signal" else 0
            for name, t in sums.items():
                lay = self.layouts[name]
                if lay.dim is None:
                    out[kind][name] = t
                    continue
                dim = lay.dim + lead
                send = _padded(t, dim, lay.chunk)
                parts = [torch.empty_like(send) for _ in range(world)] if rank == dst else None
                dist.gather(send, parts, dst=root, group=self.group)
                if rank == dst:
                    out[kind][name] = torch.cat(parts)[: lay.shape[lay.dim]].movedim(0, dim).contiguous()
        if rank != dst:
            return None
        return ScoreSums(out["squares"], out["signal"], out["total"], self.count, self.expert_tokens,
                         self.expert_positions)


def _padding_batch(device, objectives: int | None):
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    signal = None if objectives is None else torch.zeros(objectives, 1, device=device)
    return ids, torch.ones_like(ids), torch.zeros(1, 2, dtype=torch.bool, device=device), signal


def score_sums_sharded(
    model: nn.Module, batches, *, objectives: int | None = None, squares: bool = True, totals: bool = True,
    params: "set[str] | None" = None, block: int = DEFAULT_BLOCK, accumulate_dtype: torch.dtype = torch.float32,
    into: ScoreSums | None = None,
) -> ShardedScoreSums:
    """Sums over every rank's samples of per-sample scores, kept sharded like the parameters.

    Collective: every rank of the model's FSDP2 mesh calls it with its own ``batches``, a list
    of ``(input_ids, attention_mask, response_mask)`` or ``(..., signal)`` tuples as
    :func:`score_sums` takes them (``signal``: (B,) or (objectives, B); pass ``objectives`` to
    keep signal sums, whose values then always have a leading objectives axis). ``model``:
    wrapped with ``fully_shard`` (each decoder layer, then the root) on a 1-D mesh. Ranks may
    have different numbers of batches: the short ones score padding batches. ``squares``,
    ``totals`` and ``params`` as in ``score_sums`` (the memory modes). ``into``: this rank's rows
    of earlier sums (a ``ShardedScoreSums`` or a ``ScoreSums`` holding rows cut by ``cut_rows``,
    same kinds and objectives) to add to in place; its ``count`` grows by this call's rows.

    Parameters no rule covers are refused: their exact fallback differentiates with respect to
    the parameter, and under FSDP2 the gradient reaches the all-gathered copy, not the shard.
    """
    batches = list(batches)
    cov, kinds = _checked(model, batches, objectives, squares, totals, params)
    layouts, group, rank, world = mesh_layouts(model, cov)
    device = next(iter(cov.params.values())).device
    rows = torch.tensor([sum(int(b[0].shape[0]) for b in batches)], dtype=torch.long, device=device)
    steps = torch.tensor([len(batches)], dtype=torch.long, device=device)
    dist.all_reduce(rows, group=group)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group)  # every rank scores this many batches
    steps, rows = int(steps), int(rows)
    scatter = _Scatter(cov, layouts, kinds, objectives, group, rank, world, accumulate_dtype, into)
    routes = ScoreSums(None, None, None, 0)  # this rank's tokens per expert (MoE), reduced at the end
    lead = lambda k: objectives if k == "signal" else 1  # noqa: E731
    full_bytes = sum(math.prod(s) * lead(k) for s in cov.shapes.values() for k in kinds)
    full_bytes *= torch.empty((), dtype=accumulate_dtype).element_size()
    for step in range(steps):
        ids, attn, resp, *rest = batches[step] if step < len(batches) else _padding_batch(device, objectives)
        signal = None if objectives is None else rest[0].reshape(objectives, ids.shape[0])  # always (O, B)
        batch_sums = score_sums(model, ids, attn, resp, signal, block=block, coverage=cov, into=scatter.sums(),
                                accumulate_dtype=accumulate_dtype, done=scatter.done)
        _add_routes(routes, batch_sums, real=step < len(batches))
        left = scatter.leftover()
        if left:  # cannot happen: score_sums reports every parameter
            raise FisherSelectError(f"sharded scoring: sums of {left[:5]} were never reduced")
    _reduce_routes(routes, into, group)
    get = lambda k: scatter.shards[k] if k in kinds else None  # noqa: E731
    if into is not None:
        into.count += rows
        rows = into.count
    return ShardedScoreSums(get("squares"), get("signal"), get("total"), rows, layouts, scatter.peak, full_bytes, group,
                            routes.expert_tokens, routes.expert_positions)


def _checked(model: nn.Module, batches: list, objectives: int | None, squares: bool, totals: bool, params):
    """The coverage of the parameters asked for and the kinds of sums to keep, after the input checks."""
    cov = _restricted(plan_coverage(resharded(model)), params)  # the same layouts after a sampling forward
    if cov.fallback:
        raise FisherSelectError("score_sums_sharded covers rule-covered parameters only; no rule covers "
                                f"{sorted(cov.fallback)[:5]} (restrict with params=, or score unsharded)")
    for i, batch in enumerate(batches):
        has_signal = len(batch) == 4 and batch[3] is not None
        if has_signal != (objectives is not None):
            raise FisherSelectError(f"batch {i} {'has' if has_signal else 'lacks'} a signal, objectives={objectives}: "
                                    "pass objectives= (the signal's rows) exactly when the batches carry a signal")
    kinds = tuple(k for k, on in zip(KINDS, (squares, objectives is not None, totals)) if on)
    if not kinds:
        raise FisherSelectError("nothing to accumulate: squares=False, totals=False and no objectives")
    return cov, kinds


def _reduce_routes(routes: ScoreSums, into: ScoreSums | None, group) -> None:
    """Sum this call's tokens per expert over ranks, then onto ``into``'s counts of earlier calls (if any)."""
    for kind in ("expert_tokens", "expert_positions"):
        counts = getattr(routes, kind)
        all_reduce_counts(counts, group)
        if into is not None:
            earlier = getattr(into, kind)
            counts.update({n: c + earlier[n] if n in earlier else c for n, c in counts.items()})
            earlier.update(counts)


def _add_routes(routes: ScoreSums, batch: ScoreSums, real: bool) -> None:
    """Add one batch's tokens per expert; a padding batch adds zeros (its modules still join the reduction)."""
    for mine, new in ((routes.expert_tokens, batch.expert_tokens), (routes.expert_positions, batch.expert_positions)):
        for name, counts in new.items():
            counts = counts if real else torch.zeros_like(counts)
            mine[name] = mine[name] + counts if name in mine else counts.clone()
