"""``shard="fsdp"``: gloo ranks calibrate a tiny Llama wrapped with FSDP2 exactly as one process does.

Every rank samples every prompt in step (same samples, signals, S and split-half bookkeeping as
one process); the ranks split the scoring rows and rank 0 gathers F, g and the score sums, for
the run and for each checkpoint (written in the one-process format, so a run interrupted under
FSDP resumes under FSDP or in one process, and the other way round).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fisher_select.calibration import calibrator
from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.checkpoint import CheckpointConfig
from fisher_select.calibration.objectives import RLObjective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.calibration.settings import CalibrationConfig
from fisher_select.errors import FisherSelectError
from tests.tiny import TinyTokenizer, free_port, tiny_model

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

PROMPTS = [PromptRecord(i, p, None, {}) for i, p in enumerate(["2 3", "4 2 9", "3 3", "7 4 4 5", "2 2", "30 8"])]
# Checkpoint key of the model: a sharded model has no full weights to fingerprint (the CLI fingerprints first)
MODEL_ID = "tiny-llama-tied"


def reward(record, text):
    return float(len(text.split()) % 2)


def _calibrate(model, **kw):
    kw = {"stability": False, **kw}  # 6 prompts, 3 batches of 2 prompts x 3 responses
    return calibrate(model, TinyTokenizer(64), PROMPTS, RLObjective(reward), samples_per_prompt=3, max_new_tokens=4,
                     seed=7, batch_size=6, progress=False, **kw)


def _summary(cal):
    out = {"fisher": cal.fisher, "score_mean": cal.score_mean, "grad": cal.grad_estimate,
           "scale": cal.objectives[0].signal_scale, "samples": cal.samples, "count": cal.num_samples}
    if cal.diagnostics.split_half is not None:
        out["split"] = vars(cal.diagnostics.split_half)
        out["units"] = (cal.diagnostics.unit_masses, cal.diagnostics.unit_counts)
    return out


def _assert_same(got, want):
    assert got["samples"] == want["samples"] and got["count"] == want["count"]
    assert got["scale"] == want["scale"]
    for kind in ("fisher", "score_mean", "grad"):
        assert set(got[kind]) == set(want[kind])
        for name, w in want[kind].items():
            torch.testing.assert_close(got[kind][name], w, rtol=1e-5, atol=1e-6 * (float(w.abs().max()) or 1.0))
    assert ("split" in got) == ("split" in want)
    if "split" in want:  # split halves and per-call masses: the same numbers up to fp32 summation order
        _assert_close(got["split"], want["split"])
        _assert_close(got["units"], want["units"])


def _assert_close(got, want):
    """Nested dicts and lists: numbers to 1e-5 relative, everything else equal."""
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            _assert_close(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _assert_close(a, b)
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-12)
    else:
        assert got == want


class Stop(Exception):
    """An interruption right after a checkpoint, on every rank at the same batch."""


def _stop_after(done: int):
    """Patch the calibrator to stop right after writing the checkpoint of batch ``done``."""
    real = calibrator._Calibrator._save_checkpoint

    def save_then_stop(self, batches):
        real(self, batches)
        if batches == done:
            raise Stop

    calibrator._Calibrator._save_checkpoint = save_then_stop
    return lambda: setattr(calibrator._Calibrator, "_save_checkpoint", real)


def _fsdp_model():
    from fisher_select.calibration import fsdp

    return fsdp.wrap(tiny_model("llama-tied"))


def _job_equal(out: Path) -> dict:
    """Whole batches without split halves; micro-batches of a row or two per rank with them."""
    return {budget: _calibrate(_fsdp_model(), shard="fsdp", max_batch_tokens=budget, stability=budget == 8)
            for budget in (10**6, 8)}


def _job_resume(out: Path) -> dict:
    """Interrupted after the checkpoint of batch 2 and resumed under FSDP; a one-process checkpoint resumed too."""
    folder = out / "fsdp.checkpoint"
    undo = _stop_after(2)
    try:
        _calibrate(_fsdp_model(), **RESUME, checkpoint=CheckpointConfig(folder, every=1, model_id=MODEL_ID))
        raise AssertionError("not interrupted")
    except Stop:
        pass
    finally:
        undo()
    dist.barrier()
    if dist.get_rank() == 0:  # a copy for a one-process resume (the resumed run removes its checkpoint)
        shutil.copytree(folder, out / "copy.checkpoint")
    dist.barrier()
    runs = {}
    for name in ("fsdp", "one"):  # "one": written by one process before the ranks started
        cfg = CheckpointConfig(out / f"{name}.checkpoint", every=1, resume=True, model_id=MODEL_ID)
        runs[name] = _calibrate(_fsdp_model(), **RESUME, checkpoint=cfg)
    dist.barrier()
    runs["left"] = [p.name for p in out.iterdir() if p.name != "copy.checkpoint" and p.name.endswith(".checkpoint")]
    return runs


RESUME = {"shard": "fsdp", "max_batch_tokens": 8, "stability": True}
JOBS = {"equal": _job_equal, "resume": _job_resume}


def _worker(rank, world, port, out, jobs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for job in jobs:
            done = JOBS[job](Path(out))
            results[job] = {k: _summary(v) if hasattr(v, "fisher") else v for k, v in done.items()}
        torch.save(results, Path(out) / f"rank.{rank}")
        dist.barrier()  # leave together (gloo sometimes aborts a rank exiting alone, docs/SCALING.md)
    finally:
        dist.destroy_process_group()
    os._exit(0)


def _spawn(world: int, out: Path, *jobs: str) -> list[dict]:
    mp.start_processes(_worker, args=(world, free_port(), str(out), jobs), nprocs=world, start_method="spawn")
    return [torch.load(out / f"rank.{r}", weights_only=False) for r in range(world)]


ONE = {k: v for k, v in RESUME.items() if k != "shard"}  # the same calibration in one process


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One spawn of two ranks runs both jobs (spawning is most of the time); first one process writes the
    checkpoint of an interrupted run for the ranks to resume."""
    out = tmp_path_factory.mktemp("fsdp")
    undo = _stop_after(1)
    try:
        with pytest.raises(Stop):
            _calibrate(tiny_model("llama-tied"), **ONE,
                       checkpoint=CheckpointConfig(out / "one.checkpoint", every=1, model_id=MODEL_ID))
    finally:
        undo()
    return out, _spawn(2, out, "equal", "resume")


