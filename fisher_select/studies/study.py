"""The outcome study's protocol v2 driver: the pilot chooses each arm's lr, then every replicate trains at it.

``run_study(protocol, folder, load_replicate, ...)`` loads one replicate at a time
(``load_replicate(r) -> Replicate``: its own calibration run, model and draw), runs its cells
through the cell cache under ``folder`` (a finished cell is skipped) and stops before a cell, or a
replicate's load and a cell, would overrun ``budget_minutes``. ``assemble.assemble(folder)`` builds
the tables from the cells alone.

A replicate whose cells are all finished leaves a marker (``finished/r<r>.json``: the settings, the
caller's ``identity``, its cell files and, for the pilot, the chosen lrs). A later session that finds
a matching marker, and every file it names, skips the replicate without loading it: loading means
remaking its calibration (minutes), which is kept out of git.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from fisher_select.atomic import write_file

from fisher_select.errors import FisherSelectError
from fisher_select.studies.arms import arm_name
from fisher_select.studies.cell_run import START, Replicate, ReplicateCells
from fisher_select.studies.cells import STUDY_CODE_VERSION, CellCache, CellKey, Clock, canonical
from fisher_select.studies.grid import GridChoice, choose_lr
from fisher_select.studies.protocol import ProtocolV2, draw_identity

PILOT = 0  # the replicate whose validation chooses every arm's lr


def replicate_context(protocol: ProtocolV2, rep: Replicate) -> dict:
    """What defines a replicate's cells besides their key: model, calibration, draw, protocol."""
    fingerprint = hashlib.sha256(canonical(rep.run.fingerprint).encode()).hexdigest()
    return {"model": fingerprint, "calibration": calibration_identity(rep.run), "draw": draw_identity(rep.splits),
            "protocol": protocol.cell_settings()}


def calibration_identity(run) -> dict | str:
    """What made a replicate's calibration: its resolved recipe and seed (the prompts are the draw's, in the
    context already), not its run id, so that a calibration redone the same way (its run directory is kept
    out of git: it holds F) keeps the finished cells. A run made without a recipe (the Python API) is
    identified by its run id."""
    config = run.report.config
    if not config:
        return run.run_id
    settings = {k: v for k, v in config.items() if k not in ("prompts", "device", "output", "progress")}
    return {"recipe": settings, "seed": run.report.seed, "num_prompts": run.report.num_prompts}


