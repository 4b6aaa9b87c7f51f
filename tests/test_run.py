"""Run objects and atomic run directories."""

from __future__ import annotations

import math

import pytest
import torch

from fisher_select import FisherSelectError
from fisher_select.rundir import Run, write_atomically


def _run(**entry):
    report = {"run_id": "r1", "objectives": [{"name": "a", "signal_scale": 4.0}, {"name": "b", **entry}]}
    return Run(report=report, fisher={"w": torch.tensor([0.0, 1.0, 9.0])},
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
    write_atomically(out, lambda d: (d / "x").write_text("1"), overwrite=False)
    with pytest.raises(FisherSelectError, match="--overwrite"):
        write_atomically(out, lambda d: (d / "x").write_text("2"), overwrite=False)

    def failing(d):
        (d / "x").write_text("3")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(out, failing, overwrite=True)
    assert (out / "x").read_text() == "1"
    write_atomically(out, lambda d: (d / "y").write_text("4"), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["y"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary or old directories left
