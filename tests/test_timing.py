"""report.json's ``timings``: wall seconds per phase of a calibration, adding up to the run's wall time."""

from __future__ import annotations

import json
import time

import pytest

from fisher_select.recipe import load_recipe
from fisher_select.pipeline import run_recipe
from fisher_select.report.text import run_summary_lines
from fisher_select.run.load import load_run
from fisher_select.timing import PhaseClock

PHASES = ["setup", "model_load", "sampling", "scoring", "checks", "report", "writing"]


def test_laps_add_up_to_the_wall_time_and_a_split_keeps_its_lap(monkeypatch):
    ticks = iter([10.0, 11.0, 14.0, 14.5])
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    clock = PhaseClock()  # 10.0
    clock.lap("load")  # 1.0
    clock.lap("calibration")  # 3.0
    clock.lap("writing")  # 0.5
    clock.split("calibration", {"sampling": 1.0, "scoring": 1.5}, "checks")
    data = clock.to_json({"x": 1})
    assert data["wall_s"] == 4.5 and data["x"] == 1
    assert data["phases_s"] == {"load": 1.0, "sampling": 1.0, "scoring": 1.5, "checks": 0.5, "writing": 0.5}
    assert sum(data["shares"].values()) == pytest.approx(1.0, abs=1e-3)  # shares are rounded to 4 digits


def test_parts_measured_beyond_their_lap_are_scaled_into_it():
    clock = PhaseClock()
    clock.phases = {"calibration": 3.0}
    clock.split("calibration", {"sampling": 2.0, "scoring": 4.0}, "checks")
    assert clock.phases == pytest.approx({"sampling": 1.0, "scoring": 2.0, "checks": 0.0})


def test_a_run_records_every_phase_and_they_sum_to_its_wall_time(tmp_path, small_llama_dir):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in ("a", "b", "c")))
    (tmp_path / "r.yaml").write_text(f"model: {small_llama_dir}\nprompts: p.jsonl\nsamples_per_prompt: 3\n"
                                     "max_new_tokens: 4\nobjective:\n  type: rl\n  reward: {type: regex, pattern: a}\n")
    recipe = load_recipe(tmp_path / "r.yaml")
    started = time.perf_counter()
    result = run_recipe(recipe, tmp_path / "run", progress=False)
    elapsed = time.perf_counter() - started
    t = load_run(tmp_path / "run").report.timings
    assert list(t["phases_s"]) == sorted(t["phases_s"], key=PHASES.index) and set(t["phases_s"]) == set(PHASES)
    assert sum(t["phases_s"].values()) == pytest.approx(t["wall_s"], rel=1e-3, abs=1e-3)
    # Wall time against the caller's clock: only report.json's write and the rename are outside it.
    assert t["wall_s"] <= elapsed and t["wall_s"] >= 0.95 * elapsed - 0.05, (t["wall_s"], elapsed)
    assert t["response_tokens_per_s"] > 0 and t["samples_per_s"] > 0
    assert result.report.timings == t
    (line,) = [x for x in run_summary_lines(result.report) if x.startswith("time: ")]
    assert "sampling" in line and "samples/s" in line
