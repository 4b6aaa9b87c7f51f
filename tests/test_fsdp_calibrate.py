"""``shard="fsdp"``: gloo ranks calibrate a tiny Llama wrapped with FSDP2 exactly as data-parallel ranks do.

Each rank samples its own share of the prompts with its own seed stream (the data-parallel
shards and streams), its forwards in lockstep with the other ranks' (a rank with shorter
responses, fewer prompts or fewer batches makes one-token forwards meanwhile); the ranks score
their own rows into their rows of the sums, and rank 0 gathers F, g, the score sums and every
rank's samples and statistics, for the run and for each checkpoint. The reference is the same
calibration run data-parallel on the same ranks (itself checked against the hand-combined
one-process result in tests/test_distributed.py).
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
from fisher_select.calibration.config import CalibrationConfig
from fisher_select.engine.scoring import plan_coverage
from fisher_select.errors import FisherSelectError
from tests.tiny import TinyTokenizer, free_port, tiny_model

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

# 7 prompts: 2 ranks hold 4 and 3, 4 ranks 2, 2, 2 and 1 (uneven shards and batch counts at batch_size 3)
PROMPTS = [PromptRecord(i, p, None, {}) for i, p in enumerate(["2 3", "4 2 9", "3 3", "7 4 4 5", "2 2", "30 8", "5"])]
# Checkpoint key of the model: a sharded model has no full weights to fingerprint (the CLI fingerprints first)
MODEL_ID = "tiny-llama-tied"


def reward(record, text):
    return float(len(text) % 2)  # varies within a prompt's responses: S > 0, g not zero


def _calibrate(model, **kw):
    kw = {"stability": False, "batch_size": 6, **kw}  # 3 responses per prompt: 2 prompts per batch at batch_size 6
    return calibrate(model, TinyTokenizer(64), PROMPTS, RLObjective(reward), samples_per_prompt=3, max_new_tokens=4,
                     seed=7, progress=False, **kw)


def _summary(cal):
    out = {"fisher": cal.fisher, "score_mean": cal.score_mean, "grad": cal.grad_estimate,
           "scale": cal.objectives[0].signal_scale, "samples": cal.samples, "count": cal.num_samples}
    if cal.diagnostics.split_half is not None:
        out["split"] = vars(cal.diagnostics.split_half)
        out["units"] = (cal.diagnostics.unit_masses, cal.diagnostics.unit_counts)
    return out


def _assert_same(got, want, units: bool = True):
    assert got["count"] == want["count"] and len(got["samples"]) == len(want["samples"])
    for a, b in zip(got["samples"], want["samples"]):  # the same tokens; an FSDP2 layer's all-gathered weight
        assert {**a, "logprob": 0} == {**b, "logprob": 0}  # may take another fp32 GEMM path than the plain one's
        assert a["logprob"] == pytest.approx(b["logprob"], rel=1e-6)
    assert got["scale"] == pytest.approx(want["scale"], rel=1e-12)
    for kind in ("fisher", "score_mean", "grad"):
        assert set(got[kind]) == set(want[kind])
        for name, w in want[kind].items():
            torch.testing.assert_close(got[kind][name], w, rtol=1e-5, atol=1e-6 * (float(w.abs().max()) or 1.0))
    assert ("split" in got) == ("split" in want)
    if "split" in want:  # split halves: the same numbers up to fp32 summation order
        _assert_close(got["split"], want["split"])
        if units:
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


# Whole batches without split halves; with them, one prompt per batch (uneven batch counts over the ranks)
# and micro-batches of a row or two.
CASES = {"whole": {"max_batch_tokens": 10**6}, "halves": {"max_batch_tokens": 8, "stability": True, "batch_size": 3}}


def _job_equal(out: Path) -> dict:
    """Each case data-parallel (the plain model on the same ranks) and under FSDP."""
    runs = {}
    for case, kw in CASES.items():
        runs[f"{case}/dp"] = _calibrate(tiny_model("llama-tied"), **kw)
        runs[f"{case}/fsdp"] = _calibrate(_fsdp_model(), shard="fsdp", **kw)
    return runs


RESUME = {"shard": "fsdp", **CASES["halves"]}


def _job_resume(out: Path) -> dict:
    """Interrupted after the checkpoint of batch 2 and resumed under FSDP; a one-process checkpoint is refused."""
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
    if dist.get_rank() == 0:  # a copy for one process to try (the resumed run removes its checkpoint)
        shutil.copytree(folder, out / "copy.checkpoint")
    dist.barrier()
    runs = {"fsdp": _calibrate(_fsdp_model(), **RESUME, checkpoint=CheckpointConfig(
        folder, every=1, resume=True, model_id=MODEL_ID))}
    try:  # written by one process before the ranks started
        _calibrate(_fsdp_model(), **RESUME, checkpoint=CheckpointConfig(
            out / "one.checkpoint", every=1, resume=True, model_id=MODEL_ID))
        runs["one"] = "resumed"
    except FisherSelectError as exc:
        runs["one"] = str(exc)
    dist.barrier()
    runs["left"] = sorted(p.name for p in out.iterdir() if p.name.endswith(".checkpoint"))
    return runs


def _job_lockstep(out: Path) -> dict:
    """Rank 0 makes 3 forwards inside the block, rank 1 one: rank 1 makes 2 one-token forwards leaving it."""
    from fisher_select.calibration import fsdp

    model = _fsdp_model()
    step = fsdp.Lockstep(model, pad_id=0)
    with step(), torch.no_grad():
        for _ in range(3 if dist.get_rank() == 0 else 1):
            model(input_ids=torch.tensor([[3, 4, 5]]))
    with step():  # no rank forwards: all leave at once
        pass
    return {"dummies": step.dummies}


def _job_selfcheck(out: Path) -> dict:
    """The rules' self-check under FSDP: a correct model's is recorded; a wrong rule is refused by fsdp.wrap on
    every rank, before sharding, with the module named (the CLI wraps with the first prompts)."""
    from fisher_select.calibration import fsdp
    from fisher_select.engine.rules import registry
    from fisher_select.engine.rules.linear import LinearRule
    from tests.test_selfcheck import OffsetLinear, _with_offset_linear

    cal = _calibrate(_fsdp_model(), shard="fsdp", **CASES["whole"])
    runs = {"checks": None if cal is None else cal.checks}
    registry._BY_CLASS[OffsetLinear] = LinearRule()  # registered by mistake: the Linear rule misses its factor 2
    try:
        fsdp.wrap(_with_offset_linear(tiny_model("llama-tied"), "model.layers.1.mlp.down_proj"), [[3, 4, 5], [7, 2]])
        runs["wrong"] = "wrapped"
    except FisherSelectError as exc:
        runs["wrong"] = str(exc)
    finally:
        del registry._BY_CLASS[OffsetLinear]
    return runs


JOBS = {"equal": _job_equal, "resume": _job_resume, "lockstep": _job_lockstep, "selfcheck": _job_selfcheck}


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
    checkpoint of an interrupted run, which the ranks must refuse."""
    out = tmp_path_factory.mktemp("fsdp")
    undo = _stop_after(1)
    try:
        with pytest.raises(Stop):
            _calibrate(tiny_model("llama-tied"), **ONE,
                       checkpoint=CheckpointConfig(out / "one.checkpoint", every=1, model_id=MODEL_ID))
    finally:
        undo()
    return out, _spawn(2, out, "equal", "resume", "lockstep", "selfcheck")


