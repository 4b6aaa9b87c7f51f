"""Where the scoring pass's overhead lives: one linear layer at a time, the engine's own code.

For each linear layer shape of a model (default: the embedded SmolLM2-135M-Instruct's), on the
same captured input X (B, T, in) and output gradient dY (B, T, out), in one process, interleaved,
after warm-up, accumulating into running sums (medians over rounds):

- ``floor``: what a plain backward spends on this layer: the input-gradient GEMM ``dY W`` and the
  weight-gradient GEMM ``dY^T X`` over all B*T positions, added into a running ``.grad``;
- ``engine``: the input-gradient GEMM (autograd still runs it) plus the engine's per-sample
  weight pieces (``rules.linear.linear_contributions``) reduced into running squares, score sums
  and one signal sum by the engine's own ``_Sums.add_dense``;
- ``squares``: the same with squares only;
- ``pieces``: the per-sample GEMMs alone (``bmm`` over row blocks), no reduction: the part of the
  overhead a reordering of the reduction cannot remove.

Ratios are to ``floor`` plus the layer's forward GEMM, i.e. per layer what the whole-pass table
of ``bench_engine.py`` reports per model.

    python bench/bench_layers.py                     # embedded default's shapes, batch 8 x 128
    python bench/bench_layers.py --batch 16 --length 256 --json layers.json
    python bench/bench_layers.py --device cuda --batch 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from fisher_select.engine.rules.linear import linear_contributions
from fisher_select.engine.scoring import DEFAULT_BLOCK, ScoreSums, _Sums, plan_coverage

# (name, out_features, in_features, positions: "all" rows' tokens or only the response's)
SMOLLM2_135M = [("q_proj / o_proj", 576, 576, "all"), ("k_proj / v_proj", 192, 576, "all"),
                ("gate_proj / up_proj", 1536, 576, "all"), ("down_proj", 576, 1536, "all"),
                ("lm_head (response positions)", 49152, 576, "response")]


class Layer:
    """One layer's tensors and running sums, reused across rounds (as a calibration reuses them)."""

    def __init__(self, out: int, inp: int, batch: int, tokens: int, block: int, device: str):
        gen = torch.Generator().manual_seed(0)
        self.module = nn.Linear(inp, out, bias=False).to(device)
        self.x = torch.randn(batch, tokens, inp, generator=gen).to(device)  # (B, T, in)
        self.dy = torch.randn(batch, tokens, out, generator=gen).to(device)  # (B, T, out)
        self.grad = torch.zeros(out, inp, device=device)
        self.cov = plan_coverage(self.module)
        self.signal = torch.randn(1, batch, generator=gen).to(device)  # (O, B): one objective
        self.full = ScoreSums.zeros(self.cov, 1)
        self.sq_only = ScoreSums.zeros(self.cov, None, totals=False)
        self.batch, self.block = batch, block

    def forward(self):
        return self.x @ self.module.weight.detach().T  # (B, T, out)

    def input_grad(self):
        return self.dy @ self.module.weight.detach()  # (B, T, in)

    def floor(self):
        self.input_grad()
        self.grad.add_(self.dy.flatten(0, 1).T @ self.x.flatten(0, 1))  # (out, in)

    def _engine(self, into: ScoreSums, signal):
        self.input_grad()
        sums = _Sums(self.cov, signal, into, True, totals=into.total is not None, batch=self.batch)
        w = self.module.weight
        for c in linear_contributions(self.x, self.dy, w.shape[0], w.shape[1], False, self.block, torch.float32):
            sums.add_dense("weight", c.start, c.value, c.rows)

    def engine(self):
        self._engine(self.full, self.signal)

    def squares(self):
        self._engine(self.sq_only, None)

    def pieces(self):
        w = self.module.weight
        for _ in linear_contributions(self.x, self.dy, w.shape[0], w.shape[1], False, self.block, torch.float32):
            pass


MODES = ("floor", "engine", "squares", "pieces", "forward")


def measure(layer: Layer, rounds: int, warmup: int, device: str) -> dict[str, float]:
    calls = {m: getattr(layer, m) for m in MODES}
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warmup):
        for call in calls.values():
            call()
    times = {m: [] for m in MODES}
    for _ in range(rounds):
        for m, call in calls.items():  # interleaved: A B C A B C ...
            sync()
            start = time.perf_counter()
            call()
            sync()
            times[m].append(time.perf_counter() - start)
    return {m: statistics.median(v) for m, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=128, help="tokens per row")
    ap.add_argument("--response", type=int, default=64, help="response tokens (the output head's positions)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--block", type=int, default=DEFAULT_BLOCK)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    print(f"{args.device}, batch {args.batch} x {args.length} tokens ({args.response} response), "
          f"{torch.get_num_threads()} threads, "
          f"median of {args.rounds} interleaved rounds after {args.warmup} warm-up; times in ms")
    print("| layer (out x in) | forward | floor: dX + dW | engine: dX + squares + sums | squares alone "
          "| per-sample GEMMs alone | engine vs floor (fwd + bwd) | squares vs floor |")
    print("|---" * 8 + "|")
    rows = []
    for name, out, inp, where in SMOLLM2_135M:
        layer = Layer(out, inp, args.batch, args.length if where == "all" else args.response, args.block,
                      args.device)
        t = measure(layer, args.rounds, args.warmup, args.device)
        base = t["forward"] + t["floor"]
        ratio, sq = (t["forward"] + t["engine"]) / base, (t["forward"] + t["squares"]) / base
        rows.append({"layer": name, "out": out, "in": inp, **{m: t[m] for m in MODES},
                     "engine_vs_floor": ratio, "squares_vs_floor": sq})
        ms = {m: 1e3 * t[m] for m in MODES}
        print(f"| {name} ({out} x {inp}) | {ms['forward']:.1f} | {ms['floor']:.1f} | {ms['engine']:.1f} "
              f"| {ms['squares']:.1f} | {ms['pieces']:.1f} | {ratio:.2f}x | {sq:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "length": args.length, "response": args.response, "layers": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
