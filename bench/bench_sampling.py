"""Sampling throughput: fisher_select's sampler beside HF ``generate(do_sample=True, top_k=0)``.

Same model, same prompts, same batches (K rows per prompt, ``--batch`` rows per call, as
``calibrate`` samples), one process, modes interleaved round by round after a warm-up, so load
on a shared machine hits every mode alike. Sampled tokens are response tokens up to and
including the first EOS (what calibration scores); tokens/s is their count over wall time,
median over rounds, with the spread. Every mode draws from the full distribution at
temperature 1 (``generate`` told ``top_k=0, top_p=1``, since it keeps 50 tokens by default).

Modes: ``fisher_select`` (distinct prompts prefilled once in length buckets, caches merged,
finished rows dropped); ``fs_one_prefill`` (one padded prefill, finished rows kept: the loop
before issue 8); ``hf_generate``.

    python bench/bench_sampling.py                                   # embedded default, 8 rows, K=4
    python bench/bench_sampling.py --batches 4 --max-new-tokens 128 --json bench/results/sampling.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fisher_select.calibration.prompts import PromptRecord, load_prompts, render_prompt
from fisher_select.calibration.sampling import left_pad, sample_responses
from fisher_select.models import load_model

MODES = ("fisher_select", "fs_one_prefill", "hf_generate")
LONG = ("Read the question carefully. Think about what is being asked, which numbers matter and which "
        "operation combines them. Many questions describe a small story with people, objects and simple "
        "actions such as getting more, giving away or sharing equally. ")


def prompt_rows(tokenizer, n_prompts: int, k: int, mixed: bool) -> list[list[int]]:
    """Rendered prompts, each repeated K times; with ``mixed`` every other one carries a long preamble."""
    records = load_prompts("recipes/data/arithmetic.jsonl", limit=n_prompts)
    out = []
    for i, r in enumerate(records):
        text = (LONG * (1 + i % 3) + r.prompt) if mixed and i % 2 else r.prompt
        ids = render_prompt(tokenizer, PromptRecord(r.index, text, None, {}))
        out += [ids] * k
    return out


def response_length(row: list[int], eos: set[int]) -> int:
    """Tokens up to and including the first EOS (all of them without one)."""
    for i, t in enumerate(row):
        if t in eos:
            return i + 1
    return len(row)


def run_fisher_select(model, rows, eos, pad, args, seed, **kw) -> int:
    g = torch.Generator(device=model.device).manual_seed(seed)  # on the model's device, as calibrate draws
    drawn = sample_responses(model, rows, eos_ids=eos, pad_id=pad, max_new_tokens=args.max_new_tokens,
                             generator=g, **kw)
    return sum(len(s.response_ids) for s in drawn)


def run_hf(model, rows, eos, pad, args, seed) -> int:
    torch.manual_seed(seed)
    ids, mask = left_pad(rows, pad, model.device)  # (B, P)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                             typical_p=1.0, repetition_penalty=1.0, max_new_tokens=args.max_new_tokens,
                             eos_token_id=sorted(eos), pad_token_id=pad)
    return sum(response_length(r, eos) for r in out[:, ids.shape[1]:].tolist())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="rows per sampling call (calibrate's batch_size)")
    ap.add_argument("--k", type=int, default=4, help="samples per prompt")
    ap.add_argument("--batches", type=int, default=3, help="sampling calls per mode and round")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--same-length", action="store_true", help="arithmetic prompts only (no long preambles)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a --model spec: the embedded default, a .gguf file or a model directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, _ = load_model(args.model, device=args.device)
    model.eval()
    eos = {tok.eos_token_id} | ({model.generation_config.eos_token_id} if isinstance(
        model.generation_config.eos_token_id, int) else set(model.generation_config.eos_token_id or []))
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    per = args.batch // args.k
    rows = prompt_rows(tok, per * args.batches, args.k, not args.same_length)
    calls = [rows[i:i + args.batch] for i in range(0, len(rows), args.batch)]
    modes = {
        "fisher_select": lambda b, s: run_fisher_select(model, b, eos, pad, args, s),
        "fs_one_prefill": lambda b, s: run_fisher_select(model, b, eos, pad, args, s, bucket_waste=None, compact=False),
        "hf_generate": lambda b, s: run_hf(model, b, eos, pad, args, s),
    }
    times = {m: [] for m in modes}
    tokens = {m: [] for m in modes}
    for r in range(args.rounds + 1):  # round 0: warm-up, not recorded
        for name, fn in modes.items():
            t0, n = time.perf_counter(), 0
            for i, b in enumerate(calls):
                n += fn(b, 1000 * r + i)
            dt = time.perf_counter() - t0
            if r:
                times[name].append(dt)
                tokens[name].append(n)
    lengths = sorted({len(x) for x in rows})
    print(f"{args.model} on {args.device}, {len(calls)} calls of {args.batch} rows (K={args.k}), prompt lengths {lengths}, "
          f"max_new_tokens {args.max_new_tokens}, {torch.get_num_threads()} threads, {args.rounds} interleaved rounds")
    print("| sampler | tokens/s (median) | min-max over rounds | sampled tokens per round | vs hf_generate |")
    print("|---|---|---|---|---|")
    rates = {m: [n / t for n, t in zip(tokens[m], times[m])] for m in modes}
    base = statistics.median(rates["hf_generate"])
    result = {"meta": {"batch": args.batch, "k": args.k, "calls": len(calls), "prompt_lengths": lengths,
                       "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
                       "model": args.model, "device": args.device,
                       "rounds": args.rounds, "torch": torch.__version__}, "modes": {}}
    for m in modes:
        med = statistics.median(rates[m])
        print(f"| {m} | {med:.1f} | {min(rates[m]):.1f}-{max(rates[m]):.1f} | "
              f"{statistics.median(tokens[m]):.0f} | {med / base:.2f}x |")
        result["modes"][m] = {"tokens_per_s": rates[m], "seconds": times[m], "tokens": tokens[m],
                              "median_tokens_per_s": med, "vs_hf_generate": med / base}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
