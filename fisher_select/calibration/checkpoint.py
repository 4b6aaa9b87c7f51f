"""Checkpoints of a calibration pass, so ``calibrate --resume`` continues after a kill (SIGKILL included).

Every ``checkpoint_every`` prompt batches the calibrator's whole state is written: the fp32
accumulators (F squares, score and signal sums, the token-level and split-half ones), the
sampling and sign generators' exact states, the tokens routed to each expert (MoE), the objectives'
statistics, the checks and the sample records. Tensors go to safetensors, the rest to JSON: nothing is pickled, nothing is loaded with
``torch.load``. A resumed pass restores that state and runs the remaining batches with the same
operations in the same order, so on the CPU its result is bit-identical to an uninterrupted run.

Layout (beside the run directory ``OUT``)::

    OUT.checkpoint/rank-000-of-001/batch-000004/{manifest.json, tensors.safetensors, samples.jsonl}

Each checkpoint directory is written atomically (``atomic.write_dir``: complete or absent), the
older ones are removed only after the newer one is in place, and the newest complete one is
resumed. Under torchrun each rank checkpoints its own shard of prompts (ranks never communicate
before the final merge, so no gathering is needed); a resume needs the same number of ranks.
What is written is a ``CalibrationState`` (the calibrator's ``state()``, put back by its ``restore``).
Under ``shard: fsdp`` rank 0 gathers the full sums and every rank's generator, statistics and
samples and writes one checkpoint (folder ``rank-000-of-001``, key ``fsdp_ranks``), which as many
FSDP ranks resume, each taking its own state and its rows of the sums.
The manifest records what the state depends on (settings, objectives, prompts, model); a
checkpoint of another calibration is refused, naming what differs.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fisher_select.atomic import write_dir
from fisher_select.calibration.stability import HalvesState
from fisher_select.calibration.token_level import TokenState
from fisher_select.engine.scoring import ScoreSums
from fisher_select.errors import FisherSelectError
from fisher_select.run.io import read_json, read_samples, read_tensors, save_tensors
from fisher_select.run.names import (CHECKPOINT_BATCH_DIR, CHECKPOINT_BATCH_PATTERN, CHECKPOINT_MANIFEST,
                                     CHECKPOINT_RANK_DIR, CHECKPOINT_SAMPLES, CHECKPOINT_TENSORS)

FORMAT = 1
MANIFEST, TENSORS, SAMPLES = CHECKPOINT_MANIFEST, CHECKPOINT_TENSORS, CHECKPOINT_SAMPLES
_BATCH_DIR = re.compile(CHECKPOINT_BATCH_PATTERN)
_SUMS = ("squares", "total", "signal")
_COUNTS = ("expert_tokens", "expert_positions")  # ScoreSums' tokens per expert of MoE layers


@dataclass
class CheckpointConfig:
    """Where checkpoints go, how often, and whether to continue from one."""

    folder: Path  # OUT.checkpoint: one subfolder per rank
    every: int | None = None  # prompt batches between checkpoints; None: write none
    resume: bool = False  # continue from the newest checkpoint in ``folder`` when there is one
    discard_existing: bool = False  # not resuming: remove an old checkpoint instead of refusing to start
    model_id: str | None = None  # the model's fingerprint id (computed from the model when None)
    keep_when_done: bool = False  # True: the caller discards them once the result is safely written


def digest(obj) -> str:
    """sha256 of a JSON-able object (the manifest's record of prompts and objectives)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


class Checkpointer:
    """One rank's checkpoints: write every ``every`` batches, find and check the newest, discard."""

    def __init__(self, cfg: CheckpointConfig, rank: int, world: int, key: dict, owner: bool = True):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.owner = owner  # False: reads this folder but never removes it (fsdp ranks other than 0)
        self.key = {"format": FORMAT, "rank": rank, "world": world, **key}
        self.dir = rank_folder(cfg, rank, world)
        self.loaded: Path | None = None  # the checkpoint ``load`` read
        self._check_start()

    def _check_start(self) -> None:
        # Another world size wrote these. A rank of the same world without a complete checkpoint of
        # its own (killed before its first one finished) restarts its shard: shards are independent.
        others = [p.name for p in Path(self.cfg.folder).glob(CHECKPOINT_RANK_DIR.split("{")[0] + "*")
                  if p.is_dir() and p != self.dir and not p.name.endswith(f"-of-{self.world:03d}")]
        if self.cfg.resume and not self._newest() and others:
            raise FisherSelectError(
                f"checkpoint folder {self.cfg.folder} holds {', '.join(sorted(others))} but this is rank {self.rank} "
                f"of {self.world}: resume with the number of processes that wrote it")
        if not self.cfg.resume and self._newest() is not None:
            if not self.cfg.discard_existing:
                raise FisherSelectError(
                    f"{self._newest()} is the checkpoint of an interrupted calibration: pass --resume to continue it, "
                    f"or --overwrite to start over (it is deleted), or remove {self.cfg.folder}")
            if self.owner:
                shutil.rmtree(self.dir, ignore_errors=True)

    def _newest(self) -> Path | None:
        if not self.dir.is_dir():
            return None
        done = [p for p in self.dir.iterdir() if _BATCH_DIR.match(p.name) and (p / MANIFEST).is_file()]
        return max(done, key=lambda p: p.name) if done else None

    def due(self, batches_done: int, total: int) -> bool:
        every = self.cfg.every
        return every is not None and batches_done < total and batches_done % every == 0

    def save(self, batches_done: int, tensors: dict[str, torch.Tensor], meta: dict, samples: list[dict]) -> Path:
        """Write one checkpoint atomically, then remove the older ones."""
        def writer(tmp: Path) -> None:
            save_tensors(tmp / TENSORS, tensors)
            with open(tmp / SAMPLES, "w") as fh:
                fh.writelines(json.dumps(s) + "\n" for s in samples)
            manifest = {**self.key, "batches_done": batches_done, "state": meta}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))  # written last: its presence marks completion

        target = write_dir(self.dir / CHECKPOINT_BATCH_DIR.format(batches=batches_done), writer, overwrite=True)
        for old in self.dir.iterdir():
            if _BATCH_DIR.match(old.name) and old.name < target.name:
                shutil.rmtree(old, ignore_errors=True)
        return target

    def load(self) -> tuple[int, dict[str, torch.Tensor], dict, list[dict]] | None:
        """(batches done, tensors on the CPU, state, samples) of the newest checkpoint; None if none or not resuming."""
        path = self._newest() if self.cfg.resume else None
        if path is None:
            return None
        manifest = read_json(path / MANIFEST)
        differ = [k for k in sorted(set(self.key) | set(manifest) - {"batches_done", "state"})
                  if manifest.get(k) != self.key.get(k)]
        if differ:
            raise FisherSelectError(
                f"checkpoint {path} belongs to another calibration (it differs in {', '.join(differ)}): resume with "
                f"the same model, prompts, objectives and settings, or remove {self.cfg.folder} to start over")
        samples = read_samples(path / SAMPLES)
        self.loaded = path
        return manifest["batches_done"], read_tensors(path / TENSORS), manifest["state"], samples

    def discard(self) -> None:
        """After the result is complete: this rank's checkpoints go (and the folder, once empty)."""
        _discard(self.cfg, self.rank, self.world)


