"""Wall time of the per-module masses (``stats.bounds.module_masses``: fp64 per parameter, fsum per
module) against the fp32 cascade sums the split halves and ``compare`` used before issue 29.

A synthetic Fisher shaped like a Llama-style model (per layer: q, k, v, o, gate, up, down, two norms)
of about ``--numel`` coordinates; the two methods take turns for ``--rounds`` rounds after one
warm-up each. Prints the median seconds of each and their ratio. The split halves call
``module_masses`` twice per calibration, ``compare`` twice per pair of runs.

    python bench/bench_module_masses.py                      # 500M coordinates, 5 rounds
    python bench/bench_module_masses.py --numel 2e9 --device cuda
    python bench/bench_module_masses.py --numel 1e6 --rounds 1   # a smoke test
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fisher_select.stats.bounds import module_masses
from fisher_select.stats.naming import module_of


def synthetic_fisher(numel: float, device: str) -> dict[str, torch.Tensor]:
    """Layers of width d (4 d x d attention, 3 d x 2.7d MLP, 2 norms) until about ``numel`` coordinates."""
    d = 1024
    per_layer = 4 * d * d + 3 * d * int(2.7 * d) + 2 * d
    layers = max(1, round(numel / per_layer))
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for i in range(layers):
        shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (d, d), "self_attn.v_proj": (d, d),
                  "self_attn.o_proj": (d, d), "mlp.gate_proj": (int(2.7 * d), d), "mlp.up_proj": (int(2.7 * d), d),
                  "mlp.down_proj": (d, int(2.7 * d)), "input_layernorm": (d,), "post_attention_layernorm": (d,)}
        for name, shape in shapes.items():
            out[f"model.layers.{i}.{name}.weight"] = torch.rand(shape, generator=gen, device=device) ** 4
    return out


def fp32_cascade(fisher: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """What the split halves and compare summed before: fp32 sums per parameter, added per module."""
    sums: dict[str, list[float]] = {}
    for name, t in fisher.items():
        entry = sums.setdefault(module_of(name), [0.0, 0.0])
        entry[0] += float(t.float().sum())
        entry[1] += float(t.float().clamp_min(0).sqrt().sum())
    return {m: (a, b) for m, (a, b) in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=5e8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    fisher = synthetic_fisher(args.numel, args.device)
    methods = {"module_masses (fp64)": module_masses, "fp32 cascade (before)": fp32_cascade}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for name, method in methods.items():
        method(fisher)  # warm-up
    for _ in range(args.rounds):
        for name, method in methods.items():
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            method(fisher)  # each ends in float(): the device is synchronised
            times[name].append(time.perf_counter() - start)
    numel = sum(t.numel() for t in fisher.values())
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, median in medians.items():
        print(f"{name:<24} {median:8.3f} s median over {args.rounds} rounds ({numel:,} coordinates, {args.device})")
    first, second = medians.values()
    print(f"ratio {first / second:.2f}")


if __name__ == "__main__":
    main()
