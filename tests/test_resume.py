"""Resume after a kill: checkpoints every N batches, `calibrate --resume` ends bit-identical to an uninterrupted run.

The interruption is a real SIGKILL, sent at a known point: the recipe's reward is a user callable
(tests/ write it beside the prompts) that kills its own process on its n-th call when
KILL_AT_CALL is set. Everything else is the shipped CLI in a fresh process, as a cluster job runs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.checkpoint import Checkpointer, CheckpointConfig
from fisher_select.run.names import checkpoint_folder
from fisher_select.calibration.objectives import OPDFullObjective, RLObjective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.calibration.teachers import Teacher
from fisher_select.errors import FisherSelectError
from fisher_select.run.verify import compare_runs
from tests.tiny import TinyTokenizer, enumeration_model, free_port, save_small_llama

KILLER = '''
import os, signal
CALLS = [0]

def reward(record, text):
    CALLS[0] += 1
    if CALLS[0] == int(os.environ.get("KILL_AT_CALL", "0")):
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception: what the OOM killer does
    return float(len(text) % 3 == 0)
'''
PROMPTS, K, BATCH = 10, 2, 4  # 5 batches of 2 prompts x 2 responses


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, smol_tokenizer):
    root = tmp_path_factory.mktemp("resume")
    save_small_llama(root / "model", smol_tokenizer, hidden=32, intermediate=64, layers=1)
    (root / "killer_reward.py").write_text(KILLER)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(PROMPTS)))
    (root / "recipe.yaml").write_text(
        "prompts: prompts.jsonl\nmodel: model\nmax_new_tokens: 6\n"
        f"samples_per_prompt: {K}\nbatch_size: {BATCH}\ncheckpoint_every: 1\nseed: 5\n"
        "objective:\n  type: rl\n  reward: {type: callable, function: 'killer_reward:reward'}\n")
    return root


def _calibrate(workdir, out, *extra, kill_at=None, launcher=()):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.getcwd()}
    env.pop("KILL_AT_CALL", None)
    if kill_at is not None:
        env["KILL_AT_CALL"] = str(kill_at)
    cmd = [*(launcher or (sys.executable,)), "-m", "fisher_select", "calibrate", "--recipe", "recipe.yaml",
           "--no-progress", "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env, timeout=600)


def _assert_same_run(a, b):
    """Every tensor file equal bit for bit (torch.equal), the samples byte for byte, the report too
    except what names the run (id, time, the command line)."""
    for name in ("fisher.safetensors", "grad_estimate.safetensors"):
        ta, tb = load_file(str(a / name)), load_file(str(b / name))
        assert ta.keys() == tb.keys()
        assert all(torch.equal(ta[k], tb[k]) for k in ta), name
    diff = compare_runs(a, b)  # leaves out what names the run (id, time, command line)
    assert diff.results == [] and diff.environment == []


@pytest.mark.slow
def test_sigkill_then_resume_equals_the_uninterrupted_run(workdir):
    whole = _calibrate(workdir, workdir / "whole")
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert not checkpoint_folder(workdir / "whole").exists()  # removed once the run is written
    # killed during batch 4's rewards: the checkpoint of batch 3 is the newest complete one
    killed = _calibrate(workdir, workdir / "resumed", kill_at=3 * BATCH + 1)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (workdir / "resumed").exists()
    ckpt = checkpoint_folder(workdir / "resumed") / "rank-000-of-001"
    assert sorted(p.name for p in ckpt.iterdir()) == ["batch-000003"]  # older ones removed, no temporaries
    refused = _calibrate(workdir, workdir / "resumed")
    assert refused.returncode == 2 and "--resume" in refused.stderr  # a checkpoint is never silently dropped
    resumed = _calibrate(workdir, workdir / "resumed", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not checkpoint_folder(workdir / "resumed").exists()
    _assert_same_run(workdir / "whole", workdir / "resumed")



@pytest.mark.slow
def test_two_ranks_each_resume_their_own_checkpoint(workdir):
    """torchrun, 2 gloo ranks: each rank checkpoints its own shard; killed and resumed, bit-identical."""
    def launcher():
        return (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()))

    whole = _calibrate(workdir, workdir / "whole2", launcher=launcher())
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = _calibrate(workdir, workdir / "resumed2", kill_at=2 * BATCH + 1, launcher=launcher())
    assert killed.returncode != 0 and not (workdir / "resumed2").exists()
    folder = checkpoint_folder(workdir / "resumed2")
    # Both ranks usually have one; under load the slower rank may be stopped before its first
    # checkpoint completes, and then restarts its shard (test_a_rank_without_its_own_checkpoint_restarts).
    assert {p.name for p in folder.iterdir()} <= {"rank-000-of-002", "rank-001-of-002"}
    assert any(p.glob("batch-*/manifest.json") for p in folder.iterdir())
    resumed = _calibrate(workdir, workdir / "resumed2", "--resume", launcher=launcher())
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not folder.exists()
    _assert_same_run(workdir / "whole2", workdir / "resumed2")


@pytest.mark.slow
def test_fsdp_ranks_resume_a_sigkilled_run_like_data_parallel_ranks(workdir):
    """torchrun --shard fsdp, 2 gloo ranks, 5 prompts each: both ranks reach the reward's 9th call in their
    third batch and are killed there; rank 0 had written the checkpoint of batch 2 (every rank's state).
    Resumed, the run equals the uninterrupted data-parallel one (samples, F, g, S)."""
    def launcher():
        return (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()))

    whole = workdir / "whole2"
    if not whole.exists():  # test_two_ranks_each_resume_their_own_checkpoint writes it first
        assert _calibrate(workdir, whole, launcher=launcher()).returncode == 0
    out = workdir / "fsdp-resumed"
    killed = _calibrate(workdir, out, "--shard", "fsdp", kill_at=2 * BATCH + 1, launcher=launcher())
    assert killed.returncode != 0 and not out.exists()
    folder = checkpoint_folder(out)
    assert [p.relative_to(folder).as_posix() for p in folder.glob("*/*")] == ["rank-000-of-001/batch-000002"]
    resumed = _calibrate(workdir, out, "--shard", "fsdp", "--resume", launcher=launcher())
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not folder.exists()
    assert (whole / "samples.jsonl").read_text() == (out / "samples.jsonl").read_text()
    for name in ("fisher.safetensors", "grad_estimate.safetensors"):
        a, b = load_file(str(whole / name)), load_file(str(out / name))
        assert a.keys() == b.keys()
        for k in a:  # fp32 summation order differs: the sums are reduced across ranks layer by layer
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6 * (float(a[k].abs().max()) or 1.0))
    scale = [json.loads((r / "report.json").read_text())["signal_scale"] for r in (whole, out)]
    assert scale[0] == pytest.approx(scale[1], rel=1e-12)


def test_a_rank_without_its_own_checkpoint_restarts_but_another_world_size_is_refused(tmp_path):
    """Ranks never communicate before the merge, so a rank killed before its first checkpoint
    finished (its folder empty or holding only a temporary) restarts its own shard; checkpoints
    written by another number of processes are refused, whatever this rank holds."""
    folder = tmp_path / "run.checkpoint"
    Checkpointer(CheckpointConfig(folder, every=1), 0, 2, {}).save(1, {"x": torch.ones(2)}, {}, [])
    (folder / "rank-001-of-002" / ".batch-000001.tmp-partial").mkdir(parents=True)  # killed mid-write
    resumed = Checkpointer(CheckpointConfig(folder, every=1, resume=True), 1, 2, {})
    assert resumed.load() is None  # starts its shard from the beginning
    assert Checkpointer(CheckpointConfig(folder, every=1, resume=True), 0, 2, {}).load()[0] == 1
    for rank, world in ((0, 1), (0, 3), (2, 3)):
        with pytest.raises(FisherSelectError, match="rank-000-of-002.*number of processes that wrote it"):
            Checkpointer(CheckpointConfig(folder, every=1, resume=True), rank, world, {})


# ---------------------------------------------------------------------------
# In process: every piece of state (token-level signs, split halves) and the refusals


TINY = [PromptRecord(i, p, None, {}) for i, p in enumerate(["2 3", "4 2 0", "3 3", "0 4 4", "2 2", "3 0"])]


def _tiny(tmp_path, **kw):
    model = enumeration_model()
    teacher = Teacher(enumeration_model(seed=1), name="teacher")
    objectives = [RLObjective(lambda r, t: float(len(t.split()) % 2)), OPDFullObjective(teacher, sign_draws=2)]
    return calibrate(model, TinyTokenizer(5), TINY, objectives, samples_per_prompt=2, max_new_tokens=3, seed=7,
                     batch_size=2, **{"progress": False, **kw})


class Stop(Exception):
    pass


def test_in_process_resume_restores_token_level_and_split_half_state(tmp_path, monkeypatch):
    whole = _tiny(tmp_path)
    folder = tmp_path / "run.checkpoint"
    from fisher_select.calibration import calibrator

    real = calibrator.Checkpointer.save
    calls = []

    def save_then_stop(self, done, *args):
        real(self, done, *args)
        calls.append(done)
        if done == 4:
            raise Stop  # an interruption right after the 4th checkpoint

    monkeypatch.setattr(calibrator.Checkpointer, "save", save_then_stop)
    with pytest.raises(Stop):
        _tiny(tmp_path, checkpoint=CheckpointConfig(folder, every=2))
    monkeypatch.setattr(calibrator.Checkpointer, "save", real)
    assert calls == [2, 4]
    resumed = _tiny(tmp_path, checkpoint=CheckpointConfig(folder, every=2, resume=True))
    assert not folder.exists()
    for name in whole.fisher:
        assert torch.equal(whole.fisher[name], resumed.fisher[name])
        assert torch.equal(whole.token_fisher[name], resumed.token_fisher[name])
        for a, b in zip(whole.objectives, resumed.objectives):
            assert torch.equal(a.grad_estimate[name], b.grad_estimate[name])
    assert whole.samples == resumed.samples and whole.checks == resumed.checks
    assert [o.signal_scale for o in whole.objectives] == [o.signal_scale for o in resumed.objectives]
    assert whole.diagnostics.split_half == resumed.diagnostics.split_half
    assert whole.diagnostics.unit_masses == resumed.diagnostics.unit_masses


def test_a_checkpoint_of_another_calibration_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "run.checkpoint"
    from fisher_select.calibration import calibrator

    real = calibrator.Checkpointer.save

    def save_then_stop(self, done, *args):
        real(self, done, *args)
        raise Stop

    monkeypatch.setattr(calibrator.Checkpointer, "save", save_then_stop)
    with pytest.raises(Stop):
        _tiny(tmp_path, checkpoint=CheckpointConfig(folder, every=1))
    monkeypatch.setattr(calibrator.Checkpointer, "save", real)
    model = enumeration_model()
    with pytest.raises(FisherSelectError, match="differs in .*seed"):
        calibrate(model, TinyTokenizer(5), TINY, RLObjective(lambda r, t: 0.0), samples_per_prompt=2, max_new_tokens=3,
                  seed=8, batch_size=2, progress=False, checkpoint=CheckpointConfig(folder, every=1, resume=True))
    with pytest.raises(FisherSelectError, match="--resume"):  # not resuming: refused, not overwritten
        _tiny(tmp_path, checkpoint=CheckpointConfig(folder, every=1))


def _interrupt_after(monkeypatch, stop_at: int):
    """Checkpointer.save raises Stop right after writing the checkpoint of batch ``stop_at``; returns the undo."""
    real = Checkpointer.save

    def save_then_stop(self, done, *args):
        path = real(self, done, *args)
        if done == stop_at:
            raise Stop
        return path

    monkeypatch.setattr(Checkpointer, "save", save_then_stop)
    return lambda: monkeypatch.setattr(Checkpointer, "save", real)


def test_a_resumed_calibration_says_which_checkpoint_and_how_many_samples_are_left(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "run.checkpoint"
    undo = _interrupt_after(monkeypatch, 2)
    with pytest.raises(Stop):
        _tiny(tmp_path, checkpoint=CheckpointConfig(folder, every=1))
    undo()
    lines = []
    kept = CheckpointConfig(folder, every=None, resume=True, keep_when_done=True)  # writes none, removes none
    _tiny(tmp_path, checkpoint=kept, log=lines.append)
    # 6 prompts x K = 2 in batches of one prompt (batch_size 2): 2 batches = 4 of 12 samples were done
    newest = folder / "rank-000-of-001" / "batch-000002"
    assert lines[0] == f"resumed from checkpoint {newest}: 4 of 12 samples done, 8 left", lines
    assert sum(line.startswith("resumed from") for line in lines) == 1
    # progress bars instead of log lines: the same line, on stderr above the bars
    capsys.readouterr()
    _tiny(tmp_path, checkpoint=CheckpointConfig(folder, resume=True), progress=True)
    assert f"resumed from checkpoint {newest}: 4 of 12 samples done, 8 left" in capsys.readouterr().err
    # a pass that starts from the beginning says nothing of the kind
    lines.clear()
    _tiny(tmp_path, log=lines.append)
    assert lines and not any(line.startswith("resumed") for line in lines)


def test_calibrate_no_progress_resume_prints_the_resumed_line(tmp_path, small_llama_dir, monkeypatch, capsys):
    from tests.tiny import run_command

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(3)))
    (tmp_path / "r.yaml").write_text(f"model: {small_llama_dir}\nprompts: p.jsonl\nobjective:\n  type: rl\n"
                                     "  reward: {type: regex, pattern: '[0-9]'}\ncheckpoint_every: 1\n")
    argv = ["calibrate", "--recipe", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "run"),
            "--samples-per-prompt", "2", "--max-new-tokens", "3", "--batch-size", "2", "--no-progress"]
    undo = _interrupt_after(monkeypatch, 1)
    with pytest.raises(Stop):
        run_command(argv)
    undo()
    capsys.readouterr()
    assert run_command(argv + ["--resume"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("resumed")]
    newest = checkpoint_folder(tmp_path / "run") / "rank-000-of-001" / "batch-000001"
    assert err == [f"resumed from checkpoint {newest}: 2 of 6 samples done, 4 left"]
