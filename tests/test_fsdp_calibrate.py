"""``shard="fsdp"``: two gloo ranks calibrate a tiny Llama wrapped with FSDP2 exactly as one process does.

Every rank samples every prompt in step (same samples, signals and S as one process); the ranks
split the scoring rows and rank 0 gathers F, g and the score sums.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import RLObjective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.errors import FisherSelectError
from tests.tiny import TinyTokenizer, free_port, tiny_model

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

PROMPTS = [PromptRecord(i, p, None, {}) for i, p in enumerate(["2 3", "4 2 9", "3 3", "7 4 4 5", "2 2", "30 8"])]


def reward(record, text):
    return float(len(text.split()) % 2)


def _calibrate(model, **kw):
    return calibrate(model, TinyTokenizer(64), PROMPTS, RLObjective(reward), samples_per_prompt=3, max_new_tokens=4,
                     seed=7, batch_size=6, stability=False, progress=False, **kw)


def _summary(cal):
    return {"fisher": cal.fisher, "score_mean": cal.score_mean, "grad": cal.grad_estimate,
            "scale": cal.objectives[0].signal_scale, "samples": cal.samples, "count": cal.num_samples}


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from fisher_select.calibration import fsdp

        results = {}
        for budget in (10**6, 8):  # whole batches, and micro-batches of a row or two per rank
            cal = _calibrate(fsdp.wrap(tiny_model("llama-tied")), shard="fsdp", max_batch_tokens=budget)
            results[budget] = None if cal is None else _summary(cal)
        torch.save(results, f"{out}.{rank}")
        dist.barrier()  # leave together (gloo sometimes aborts a rank exiting alone, docs/SCALING.md)
    finally:
        dist.destroy_process_group()
    os._exit(0)


def test_two_fsdp_ranks_calibrate_like_one_process(tmp_path):
    out = tmp_path / "rank"
    mp.start_processes(_worker, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    want = _summary(_calibrate(tiny_model("llama-tied")))
    for budget, got in ranks[0].items():
        assert ranks[1][budget] is None  # rank 0 alone holds the result
        assert got["samples"] == want["samples"] and got["count"] == want["count"]
        assert got["scale"] == want["scale"]
        for kind in ("fisher", "score_mean", "grad"):
            assert set(got[kind]) == set(want[kind])
            for name, w in want[kind].items():
                torch.testing.assert_close(got[kind][name], w, rtol=1e-5, atol=1e-6 * (float(w.abs().max()) or 1.0))


def test_fsdp_refuses_what_it_does_not_run_yet():
    with pytest.raises(FisherSelectError, match="two or more ranks.*no-stability"):
        calibrate(tiny_model("llama-tied"), TinyTokenizer(64), PROMPTS, RLObjective(reward), samples_per_prompt=3,
                  max_new_tokens=4, shard="fsdp", progress=False)


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
