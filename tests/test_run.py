"""Run objects and atomic run directories."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from fisher_select import FisherSelectError
from fisher_select.atomic import write_dir
from fisher_select.run.load import load_run
from fisher_select.run.migrate import migrate
from fisher_select.run.names import FISHER_FILE, REPORT_FILE
from fisher_select.run.schema import FORMAT_VERSION, ModelInfo, ModuleEntry, ObjectiveEntry, RunReport
from tests.runs import make_run, write_run_dir
from tests.tiny import run_command


def _run(**entry):
    return make_run({"w": torch.tensor([0.0, 1.0, 9.0])}, run_id="r1",
                    objectives=[{"name": "a", "signal_scale": 4.0}, {"name": "b", **entry}],
                    token_fisher={"w": torch.tensor([0.0, 4.0, 16.0])})


def test_bound_uses_the_objectives_own_fisher_and_scale():
    run = _run(signal_scale=1.0, token_level=True)
    assert run.bound()["w"].tolist() == [0.0, 2.0, 6.0]  # sqrt(F * 4)
    assert run.bound("b")["w"].tolist() == [0.0, 2.0, 4.0]  # sqrt(F_tok * 1)
    assert run.fisher_for("a") is run.fisher and run.fisher_for("b") is run.token_fisher


def test_infinite_scale_from_json_gives_no_bound_except_where_fisher_is_zero():
    run = _run(signal_scale="inf", token_level=False)
    assert run.signal_scale_of("b") == math.inf
    assert run.bound("b")["w"].tolist() == [0.0, math.inf, math.inf]


def test_unknown_objective_is_named():
    with pytest.raises(FisherSelectError, match="no objective 'c'.*a, b"):
        _run(signal_scale=1.0).bound("c")


def test_atomic_write_replaces_only_when_asked_and_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "run"
    write_dir(out, lambda d: (d / "x").write_text("1"), overwrite=False)
    with pytest.raises(FisherSelectError, match="--overwrite"):
        write_dir(out, lambda d: (d / "x").write_text("2"), overwrite=False)

    def failing(d):
        (d / "x").write_text("3")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_dir(out, failing, overwrite=True)
    assert (out / "x").read_text() == "1"
    write_dir(out, lambda d: (d / "y").write_text("4"), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["y"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary or old directories left


def _report_json(tmp_path):
    run = make_run({"layer.weight": torch.tensor([[1.0, 4.0]]), "layer.bias": torch.tensor([0.0])},
                   objectives=[{"name": "rl", "signal_scale": "inf", "warnings": ["w"], "reward": {"type": "x"}}])
    return run, write_run_dir(run, tmp_path / "run")


def test_report_round_trips_through_json_with_typed_fields(tmp_path):
    run, path = _report_json(tmp_path)
    loaded = load_run(path)
    assert loaded.report == run.report
    entry = loaded.objective("rl")
    assert entry.signal_scale == math.inf and entry.warnings == ["w"] and entry.details["reward"] == {"type": "x"}
    data = json.loads((path / REPORT_FILE).read_text())
    assert data["format_version"] == FORMAT_VERSION and data["objectives"][0]["signal_scale"] == "inf"
    assert [m["name"] for m in data["modules"]] == ["layer"] and data["modules"][0]["fisher_mass"] == 5.0


def test_old_format_is_refused_with_the_version_and_migrate_fixes_it(tmp_path, capsys):
    _, path = _report_json(tmp_path)
    data = json.loads((path / REPORT_FILE).read_text())
    del data["format_version"]
    data["fisher_select_version"] = "0.1.0"
    (path / REPORT_FILE).write_text(json.dumps(data))
    with pytest.raises(FisherSelectError, match=r"made by fisher_select 0\.1\.0 \(run format 1\).*fisher-select migrate"):
        load_run(path)
    assert run_command(["migrate", str(path)]) == 0
    assert load_run(path).report.format_version == FORMAT_VERSION
    assert sorted(p.name for p in path.iterdir()) == [FISHER_FILE, REPORT_FILE]  # no temporary left


def test_a_format_3_report_migrates_its_sqrt_fisher_mean(tmp_path):
    run, path = _report_json(tmp_path)
    data = json.loads((path / REPORT_FILE).read_text())
    data["format_version"] = 3
    for module in data["modules"]:
        module["sqrt_fisher_mean"] = module.pop("bound_mass_per_coordinate")
    (path / REPORT_FILE).write_text(json.dumps(data))
    with pytest.raises(FisherSelectError, match=r"run format 3\).*fisher-select migrate"):
        load_run(path)
    migrate(path)
    loaded = load_run(path).report
    assert loaded.format_version == FORMAT_VERSION and loaded.modules == run.report.modules
    # layer: sqrt(1) + sqrt(4) + sqrt(0) over 3 coordinates
    assert loaded.modules[0].bound_mass_per_coordinate == pytest.approx(1.0)


def test_a_newer_format_is_not_migrated(tmp_path):
    _, path = _report_json(tmp_path)
    data = json.loads((path / REPORT_FILE).read_text())
    data["format_version"] = FORMAT_VERSION + 1
    (path / REPORT_FILE).write_text(json.dumps(data))
    with pytest.raises(FisherSelectError, match="cannot migrate"):
        migrate(path)


def test_run_format_doc_names_every_field():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "RUN_FORMAT.md").read_text()
    for cls in (RunReport, ModelInfo, ObjectiveEntry, ModuleEntry):
        missing = [f.name for f in dataclasses.fields(cls) if f"`{f.name}`" not in doc]
        assert not missing, f"docs/RUN_FORMAT.md does not document {cls.__name__} fields {missing}"


def test_run_warnings_name_each_degenerate_result_with_its_number():
    from fisher_select.report.warnings import run_warnings

    run = make_run({"w": torch.tensor([1.0])}, objectives=[
        {"name": "rl", "signal_scale": 0.0, "prompts_without_signal": 8},
        {"name": "rl2", "signal_scale": 0.1, "signal_scale_stderr": 0.08, "prompts_without_signal": 5}])
    report = run.report
    report.num_prompts, report.num_samples, report.num_truncated = 8, 64, 40
    report.checks = {"score_mean": {"rms_z": 12.0}}
    text = "\n".join(run_warnings(report))
    assert "62% of responses were cut" in text and "RMS z = 12" in text
    assert "(rl) signal scale S = 0" in text and "(rl2) 5 of 8 prompts carried no signal" in text
    assert "standard error of 0.08 (80%)" in text
    report.num_truncated, report.checks = 0, {"score_mean": {"rms_z": 1.1}}
    report.objectives = report.objectives[1:]
    report.objectives[0].details = {"signal_scale_stderr": 0.01}
    assert run_warnings(report) == []
