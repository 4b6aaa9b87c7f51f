"""Scoring pass vs a plain forward+backward and vs the per-sample backward loop.

On the embedded default (SmolLM2-135M-Instruct), batch 8 x 128 tokens (64 prompt + 64
response), fp32, this machine's CPU. Each mode runs in its own process, so its peak RSS is its
own; times are the best of ``--repeats`` runs and ratios come from one invocation.
Run: python bench/bench_engine.py [--batch 8] [--length 128] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

MODES = ("plain", "scoring", "loop")


def measure(mode: str, args) -> dict:
    """Run one mode in this process: load the model, build the batch, time it, report peak RSS."""
    import torch

    from fisher_select import score_sums
    from fisher_select.engine.scoring import plan_coverage
    from fisher_select.engine.logprob import response_logprobs
    from fisher_select.models import load_model

    torch.manual_seed(0)
    model, _, _ = load_model("smollm2-135m-instruct", device=args.device)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.length), device=args.device)
    mask = torch.ones_like(ids)
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[:, args.length // 2 :] = True
    signal = torch.randn(args.batch, device=args.device)
    params = list(model.parameters())
    cov = plan_coverage(model)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def plain():
        model.zero_grad(set_to_none=False)
        response_logprobs(model, ids, mask, resp).sum().backward()

    def scoring():
        score_sums(model, ids, mask, resp, signal, coverage=cov)

    def loop():
        for b in range(args.batch):
            torch.autograd.grad(response_logprobs(model, ids[b : b + 1], mask[b : b + 1], resp[b : b + 1]).sum(), params)

    fn = {"plain": plain, "scoring": scoring, "loop": loop}[mode]
    best = float("inf")
    for _ in range(args.repeats if mode != "loop" else 1):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    param_mib = sum(p.numel() for p in params) * 4 / 2**20
    return {"mode": mode, "seconds": best, "peak_rss_mib": peak / 1024, "extra_mib": (peak - base_rss) / 1024,
            "param_mib": param_mib, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args)))
        return
    results = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode, "--batch", str(args.batch), "--length", str(args.length),
               "--repeats", str(args.repeats), "--device", args.device]
        results[mode] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    plain, scoring, loop = results["plain"], results["scoring"], results["loop"]
    print(f"SmolLM2-135M, batch {args.batch} x {args.length} tokens, {args.device}, threads={plain['threads']}, "
          f"parameters {plain['param_mib']:.0f} MiB fp32")
    print(f"| pass | time (s) | vs plain | peak RSS (MiB) | extra over model+batch (MiB) |")
    print(f"|---|---|---|---|---|")
    for name, r in (("plain forward+backward", plain), ("scoring (squares+signal+total)", scoring),
                    ("per-sample backward loop", loop)):
        print(f"| {name} | {r['seconds']:.2f} | {r['seconds'] / plain['seconds']:.2f}x | {r['peak_rss_mib']:.0f} "
              f"| {r['extra_mib']:.0f} |")
    diff = scoring["peak_rss_mib"] - plain["peak_rss_mib"]
    print(f"scoring is {loop['seconds'] / scoring['seconds']:.2f}x faster than the per-sample loop; its peak is "
          f"{diff:.0f} MiB = {diff / plain['param_mib']:.2f} parameter-sizes above the plain pass "
          "(expected 2.00: three fp32 accumulators instead of one .grad; per-sample pieces are 2 MiB)")


if __name__ == "__main__":
    main()