def _check_equal(ranks):
    world = len(ranks)
    for case in CASES:
        got, want = ranks[0]["equal"][f"{case}/fsdp"], ranks[0]["equal"][f"{case}/dp"]
        assert all(r["equal"][f"{case}/fsdp"] is None for r in ranks[1:])  # rank 0 alone holds the result
        assert got["count"] == len(PROMPTS) * 3 and got["scale"] > 0
        assert sorted({s["prompt_index"] for s in got["samples"]}) == list(range(len(PROMPTS)))
        _assert_same(got, want, units=False)
        if "split" in want:
            # A unit of the spread of module masses is one scoring call over every rank's rows (data-parallel:
            # one rank's call): the same halves, cut into world-times larger units with the same totals.
            masses, counts = got["units"]
            dp_masses, dp_counts = want["units"]
            assert sum(counts) == sum(dp_counts) == got["count"] and len(counts) <= len(dp_counts)
            for p in range(len(masses[0])):
                assert sum(m[p] for m in masses) == pytest.approx(sum(m[p] for m in dp_masses), rel=1e-5)
            if world == 2:  # one prompt per batch, even ones on rank 0: each call holds one rank's rows
                _assert_close(sorted(zip(counts, masses)), sorted(zip(dp_counts, dp_masses)))
    return world