class Study:
    """One kind's study: its protocol, cell cache and clock."""

    def __init__(self, protocol: ProtocolV2, folder, clock: Clock | None = None, progress: bool = False):
        problems = protocol.problems()
        if problems:
            raise FisherSelectError("invalid protocol v2 settings: " + "; ".join(problems))
        self.protocol, self.clock, self.progress = protocol, clock, progress
        self.cache = CellCache(folder, {})
        self.choices: dict[tuple, GridChoice] = {}
        self.higher_is_better = None
        self.used: list[str] = []  # the current replicate's cell files, for its marker

    def _cells_of(self, rep: Replicate) -> ReplicateCells:
        self.cache.contexts[rep.index] = replicate_context(self.protocol, rep)
        cells = ReplicateCells(self.protocol, rep, self.progress)
        self.higher_is_better = cells.task.higher_is_better
        return cells

    def _cell(self, cells: ReplicateCells, arm: str, budget, lr: float, stage: str) -> dict | None:
        key = CellKey(self.protocol.kind, cells.rep.index, arm, budget, lr, stage)
        result = self.cache.run(key, lambda: cells.compute(arm, budget, lr, stage), self.clock)
        if result is not None:
            self.used.append(self.cache.path(key).name)
        return result

    def _marker(self, r: int) -> Path:
        return self.cache.folder / "finished" / f"r{r}.json"  # beside the cells, not among them

    def _settings(self, identity: dict) -> dict:
        """What a marker must match: every setting but the extent that only adds cells, the code, the caller's
        identity (recipe, prompts, model)."""
        kept = {k: v for k, v in self.protocol.as_dict().items() if k not in ("arms", "budgets", "replicates",
                                                                                  "bootstrap")}
        return json.loads(canonical({"protocol": kept, "code": STUDY_CODE_VERSION, "identity": identity}))

    def mark(self, r: int, identity: dict) -> None:
        """Replicate r's cells are all finished: write its marker (atomically)."""
        marker = {"settings": self._settings(identity), "cells": sorted(set(self.used)),
                  "arms": [arm_name(a, b) for a, b in self.protocol.cells()],
                  "choices": {arm_name(a, b): c.as_dict() for (a, b), c in self.choices.items()} if r == PILOT else None}
        write_file(self._marker(r), lambda tmp: tmp.write_text(json.dumps(marker, indent=1) + "\n"), overwrite=True)

    def restore(self, r: int, identity: dict) -> bool:
        """True when replicate r's marker matches these settings and arms and names only files still present
        (the pilot's lr choices are restored from it); then the replicate need not be loaded."""
        path = self._marker(r)
        if not path.is_file():
            return False
        marker = json.loads(path.read_text())
        arms = [arm_name(a, b) for a, b in self.protocol.cells()]
        if (marker.get("settings") != self._settings(identity) or not set(arms) <= set(marker.get("arms", []))
                or not all((self.cache.folder / name).is_file() for name in marker.get("cells", []))):
            return False
        if r == PILOT:
            self.choices = {(a, b): GridChoice.from_dict(marker["choices"][arm_name(a, b)])
                            for a, b in self.protocol.cells()}
        self.cache.skipped += len(marker["cells"])
        return True

    def pilot(self, cells: ReplicateCells) -> bool:
        """Choose every arm's lr on the pilot replicate's validation prompts; False if time ran out."""
        for arm, budget in self.protocol.cells():
            def evaluate(lr, arm=arm, budget=budget):
                cell = self._cell(cells, arm, budget, lr, "pilot")
                return None if cell is None else cell["validation"]

            choice = choose_lr(evaluate, self.protocol.start_grid(arm, budget), self.higher_is_better,
                               self.protocol.grid_cap)
            if choice is None:
                return False
            self.choices[(arm, budget)] = choice
        return True

    def held_out(self, cells: ReplicateCells) -> bool:
        """The replicate's held-out cells at the chosen lrs (and the untrained model); False if time ran out."""
        if self._cell(cells, START, None, 0.0, "held_out") is None:
            return False
        for (arm, budget), choice in self.choices.items():
            if self._cell(cells, arm, budget, choice.chosen, "held_out") is None:
                return False
        return True


def run_study(protocol: ProtocolV2, folder, load_replicate, *, budget_minutes: float | None = None,
              pilot_only: bool = False, progress: bool = False, identity: dict | None = None) -> dict:
    """Run (or resume) the study's cells; what was done and whether it finished. ``identity``: what else
    defines the replicates (recipe, prompts, model), JSON-able; given, finished replicates leave markers and
    a later run skips them unloaded (``Study.restore``); None, every replicate is loaded."""
    study = Study(protocol, folder, Clock(budget_minutes), progress)
    done = True
    replicates = [PILOT] if pilot_only else range(protocol.replicates)
    for r in replicates:  # the pilot (0) comes first: it chooses the lrs the others reuse
        if identity is not None and not pilot_only and study.restore(r, identity):
            continue
        if not study.clock.fits(loading=True):  # a load may calibrate (minutes): it must not overrun either
            done = False
            break
        study.used = []
        started = time.monotonic()
        cells = study._cells_of(load_replicate(r))
        study.clock.record_load(time.monotonic() - started)
        done = (study.pilot(cells) if r == PILOT else True) and (pilot_only or study.held_out(cells))
        del cells  # one replicate's model in memory at a time
        if not done:
            break
        if identity is not None and not pilot_only:
            study.mark(r, identity)
    return {"finished": done, "computed": study.cache.computed, "skipped": study.cache.skipped,
            "stopped_by_budget": study.clock.stopped,
            "lr_choices": {arm_name(a, b): c.as_dict() for (a, b), c in study.choices.items()}}

