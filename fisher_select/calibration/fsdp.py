"""``calibrate --shard fsdp``: weights and accumulators sharded over the ranks with FSDP2 (torchrun).

Every rank samples every prompt with the same seed, in step: an FSDP2 forward is a collective
(each layer all-gathers its weights), so the ranks must make the same forward calls, and
identical work is the one schedule that needs no coordination; the samples, signals and
objective statistics are then those of one process. The scoring is what is split: each
micro-batch's rows go round-robin to the ranks, which score them through
``engine.sharded.score_sums_sharded`` (each rank keeps its rows of every parameter's sums), and
rank 0 gathers the full sums to write the run. What this first cut refuses is listed by
``problems``.
"""

from __future__ import annotations

import torch
from torch import nn

from fisher_select.distributed import rank_world
from fisher_select.engine.batching import micro_batches
from fisher_select.engine.scoring import ScoreSums
from fisher_select.errors import FisherSelectError


def wrap(model: nn.Module) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root, on a 1-D mesh over all ranks (in place; frozen)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, world = rank_world()
    if world < 2:
        raise FisherSelectError("--shard fsdp shards over the ranks of a launcher: run it under torchrun with "
                                "--nproc_per_node 2 or more (one process: drop --shard)")
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (world,))
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise FisherSelectError(f"--shard fsdp: {type(model).__name__} has no model.layers to shard layer by layer; "
                                "score it unsharded (drop --shard)")
    for p in model.parameters():  # FSDP2's unsharded copies take requires_grad once, at their first forward (the
        p.requires_grad_(False)  # sampling); the engine needs them frozen: it rebuilds per-sample gradients itself
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def problems(model: nn.Module, config, objectives, checkpoint) -> list[str]:
    """What ``--shard fsdp`` does not run (yet), each with what to do instead."""
    from torch.distributed.tensor import DTensor

    out = []
    if rank_world()[1] < 2 or not any(isinstance(p, DTensor) for p in model.parameters()):
        out.append("shard=fsdp needs two or more ranks (torchrun) and a model wrapped by calibration.fsdp.wrap "
                   "(the CLI wraps it); one process: drop --shard")
    if config.stability:
        out.append("--shard fsdp keeps no split-half diagnostics: add --no-stability")
    if config.accumulate_on != "device":
        out.append("--shard fsdp shards the accumulators already: drop --accumulate-on cpu")
    token = [o.name for o in objectives if o.token_level]
    if token:
        out.append(f"--shard fsdp scores sequence-level objectives only, not {token}: drop --shard for them")
    if checkpoint is not None and (checkpoint.every or checkpoint.resume):
        out.append("--shard fsdp writes no checkpoints: drop --checkpoint-every / --resume")
    return out


def score_collected(model: nn.Module, batches: list, objectives: int | None, *, squares: bool, totals: bool,
                    params: set[str] | None, max_tokens: int | None, max_rows: int) -> ScoreSums | None:
    """Score every collected batch ``(ids, mask, response mask, signal (O, B) or None)``, this rank's
    rows of each micro-batch; the full sums on rank 0, None on the other ranks (collective)."""
    from fisher_select.engine.sharded import score_sums_sharded

    rank, world = rank_world()
    mine = []
    for ids, mask, resp, signal in batches:
        budget = None if max_tokens is None else max_tokens * world  # each rank's share: max_tokens, max_rows
        for part in micro_batches(mask, budget, max_rows * world):
            rows = part[rank::world]
            if not rows:
                continue
            pick = torch.tensor(rows, device=ids.device)  # (b,)
            cut = mask.index_select(0, pick)
            start = int(cut.any(0).nonzero()[0])  # leading columns that are padding in every row
            piece = (ids.index_select(0, pick)[:, start:], cut[:, start:], resp.index_select(0, pick)[:, start:])
            mine.append(piece + (() if signal is None else (signal.index_select(1, pick),)))
    sums = score_sums_sharded(model, mine, objectives=objectives, squares=squares, totals=totals, params=params)
    return sums.gather(0)