def _check_equal(ranks):
    for budget, got in ranks[0]["equal"].items():
        assert all(r["equal"][budget] is None for r in ranks[1:])  # rank 0 alone holds the result
        want = _summary(_calibrate(tiny_model("llama-tied"), max_batch_tokens=budget, stability=budget == 8))
        assert ("split" in want) == (budget == 8)  # both halves have prompts
        _assert_same(got, want)


def test_two_fsdp_ranks_calibrate_like_one_process(two_ranks):
    _check_equal(two_ranks[1])


@pytest.mark.slow  # four ranks on 2 cores: ~25 s
def test_four_fsdp_ranks_calibrate_like_one_process(tmp_path):
    _check_equal(_spawn(4, tmp_path, "equal"))


def test_fsdp_interrupted_then_resumed_equals_one_uninterrupted_process(two_ranks):
    """Checkpoints are in the one-process format: FSDP resumes its own and a one-process one; one process
    resumes an FSDP one; all equal the uninterrupted one-process run (samples, F, g, S, split halves)."""
    out, ranks = two_ranks
    want = _summary(_calibrate(tiny_model("llama-tied"), **ONE))
    assert ranks[1]["resume"]["fsdp"] is None and ranks[1]["resume"]["one"] is None
    _assert_same(ranks[0]["resume"]["fsdp"], want)
    _assert_same(ranks[0]["resume"]["one"], want)
    assert ranks[0]["resume"]["left"] == []  # each resumed run removed its checkpoint
    from_fsdp = _calibrate(tiny_model("llama-tied"), **ONE, checkpoint=CheckpointConfig(
        out / "copy.checkpoint", every=1, resume=True, model_id=MODEL_ID))
    _assert_same(_summary(from_fsdp), want)


def test_fsdp_refusals_say_what_where_and_what_to_do(monkeypatch):
    from fisher_select.calibration import fsdp
    from fisher_select.engine.sharded import score_sums_sharded

    with pytest.raises(FisherSelectError, match="two or more ranks.*drop --shard"):
        _calibrate(tiny_model("llama-tied"), shard="fsdp")
    with pytest.raises(FisherSelectError, match=r"calibration.fsdp.wrap.*--nproc_per_node 2.*drop --shard"):
        fsdp.wrap(tiny_model("llama-tied"))
    monkeypatch.setattr(fsdp, "rank_world", lambda: (0, 2))  # the model's layout is checked before the mesh
    with pytest.raises(FisherSelectError, match=r"calibration.fsdp.wrap.*TwiceLM has no model.layers.*drop --shard"):
        fsdp.wrap(tiny_model("linear-called-twice"))
    token = SimpleNamespace(name="opd", token_level=True)
    found = fsdp.problems(tiny_model("llama-tied"), CalibrationConfig(accumulate_on="cpu"), [token],
                          CheckpointConfig(Path("x"), every=1))
    assert len(found) == 4  # one sentence each, the not-wrapped model's first
    assert "drop --accumulate-on cpu" in found[1]
    assert "['opd'] are token-level" in found[2] and "without --shard" in found[2]
    assert "model_id=fingerprint(model)['id']" in found[3] and "before calibration.fsdp.wrap" in found[3]
    with pytest.raises(FisherSelectError, match="no rule covers.*score unsharded"):
        score_sums_sharded(tiny_model("llama-fallback"), [])


@pytest.mark.slow  # two torchrun ranks and one process, each loading torch and transformers (~40 s on 2 cores)
def test_calibrate_shard_fsdp_under_torchrun_writes_the_one_process_run(small_llama_dir, tmp_path):
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.getcwd()}
    args = ["-m", "fisher_select", "calibrate", "--recipe", "rl-arithmetic", "--model", str(small_llama_dir),
            "--num-prompts", "4", "--samples-per-prompt", "2", "--batch-size", "4", "--max-new-tokens", "4",
            "--no-stability", "--no-progress"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    runs = {}
    for name, cmd in {"one": [sys.executable, *args], "fsdp": [*torchrun, *args, "--shard", "fsdp"]}.items():
        done = subprocess.run([*cmd, "--out", str(tmp_path / name)], capture_output=True, text=True, env=env,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = tmp_path / name
    one, fsdp = runs["one"], runs["fsdp"]
    assert (one / "samples.jsonl").read_text() == (fsdp / "samples.jsonl").read_text()
    for file in ("fisher.safetensors", "grad_estimate.safetensors"):
        a, b = load_file(str(one / file)), load_file(str(fsdp / file))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6 * (float(a[k].abs().max()) or 1.0))
    scale = [json.loads((r / "report.json").read_text())["signal_scale"] for r in (one, fsdp)]
    assert scale[0] == scale[1]
