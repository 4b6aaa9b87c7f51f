"""The scoring pass on a small MoE beside the plain forward+backward, and with its experts on the fallback.

A random Mixtral (or Qwen3-MoE) built from its config: 8 experts, top-2, hidden 256, 4 layers
by default, fp32, on one device. Modes, run as ``bench_engine.py`` runs them (each warmed up,
then interleaved and rotated over ``--rounds``, medians):

- ``floor``: backward of the summed response log-probability into ``.grad`` (one training step);
- ``engine``: ``score_sums`` with squares, signal sums and score sums into running sums (the
  experts and routers by their rules, ``engine/rules/moe.py``);
- ``fallback``: the same pass with every expert tensor forced onto the exact fallback (one
  backward per sample), what the engine cost before the MoE rules.

The ``check`` column is the worst relative error of the fallback's expert squares against the
engine's after the warm-up step (the two paths must agree to fp32 rounding).

    python bench/bench_moe.py                                    # the table (8 x 128, CPU)
    python bench/bench_moe.py --json bench/results/moe-cpu.json --rounds 5
    python bench/bench_moe.py --rounds 1 --batch 2 --length 16 --hidden 32 --layers 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from bench_engine import Floor, first_line, make_batch
from fisher_select.engine.scoring import ScoreSums, plan_coverage, score_sums


def build_moe(args) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=1,
                  num_experts_per_tok=args.top_k, tie_word_embeddings=False, bos_token_id=None, eos_token_id=2,
                  pad_token_id=2)
    torch.manual_seed(0)
    if args.family == "qwen3_moe":
        config = Qwen3MoeConfig(intermediate_size=2 * args.hidden, moe_intermediate_size=2 * args.hidden,
                                num_experts=args.experts, head_dim=min(64, args.hidden), **common)
        model = Qwen3MoeForCausalLM(config)
    else:
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=2 * args.hidden, num_local_experts=args.experts,
                                                 **common))
    if args.experts_implementation:
        model.config._experts_implementation = args.experts_implementation
    return model.to(args.device).eval()


class Engine:
    """The scoring pass into running sums, as ``calibrate`` runs it; ``fallback``: experts on the fallback."""

    def __init__(self, model, batch, fallback: bool):
        self.model, self.batch = model, batch
        cov = plan_coverage(model)
        if fallback:  # what a model without the MoE rules gets: one backward per sample for the experts
            moved = {n for n in cov.users if ".experts." in n}
            cov = replace(cov, users={n: u for n, u in cov.users.items() if n not in moved},
                          fallback={**cov.fallback, **{n: cov.params[n] for n in moved}})
        self.cov = cov
        self.sums = ScoreSums.zeros(cov, None, device=None)
        self.sums.signal = {n: torch.zeros_like(t) for n, t in self.sums.squares.items()}

    def step(self):
        b = self.batch
        score_sums(self.model, b.ids, b.mask, b.resp, b.signal, coverage=self.cov, into=self.sums)

    def squares(self):
        return {n: t for n, t in self.sums.squares.items() if ".experts." in n}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / (b.norm() + 1e-30))


def run(args) -> dict:
    model = build_moe(args)
    batch = make_batch(args.vocab, args.batch, args.length, args.response, args.device)
    modes = {"floor": Floor(model, batch, args), "engine": Engine(model, batch, False),
             "fallback": Engine(model, batch, True)}
    rows = {name: {"times": [], "error": None, "check": None} for name in modes}
    for name, mode in modes.items():  # warm-up: running sums exist, allocator has seen the sizes
        try:
            mode.step()
        except Exception as exc:  # reported in the table, never fatal
            rows[name]["error"] = first_line(exc)
    reference = modes["engine"].squares() if rows["engine"]["error"] is None else None
    if reference is not None and rows["fallback"]["error"] is None:  # engine's own squares are the reference
        got = modes["fallback"].squares()
        rows["fallback"]["check"] = max(_rel(got[n], reference[n]) for n in reference)
    names = [n for n in modes if rows[n]["error"] is None]
    for r in range(args.rounds):  # rotated, so no mode always follows the same one
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            modes[name].step()
            rows[name]["times"].append(time.perf_counter() - start)
    for row in rows.values():
        row["median_s"] = statistics.median(row["times"]) if row["times"] else None
    floor = rows["floor"]["median_s"]
    for row in rows.values():
        row["x_floor"] = None if floor is None or row["median_s"] is None else row["median_s"] / floor
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    return {"config": vars(args), "expert_share": experts / total, "parameters": total, "modes": rows}


def table(result: dict) -> str:
    c = result["config"]
    lines = [f"MoE {c['family']}: {c['experts']} experts, top-{c['top_k']}, hidden {c['hidden']}, "
             f"{c['layers']} layers, "
             f"{result['parameters']} parameters ({result['expert_share']:.0%} in experts); batch {c['batch']} x "
             f"{c['length']} ({c['response']} response tokens), {c['device']}, {c['rounds']} rounds, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads",
             f"{'mode':<10}{'median s':>10}{'x floor':>9}{'check':>10}"]
    for name, row in result["modes"].items():
        if row["error"]:
            lines.append(f"{name:<10}  failed: {row['error']}")
            continue
        check = "" if row["check"] is None else f"{row['check']:.1e}"
        lines.append(f"{name:<10}{row['median_s']:>10.4f}{row['x_floor']:>9.2f}{check:>10}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=("mixtral", "qwen3_moe"), default="mixtral")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--response", type=int, default=None, help="response tokens per row (default: half the length)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--experts-implementation", default=None,
                   help="transformers' experts forward (eager, batched_mm, grouped_mm; default: the model's)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    args.response = args.response or args.length // 2
    result = run(args)
    text = table(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        with open(args.json.rsplit(".", 1)[0] + ".txt", "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
