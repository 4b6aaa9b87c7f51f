"""Data-parallel calibration (torchrun / accelerate): two gloo ranks on the CPU.

Each rank samples its own share of the prompts with its own seed stream; the merged result
must equal what one process computes from the same shards and seeds, combined by hand.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fisher_select.calibration.calibrator import calibrate
from fisher_select.distributed import seed_for_rank, shard
from fisher_select.calibration.objectives import RLObjective
from fisher_select.calibration.prompts import PromptRecord
from tests.tiny import TinyTokenizer, enumeration_model, free_port

PROMPTS = [PromptRecord(i, p, None, {}) for i, p in enumerate(["2 3", "4 2 0", "3 3", "0 4 4"])]
K, SEED = 6, 11


def reward(record, text):
    return float(len(text.split()) % 2)


def _calibrate(prompts, seed):
    return calibrate(enumeration_model(), TinyTokenizer(5), prompts, RLObjective(reward), samples_per_prompt=K,
                     max_new_tokens=3, seed=seed, batch_size=K * 2, progress=False)


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cal = _calibrate(PROMPTS, SEED)
        if rank == 0:
            torch.save({"fisher": cal.fisher, "grad": cal.grad_estimate, "S": cal.signal_scale,
                        "n": cal.num_samples, "samples": len(cal.samples), "selfcheck": cal.checks["selfcheck"]}, out)
    finally:
        dist.destroy_process_group()



@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
@pytest.mark.slow
def test_two_ranks_merge_to_the_combined_single_process_result(tmp_path):
    out = tmp_path / "rank0.pt"
    mp.start_processes(_worker, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn")
    merged = torch.load(out)
    parts = [_calibrate(shard(PROMPTS, r, 2), seed_for_rank(SEED, r)) for r in range(2)]
    n = sum(p.num_samples for p in parts)
    assert merged["n"] == n == len(PROMPTS) * K and merged["samples"] == n
    for name, f in merged["fisher"].items():
        want = sum(p.fisher[name] * p.num_samples for p in parts) / n
        assert torch.allclose(f, want, rtol=1e-5, atol=1e-12), name
        want_g = sum(p.grad_estimate[name] * p.num_samples for p in parts) / n
        assert torch.allclose(merged["grad"][name], want_g, rtol=1e-5, atol=1e-12), name
    # S is the mean over all prompts of per-prompt variances: prompt-weighted, not rank-weighted.
    want_s = sum(p.signal_scale * p.num_prompts for p in parts) / len(PROMPTS)
    assert merged["S"] == pytest.approx(want_s, rel=1e-12)
    # each rank checked the rules on its own first batch; the merged run keeps the worst of them
    worst = max((p.checks["selfcheck"] for p in parts), key=lambda c: c["max_relative_error"])
    assert merged["selfcheck"]["max_relative_error"] == pytest.approx(worst["max_relative_error"], rel=1e-6)
    assert merged["selfcheck"]["parameter"] == worst["parameter"]


@pytest.mark.slow
def test_torchrun_cli_writes_one_merged_run(tmp_path, smol_tokenizer):
    """`torchrun --nproc_per_node 2 -m fisher_select calibrate ...`: rank 0 writes the merged run."""
    import json
    import subprocess
    import sys

    from tests.tiny import save_small_llama

    save_small_llama(tmp_path / "model", smol_tokenizer, hidden=32, intermediate=64, layers=1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": i}) + "\n" for i in range(5)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "fisher_select", "calibrate", "--model", str(tmp_path / "model"), "--prompts", str(prompts),
           "--num-prompts", "5", "--samples-per-prompt", "2", "--max-new-tokens", "3", "--no-progress",
           "--out", str(tmp_path / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("wrote ") == 1  # one rank reports
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["num_prompts"] == 5 and report["num_samples"] == 10
    lines = (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["prompt_index"] for line in lines) == sorted(list(range(5)) * 2)