def finish(cfg: CheckpointConfig, rank: int, world: int, sharded: bool = False) -> None:
    """After rank 0 wrote the run directory: every rank removes its checkpoints (``keep_when_done``).

    ``sharded`` (``shard: fsdp``): the one checkpoint, holding every rank's state, is rank 0's to remove."""
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # no rank discards its state before the run is safely written
    if not sharded:
        _discard(cfg, rank, world)
    elif rank == 0:
        _discard(cfg, 0, 1)


def rank_folder(cfg: CheckpointConfig, rank: int, world: int) -> Path:
    return Path(cfg.folder) / CHECKPOINT_RANK_DIR.format(rank=rank, world=world)


def _discard(cfg: CheckpointConfig, rank: int, world: int) -> None:
    shutil.rmtree(rank_folder(cfg, rank, world), ignore_errors=True)
    try:
        Path(cfg.folder).rmdir()
    except OSError:  # other ranks' checkpoints are still there, or it never existed
        pass


# ---------------------------------------------------------------------------
# The calibrator's state as flat tensors + JSON, and back


def _put_sums(out: dict, prefix: str, sums: ScoreSums | None) -> dict | None:
    """Flatten ``sums`` into ``out`` under ``prefix``; returns what JSON keeps (count, which sums exist)."""
    if sums is None:
        return None
    kinds = [k for k in _SUMS if getattr(sums, k) is not None]
    for kind in kinds:
        for name, t in getattr(sums, kind).items():
            out[f"{prefix}/{kind}/{name}"] = t
    info = {"count": sums.count, "kinds": kinds}
    if sums.expert_tokens or sums.expert_positions:  # MoE: tokens per expert (small integer lists: in the JSON)
        info["experts"] = {kind: {n: c.tolist() for n, c in getattr(sums, kind).items()} for kind in _COUNTS}
    return info


def _take(tensors: dict, head: str, names, place) -> dict[str, torch.Tensor]:
    """The tensors under ``head``, in the order of ``names`` (the coverage's): safetensors sorts its keys,
    and ranks all-reduce these dicts in iteration order, which must be the same everywhere."""
    return {n: place(n, tensors[head + n]) for n in names if head + n in tensors}


def _take_sums(tensors: dict, prefix: str, info: dict | None, names, place) -> ScoreSums | None:
    if info is None:
        return None
    parts = {k: None for k in _SUMS}
    for kind in info["kinds"]:
        parts[kind] = _take(tensors, f"{prefix}/{kind}/", names, place)
    counts = {kind: {n: torch.tensor(c, dtype=torch.int64) for n, c in info.get("experts", {}).get(kind, {}).items()}
              for kind in _COUNTS}
    return ScoreSums(parts["squares"], parts["signal"], parts["total"], info["count"], **counts)


