"""The cell cache of the outcome study: one file per (kind, replicate, arm, budget, lr, stage), written atomically.

A cell is one training run and its evaluation. Its file name carries a hash of everything that
defines it: the cell's key and the study's context (model fingerprint, the replicate's data draw,
the protocol's settings, ``STUDY_CODE_VERSION``). A rerun finds a finished cell by that hash and
skips it; changing any part of the context changes the hash, so an old cell is never reused for a
new protocol (it stays on disk, unread, until removed). ``--assemble`` reads the cells alone.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fisher_select.atomic import write_file
from fisher_select.errors import FisherSelectError

STUDY_CODE_VERSION = "2.1"  # bump when the study code changes what a cell measures: every cell is redone
STAGES = ("pilot", "held_out")  # pilot: validation only, to choose the lr; held_out: the reported outcome


@dataclass(frozen=True)
class CellKey:
    """What one cell trains: ``budget`` None for full fine-tuning and LoRA (their own count)."""

    kind: str
    replicate: int
    arm: str
    budget: float | None
    lr: float
    stage: str

    def label(self) -> str:
        budget = "own" if self.budget is None else f"{self.budget:g}"
        return f"{self.kind}-r{self.replicate}-{self.arm}-{budget}-lr{self.lr:.4g}-{self.stage}"


def canonical(obj) -> str:
    """The JSON text a hash is taken of: sorted keys, no spaces, floats as Python writes them."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def cell_hash(key: CellKey, context: dict) -> str:
    """sha256 of the key, the context and the study code's version (hex)."""
    text = canonical({"key": asdict(key), "context": context, "code": STUDY_CODE_VERSION})
    return hashlib.sha256(text.encode()).hexdigest()


class CellCache:
    """Finished cells under ``folder``; ``contexts``: replicate -> what defines that replicate's cells."""

    def __init__(self, folder, contexts: dict[int, dict]):
        self.folder = Path(folder)
        self.contexts = contexts
        self.skipped = 0  # cells found finished in this session
        self.computed = 0

    def path(self, key: CellKey) -> Path:
        return self.folder / f"{key.label()}-{cell_hash(key, self.contexts[key.replicate])[:16]}.json"

    def get(self, key: CellKey) -> dict | None:
        """The finished cell's result, or None (absent, or written for another context)."""
        path = self.path(key)
        if not path.is_file():
            return None
        cell = json.loads(path.read_text())
        want = cell_hash(key, self.contexts[key.replicate])
        return cell["result"] if _sound(cell) and cell["hash"] == want else None

    def put(self, key: CellKey, result: dict) -> Path:
        cell = {"key": asdict(key), "hash": cell_hash(key, self.contexts[key.replicate]),
                "code": STUDY_CODE_VERSION, "context": self.contexts[key.replicate], "result": result}
        return write_file(self.path(key), lambda tmp: tmp.write_text(json.dumps(cell, indent=1) + "\n"),
                          overwrite=True)

    def run(self, key: CellKey, compute, clock: "Clock | None" = None) -> dict | None:
        """The cell's result: cached, or ``compute()`` written atomically; None when ``clock`` says it
        would overrun the time budget (nothing is written, the next session does it)."""
        found = self.get(key)
        if found is not None:
            self.skipped += 1
            return found
        if clock is not None and not clock.fits():
            return None
        started = time.monotonic()
        result = compute()
        result["cell_seconds"] = time.monotonic() - started  # training and evaluation: what the cell cost
        if clock is not None:
            clock.record(result["cell_seconds"])
        self.put(key, result)
        self.computed += 1
        return result


def read_cells(folder) -> list[dict]:
    """Every cell file under ``folder`` whose hash matches its own key and context (what --assemble reads)."""
    out = []
    for path in sorted(Path(folder).glob("*.json")):
        cell = json.loads(path.read_text())
        if "key" not in cell or "hash" not in cell:
            raise FisherSelectError(f"{path} is not a study cell (no key or hash); remove it from {folder}")
        if _sound(cell):
            out.append(cell)
    return out


def _sound(cell: dict) -> bool:
    """The cell's recorded hash is that of its own key, context and code version (not edited, not stale)."""
    try:
        key = CellKey(**cell["key"])
        return cell.get("code") == STUDY_CODE_VERSION and cell["hash"] == cell_hash(key, cell["context"])
    except (KeyError, TypeError):
        return False


def cell_costs(folder) -> dict[str, dict]:
    """Per stage, what the finished cells under ``folder`` cost (``--costs``): the count, the median and
    total training seconds, and the same for the whole cell where it was recorded (``cell_seconds``,
    since study code 2.1's cells of 2026-12-05; older cells hold only their training time)."""
    return costs_of(read_cells(folder))


def costs_of(cells: list[dict]) -> dict[str, dict]:
    """``cell_costs`` of cells already read (``read_cells``)."""
    out = {}
    for stage in STAGES:
        results = [c["result"] for c in cells if c["key"]["stage"] == stage]
        if not results:
            continue
        entry = {"cells": len(results)}
        for field in ("training_seconds", "cell_seconds"):
            known = sorted(c[field] for c in results if c.get(field) is not None)
            if known:
                entry[field] = {"n": len(known), "median": statistics.median(known), "total": sum(known)}
        out[stage] = entry
    return out


class Clock:
    """``--budget-minutes``: a cell starts only if the slowest cell so far (or ``guess_s``) still fits, and a
    replicate is loaded (its calibration: minutes) only if the slowest load so far and a cell fit."""

    def __init__(self, minutes: float | None, guess_s: float = 60.0):
        self.deadline = None if minutes is None else time.monotonic() + 60.0 * minutes
        self.guess_s = guess_s
        self.seen: list[float] = []  # seconds of the cells computed in this session
        self.loads: list[float] = []  # seconds of the replicates loaded in this session
        self.stopped = False

    @property
    def longest(self) -> float:
        return max(self.seen) if self.seen else self.guess_s

    def fits(self, loading: bool = False) -> bool:
        """Whether a cell (``loading``: a replicate's load, then a cell) ends before the deadline."""
        if self.deadline is None:
            return True
        need = self.longest + (max(self.loads, default=0.0) if loading else 0.0)
        ok = time.monotonic() + need <= self.deadline
        self.stopped = self.stopped or not ok
        return ok

    def record(self, seconds: float) -> None:
        self.seen.append(seconds)

    def record_load(self, seconds: float) -> None:
        self.loads.append(seconds)
