"""Data-parallel calibration under torchrun / accelerate: each rank samples and scores its own
share of the prompts; sums, counts, objective statistics (by their ``merge``) and samples are
merged at the end.

Nothing here runs unless ``torch.distributed`` is initialised (``init_from_env`` does that when
the launcher set ``WORLD_SIZE > 1``); a single process behaves exactly as before.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_env(device: str) -> str:
    """Join the process group a launcher describes; return this rank's device.

    ``device="cuda"`` becomes ``cuda:<LOCAL_RANK>`` so each rank drives its own GPU.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return device
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, device_id=torch.device(device) if backend == "nccl" else None)
    return device


def seed_for_rank(seed: int, rank: int) -> int:
    """Rank 0 keeps the seed (single-process runs are unchanged); other ranks get their own stream."""
    return seed + 1_000_003 * rank


def shard(items: list, rank: int, world: int) -> list:
    """Every world-th item starting at rank: balanced to within one prompt."""
    return items[rank::world]


def all_reduce_sums(*dicts: dict[str, torch.Tensor]) -> None:
    """Sum tensors in place across ranks (fp32 accumulators stay fp32)."""
    for tensors in dicts:
        for t in tensors.values():
            dist.all_reduce(t)


def all_reduce_int(value: int, device) -> int:
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t)
    return int(t.item())


def gather_objects(obj, group=None) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (of ``group``; None: the world)."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_reduce_counts(counts: dict[str, torch.Tensor], group=None) -> None:
    """Sum integer count vectors (name -> (E,)) over ranks, in place; a rank may lack names others have
    (it scored no batch): the lists travel as objects, so every rank ends with the same keys and sums.
    The one reduction of MoE routing counts: data parallel calibration and sharded scoring both use it."""
    merged: dict[str, list[int]] = {}
    for part in gather_objects({n: c.tolist() for n, c in counts.items()}, group):
        for name, values in part.items():
            merged[name] = [a + b for a, b in zip(merged[name], values)] if name in merged else list(values)
    counts.clear()
    counts.update({n: torch.tensor(v, dtype=torch.int64) for n, v in sorted(merged.items())})


def merge_statistics(stats):
    """Every rank's statistics merged in rank order (``to_dict`` travels, ``merge`` combines)."""
    parts = [type(stats).from_dict(d) for d in gather_objects(stats.to_dict())]
    merged = parts[0]
    for part in parts[1:]:
        merged = merged.merge(part)
    return merged
