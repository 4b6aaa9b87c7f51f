"""The newcomer's path (issue 21): phase lines without progress bars, memory estimated before any work,
large K sampled in chunks, damaged run files refused as bad input."""

from __future__ import annotations

import json

import pytest

from tests.tiny import run_command


def _recipe(tmp_path, model_dir, prompts=2):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(prompts)))
    (tmp_path / "r.yaml").write_text(f"model: {model_dir}\nprompts: p.jsonl\nobjective:\n  type: rl\n"
                                     "  reward: {type: regex, pattern: '[0-9]'}\n")
    return str(tmp_path / "r.yaml")


def test_no_progress_prints_one_line_per_phase_on_stderr(tmp_path, small_llama_dir, capsys):
    assert run_command(["calibrate", "--recipe", _recipe(tmp_path, small_llama_dir), "--out", str(tmp_path / "run"),
                        "--samples-per-prompt", "2", "--max-new-tokens", "4", "--no-progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    starts = ["model loaded: ", "sampling done: ", "scoring done: ", "checks: ", "written: "]
    lines = [line for line in err if line.startswith(tuple(starts))]
    assert [next(s for s in starts if line.startswith(s)) for line in lines] == starts, err
    assert "tokens/s" in lines[1] and "samples/s" in lines[2] and "autograd ok" in lines[3]
    assert lines[4] == f"written: {tmp_path / 'run'}"