def test_two_fsdp_ranks_calibrate_like_two_data_parallel_ranks(two_ranks):
    _check_equal(two_ranks[1])


@pytest.mark.slow  # four ranks on 2 cores: ~25 s
def test_four_fsdp_ranks_calibrate_like_four_data_parallel_ranks(tmp_path):
    _check_equal(_spawn(4, tmp_path, "equal"))


def test_lockstep_matches_every_forward_of_the_busiest_rank(two_ranks):
    assert [r["lockstep"]["dummies"] for r in two_ranks[1]] == [0, 2]


def test_fsdp_interrupted_then_resumed_equals_the_uninterrupted_run(two_ranks):
    """One checkpoint holds every rank's generator, statistics and samples beside the gathered sums: the
    resumed run equals the uninterrupted one (samples, F, g, S, split halves and their units). A
    checkpoint of another number of ranks (one process) is refused by the ranks, and one process
    refuses theirs."""
    out, ranks = two_ranks
    want = ranks[0]["equal"]["halves/fsdp"]
    assert ranks[1]["resume"]["fsdp"] is None
    _assert_same(ranks[0]["resume"]["fsdp"], want)
    for r in ranks:
        assert "differs in fsdp_ranks" in r["resume"]["one"]
    assert ranks[0]["resume"]["left"] == ["copy.checkpoint", "one.checkpoint"]  # the resumed run removed its own
    with pytest.raises(FisherSelectError, match="differs in fsdp_ranks"):
        _calibrate(tiny_model("llama-tied"), **ONE, checkpoint=CheckpointConfig(
            out / "copy.checkpoint", every=1, resume=True, model_id=MODEL_ID))


def test_fsdp_runs_the_rules_selfcheck_before_sharding(two_ranks):
    """Issue 30: under --shard fsdp nothing compared the rules with autograd; now fsdp.wrap does, on the full model."""
    ranks = two_ranks[1]
    got = ranks[0]["selfcheck"]["checks"]["selfcheck"]
    assert ranks[1]["selfcheck"]["checks"] is None  # rank 0 alone holds the result
    assert got["on"] == "first prompts, before sharding" and got["rows"] == 2
    assert got["parameters"] == len(plan_coverage(tiny_model("llama-tied")).users)
    assert 0 < got["max_relative_error"] <= got["tolerance"]
    for r in ranks:  # every rank refuses, so none waits in a collective for the others
        assert "model.layers.1.mlp.down_proj.weight (module 'model.layers.1.mlp.down_proj'" in r["selfcheck"]["wrong"]
        assert "OffsetLinear" in r["selfcheck"]["wrong"] and "LinearRule" in r["selfcheck"]["wrong"]


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


@pytest.mark.slow  # two torchrun launches of two ranks, each loading torch and transformers (~40 s on 2 cores)
def test_calibrate_shard_fsdp_under_torchrun_writes_the_data_parallel_run(small_llama_dir, tmp_path):
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.getcwd()}
    args = ["-m", "fisher_select", "calibrate", "--recipe", "rl-arithmetic", "--model", str(small_llama_dir),
            "--num-prompts", "5", "--samples-per-prompt", "2", "--batch-size", "2", "--max-new-tokens", "4",
            "--no-stability", "--no-progress"]
    runs = {}
    for name, extra in {"dp": [], "fsdp": ["--shard", "fsdp"]}.items():
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(free_port())]
        done = subprocess.run([*torchrun, *args, *extra, "--out", str(tmp_path / name)], capture_output=True,
                              text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = tmp_path / name
    dp, fsdp = runs["dp"], runs["fsdp"]
    assert (dp / "samples.jsonl").read_text() == (fsdp / "samples.jsonl").read_text()
    for file in ("fisher.safetensors", "grad_estimate.safetensors"):
        a, b = load_file(str(dp / file)), load_file(str(fsdp / file))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6 * (float(a[k].abs().max()) or 1.0))
    scale = [json.loads((r / "report.json").read_text())["signal_scale"] for r in (dp, fsdp)]
    assert scale[0] == pytest.approx(scale[1], rel=1e-12)
    checks = [json.loads((r / "report.json").read_text())["checks"]["selfcheck"] for r in (dp, fsdp)]
    assert [c["on"] for c in checks] == ["first batch", "first prompts, before sharding"]  # the CLI wraps with them
    assert all(c["rows"] == 2 and 0 < c["max_relative_error"] <= c["tolerance"] for c in checks)
