"""What an outcome study still needs (fisher_select.studies.plan.cells_left, ``--plan --cells``): counted on
cells written by hand, and checked against what a tiny study then really computes."""

from __future__ import annotations

import math

import pytest

from fisher_select.studies.cell_run import START
from fisher_select.studies.cells import CellCache, CellKey
from fisher_select.studies.plan import cells_left
from fisher_select.studies.protocol import ProtocolV2
from fisher_select.studies.study import run_study
from tests.test_outcomes_v2 import _loader, _records

PROTOCOL = ProtocolV2("rl", replicates=2, budgets=(1e-3,), arms=("bound", "full"))


def _put(cache, replicate, arm, budget, lr, stage, validation=0.0, seconds=10.0):
    cache.contexts.setdefault(replicate, {"replicate": replicate})
    result = {"validation": validation, "higher_is_better": True, "cell_seconds": seconds}
    cache.put(CellKey("rl", replicate, arm, budget, lr, stage), result)


def _peak_at(grid, i):
    """Validation scores (higher is better) whose best is grid point i."""
    return [-abs(math.log10(lr / grid[i])) for lr in grid]


def test_an_empty_folder_needs_the_whole_minimum(tmp_path):
    left = cells_left(PROTOCOL, tmp_path / "none")
    minimum = PROTOCOL.minimum_cells()
    assert (left["pilot"], left["held_out"], left["calibrations"]) == (
        minimum["pilot"], minimum["held_out"], minimum["calibrations"])
    assert left["cell_hours"] is None and left["pilot_arms_open"] == ["bound@0.001", "full"]


def test_cells_left_counts_missing_grid_points_extensions_and_held_out_cells(tmp_path):
    cache = CellCache(tmp_path, {})
    bound_grid, full_grid = PROTOCOL.start_grid("bound", 1e-3), PROTOCOL.start_grid("full", None)
    for lr, v in zip(bound_grid, _peak_at(bound_grid, 2)):  # chosen inside its grid: done
        _put(cache, 0, "bound", 1e-3, lr, "pilot", v, seconds=20.0)
    for lr, v in zip(full_grid[:3], _peak_at(full_grid, 1)[:3]):  # one starting point missing
        _put(cache, 0, "full", None, lr, "pilot", v, seconds=20.0)
    _put(cache, 0, START, None, 0.0, "held_out", seconds=100.0)
    _put(cache, 0, "bound", 1e-3, bound_grid[2], "held_out", seconds=100.0)
    _put(cache, 1, "bound", 1e-3, bound_grid[0], "held_out", seconds=100.0)  # not at the chosen lr: not counted
    left = cells_left(PROTOCOL, tmp_path)
    assert left["pilot"] == 1 and left["pilot_arms_open"] == ["full"]
    assert left["held_out"] == 2 * 3 - 2 and left["calibrations"] == 2
    assert left["cell_hours"] == pytest.approx((1 * 20.0 + 4 * 100.0) / 3600)

    _put(cache, 0, "full", None, full_grid[3], "pilot", 5.0)  # the best point now sits on the upper edge
    left = cells_left(PROTOCOL, tmp_path)
    assert left["pilot"] == 1 and left["pilot_arms_open"] == ["full"]  # the grid must be extended by one point
    _put(cache, 0, "full", None, full_grid[3] * math.sqrt(10.0), "pilot", 1.0)
    assert cells_left(PROTOCOL, tmp_path)["pilot"] == 0


def test_cells_left_predicts_what_a_tiny_study_then_computes(tmp_path):
    records = _records(12)
    protocol = ProtocolV2("sft", replicates=2, train_prompts=4, validation_prompts=2, heldout_prompts=3,
                          budgets=(0.05,), arms=("bound", "full"), grid_cap=5, steps=1, prompts_per_step=2,
                          samples_per_prompt=1, max_new_tokens=3, bootstrap=200)
    load, folder = _loader(tmp_path, protocol, records), tmp_path / "cells"
    run_study(protocol, folder, load, pilot_only=True)
    left = cells_left(protocol, folder)
    assert left["pilot"] == 0 and not left["pilot_arms_open"] and left["calibrations"] == 2
    assert left["held_out"] == protocol.minimum_cells()["held_out"] and left["cell_hours"] > 0
    done = run_study(protocol, folder, load, identity={"test": 1})
    assert done["finished"] and done["computed"] == left["held_out"]
    after = cells_left(protocol, folder)
    assert (after["pilot"], after["held_out"], after["calibrations"]) == (0, 0, 0) and after["cell_hours"] == 0
