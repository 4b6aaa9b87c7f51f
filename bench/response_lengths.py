"""How long the embedded default's own responses are: the share that end within N new tokens.

The outcome study needs at least 90% of sampled responses to end (docs/OUTCOMES.md, "Response
length"); this picks the study's ``max_new_tokens`` per prompt file. K samples for each of N
prompts of FILE (from prompt ``--skip`` on), one seeded draw at the longest length; a response
that ended (EOS) after L tokens ends within every N >= L.

    HF_HUB_OFFLINE=1 python bench/response_lengths.py fisher_select/recipes/data/arithmetic_chat.jsonl
    HF_HUB_OFFLINE=1 python bench/response_lengths.py fisher_select/recipes/data/arithmetic.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from fisher_select.calibration.prompts import load_prompts, render_prompt
from fisher_select.calibration.sampling import eos_ids_of, pad_id_of, sample_responses
from fisher_select.models import load_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompts", help="a prompt file (JSONL)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts-n", type=int, default=32)
    p.add_argument("--skip", type=int, default=100, help="start at this prompt (away from any study's draw order)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_model(args.model, "cpu", "float32")
    records = load_prompts(args.prompts)[args.skip : args.skip + args.prompts_n]
    rendered = [render_prompt(tokenizer, r) for r in records]
    started = time.perf_counter()
    drawn = sample_responses(model, [ids for ids in rendered for _ in range(args.samples)],
                             eos_ids=eos_ids_of(model, tokenizer), pad_id=pad_id_of(model, tokenizer),
                             max_new_tokens=max(args.lengths), generator=torch.Generator().manual_seed(args.seed))
    lengths = [len(s.response_ids) if s.ended else None for s in drawn]  # None: still going at the longest length
    print(json.dumps({"prompts": args.prompts, "model": args.model, "responses": len(drawn),
                      "prompt_tokens": [min(map(len, rendered)), max(map(len, rendered))],
                      "ended_within": {n: sum(x is not None and x <= n for x in lengths) / len(lengths)
                                       for n in args.lengths},
                      "seconds": round(time.perf_counter() - started, 1), "threads": args.threads,
                      "machine": platform.processor() or platform.machine(),
                      "date": time.strftime("%Y-%m-%d")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
