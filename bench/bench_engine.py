"""Scoring pass vs a plain forward+backward and vs the per-sample backward loop.

On the embedded default (SmolLM2-135M-Instruct), batch 8 x 128 tokens (64 prompt + 64
response), fp32, this machine's CPU. Prints times, ratios and peak memory (RSS growth).
Run: python bench/bench_engine.py [--batch 8] [--length 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import resource
import time

import torch

from fisher_select import score_sums
from fisher_select.engine import plan_coverage
from fisher_select.logprob import response_logprobs
from fisher_select.models import load_model


def timed(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loop", action="store_true", help="also time the per-sample backward loop")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, _, _ = load_model("smollm2-135m-instruct")
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (args.batch, args.length))
    mask = torch.ones_like(ids)
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[:, args.length // 2 :] = True
    signal = torch.randn(args.batch)
    params = [p for p in model.parameters()]
    cov = plan_coverage(model)

    def plain():
        model.zero_grad(set_to_none=True)
        response_logprobs(model, ids, mask, resp).sum().backward()

    def scoring():
        score_sums(model, ids, mask, resp, signal, coverage=cov)

    def loop():
        for b in range(args.batch):
            g = torch.autograd.grad(response_logprobs(model, ids[b : b + 1], mask[b : b + 1], resp[b : b + 1]).sum(), params)
            del g

    print(f"threads={torch.get_num_threads()} batch={args.batch} length={args.length} params={sum(p.numel() for p in params):,}")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t_plain = timed(plain, args.repeats)
    model.zero_grad(set_to_none=True)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t_score = timed(scoring, args.repeats)
    rss2 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"plain forward+backward      {t_plain:8.3f} s")
    print(f"scoring (squares+signal+total) {t_score:8.3f} s   ratio {t_score / t_plain:.2f}x")
    if args.loop:
        t_loop = timed(loop, 1)
        print(f"per-sample backward loop    {t_loop:8.3f} s   scoring is {t_loop / t_score:.2f}x faster")
    print(f"peak RSS after plain {rss1 / 1024:.0f} MiB, after scoring {rss2 / 1024:.0f} MiB (start {rss0 / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
