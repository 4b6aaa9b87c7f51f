"""What an outcome study still needs, read from its finished cells alone (``bench/outcomes.py --plan --cells``).

The study runs over several sessions; the one that resumes it needs to know how much is left before it
starts. ``cells_left(protocol, folder)`` replays the pilot's lr choices over the pilot cells on disk
(the same ``choose_lr`` the study runs, asked only for cells that exist), then counts the held-out cells
every replicate still lacks, and the calibrations still to make (one per replicate without its
``finished/`` marker: a calibration is kept out of git, so a resumed replicate is calibrated again).
The hours are an estimate: the cells left times the median wall time of the finished cells of their
stage (the pilot's, before any held-out cell exists), calibrations not included.

Cells are matched on their keys (kind, replicate, arm, budget, lr, stage), not on their hash: loading a
replicate's context would mean remaking its calibration. ``--assemble`` refuses mixed protocols anyway.
"""

from __future__ import annotations

from pathlib import Path

from fisher_select.studies.arms import arm_name
from fisher_select.studies.cell_run import START
from fisher_select.studies.cells import costs_of, read_cells
from fisher_select.studies.grid import choose_lr
from fisher_select.studies.protocol import ProtocolV2
from fisher_select.studies.study import PILOT


def _lr_key(lr: float) -> str:
    return f"{lr:.6g}"  # grid points are recomputed as start * sqrt(10)**i: equal to 6 digits


def _pilot_left(protocol: ProtocolV2, validation: dict, higher_is_better: bool) -> tuple[int, list[str], dict]:
    """Pilot cells still missing from the starting (or extended) grids, the arms whose choice is still open
    (they may add grid points beyond those), and the chosen lr of every arm whose choice is made."""
    missing, open_arms, chosen = 0, [], {}
    for arm, budget in protocol.cells():
        asked: list[float] = []

        def evaluate(lr, arm=arm, budget=budget):
            found = validation.get((arm, budget, _lr_key(lr)))
            if found is None:
                asked.append(lr)
            return found

        choice = choose_lr(evaluate, protocol.start_grid(arm, budget), higher_is_better, protocol.grid_cap)
        if choice is None:
            missing += len(asked)
            open_arms.append(arm_name(arm, budget))
        else:
            chosen[(arm, budget)] = choice.chosen
    return missing, open_arms, chosen


def cells_left(protocol: ProtocolV2, folder) -> dict:
    """The cells and calibrations the study still needs, and the hours its cells are likely to take."""
    folder = Path(folder)
    cells = [c for c in read_cells(folder) if c["key"]["kind"] == protocol.kind] if folder.is_dir() else []
    higher_is_better = bool(cells[0]["result"]["higher_is_better"]) if cells else True  # the cells record it
    validation, held = {}, set()
    for c in cells:
        k = c["key"]
        if k["stage"] == "pilot" and k["replicate"] == PILOT:
            validation[(k["arm"], k["budget"], _lr_key(k["lr"]))] = c["result"]["validation"]
        elif k["stage"] == "held_out":
            held.add((k["replicate"], k["arm"], k["budget"], _lr_key(k["lr"])))
    pilot, open_arms, chosen = _pilot_left(protocol, validation, higher_is_better)
    wanted = {(START, None): _lr_key(0.0), **{arm: _lr_key(lr) for arm, lr in chosen.items()}}  # at the chosen lr
    held_left, calibrations = 0, 0
    for r in range(protocol.replicates):
        done = sum((r, a, b, lr) in held for (a, b), lr in wanted.items())
        left = len(protocol.cells()) + 1 - done
        held_left += left
        # a replicate is skipped unloaded only with its marker: without one it is calibrated again
        marked = (folder / "finished" / f"r{r}.json").is_file()
        calibrations += int(left > 0 or (r == PILOT and pilot > 0) or not marked)
    costs = costs_of(cells)  # the cells read above, not the folder again
    median = {s: costs[s]["cell_seconds"]["median"] for s in costs if "cell_seconds" in costs[s]}
    held_s = median.get("held_out", median.get("pilot"))
    hours = None if not median else (pilot * median.get("pilot", held_s) + held_left * held_s) / 3600
    return {"pilot": pilot, "held_out": held_left, "calibrations": calibrations, "pilot_arms_open": open_arms,
            "cell_hours": hours,
            "meaning": "cells still to run (pilot: at least this many; an open arm may extend its grid), "
                       "calibrations still to make (one per replicate without its finished marker), and the "
                       "cells' hours at the finished cells' median wall time per stage, calibrations not included"}