@dataclass
class CalibrationState:
    """The state of a calibration between batches: what a checkpoint holds (``_Calibrator.state`` / ``restore``)."""

    generator: torch.Tensor  # the sampling generator's state
    sums: ScoreSums | None  # None before the first batch
    checks: dict
    stats: list  # one ``Statistics`` per objective
    samples: list[dict]
    token: TokenState | None = None  # token-level objectives only
    halves: HalvesState | None = None  # ``stability`` only


def _own_meta(state: CalibrationState) -> dict:
    """What one process's sampling and scoring left beside the sums (JSON-able)."""
    meta = {"checks": state.checks, "stats": [s.to_dict() for s in state.stats]}
    if state.halves is not None:
        st = state.halves
        meta["stability"] = {"samples": st.samples, "prompts": st.prompts, "unit_masses": st.unit_masses,
                             "unit_counts": st.unit_counts, "running": st.running, "has_a": st.squares_a is not None}
    return meta


def write_state(state: CalibrationState) -> tuple[dict[str, torch.Tensor], dict]:
    """``state`` as (tensors, JSON-able state), the checkpoint's two files beside its samples."""
    tensors = {"rng/sampling": state.generator}
    meta = {"sums": _put_sums(tensors, "sums", state.sums), **_own_meta(state)}
    if state.token is not None:
        tensors["rng/signs"] = state.token.signs
        meta["token"] = {"squares": _put_sums(tensors, "token", state.token.squares),
                         "grads": [_put_sums(tensors, f"token_grad{j}", g) for j, g in enumerate(state.token.grads)]}
    if state.halves is not None:
        for name, t in (state.halves.squares_a or {}).items():
            tensors[f"half_a/{name}"] = t
    return tensors, meta


def capture_ranks(state: CalibrationState, sums: ScoreSums | None, half_a: dict[str, torch.Tensor] | None):
    """fsdp (a collective): one checkpoint of every rank's state, (tensors, state, samples) on rank 0, None elsewhere.

    ``state``: this rank's (its rows of the sums); ``sums`` / ``half_a``: the full sums gathered on rank 0. Each
    rank's sampling generator, statistics, split-half counts and samples go in under its rank (``read_state``
    takes them out again)."""
    from fisher_select.distributed import gather_objects

    parts = gather_objects((state.generator, _own_meta(state), state.samples))  # [(state, meta, samples)]
    if sums is None:
        return None
    halves = state.halves
    if halves is not None and half_a is not None:
        halves = replace(halves, squares_a=half_a)
    tensors, meta = write_state(replace(state, sums=sums, halves=halves))
    del tensors["rng/sampling"]  # rank 0's; every rank's goes in below
    for r, (generator, _, _) in enumerate(parts):
        tensors[f"rank{r}/rng/sampling"] = generator
    meta = {"sums": meta["sums"], "ranks": [m for _, m, _ in parts], "samples_per_rank": [len(s) for _, _, s in parts]}
    return tensors, meta, [record for _, _, samples in parts for record in samples]


def _rank_view(tensors: dict[str, torch.Tensor], meta: dict, samples: list[dict], rank: int):
    """fsdp: rank ``rank``'s part of a ``capture_ranks`` checkpoint, as one process's (with the full sums)."""
    counts = meta["samples_per_rank"]
    start = sum(counts[:rank])
    own = {k: v for k, v in tensors.items() if not k.startswith("rank")}  # the full sums and half-A squares
    own["rng/sampling"] = tensors[f"rank{rank}/rng/sampling"]
    return own, {"sums": meta["sums"], **meta["ranks"][rank]}, samples[start : start + counts[rank]]


def read_state(tensors: dict[str, torch.Tensor], meta: dict, samples: list[dict], *, rank: int, names: list[str],
               place, stat_types: list[type]) -> CalibrationState:
    """A checkpoint's state (an fsdp one: rank ``rank``'s part, with the full sums), for a calibrator of the same
    settings (checked by the manifest). ``names``: the coverage's parameters, in its order; ``place(name, t)``
    moves a tensor where the calibrator keeps it; ``stat_types``: each objective's ``Statistics`` class."""
    if "ranks" in meta:
        tensors, meta, samples = _rank_view(tensors, meta, samples, rank)
    state = CalibrationState(tensors["rng/sampling"], _take_sums(tensors, "sums", meta["sums"], names, place),
                             meta["checks"], [t.from_dict(d) for t, d in zip(stat_types, meta["stats"])], samples)
    if "token" in meta:
        state.token = TokenState(tensors["rng/signs"], _take_sums(tensors, "token", meta["token"]["squares"], names,
                                                                   place),
                                 [_take_sums(tensors, f"token_grad{j}", g, names, place)
                                  for j, g in enumerate(meta["token"]["grads"])])
    if "stability" in meta:
        info = meta["stability"]
        state.halves = HalvesState(info["samples"], info["prompts"], info["unit_masses"], info["unit_counts"],
                                   info["running"], _take(tensors, "half_a/", names, place) if info["has_a"] else None)
    return state
