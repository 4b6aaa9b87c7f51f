"""Memory and step time of full AdamW fine-tuning, dense masked (``apply_masks``) and sparse-delta fine-tuning.

One process, one model: every mode starts from the same weights (copied back in), the modes take
turns (``--rounds`` rounds, each mode once per round), and each turn runs one untimed warm-up step
then ``--steps`` timed steps of AdamW on a random batch. Masks are random at each density (what
memory and time depend on is the count, not which coordinates). Measured per mode:

- ``optimizer_state``: bytes of every tensor in ``optimizer.state`` after the steps;
- ``gradients``: bytes of every ``.grad`` after ``backward()``, before ``optimizer.step()``;
- ``mode_extra``: what the mode itself keeps: the dense handle's saved masked values and its masks,
  the sparse handle's fp32 values, indices and base copy;
- ``peak_rss``: the process's resident memory, sampled every millisecond by a thread during the
  timed steps (CPU: the only peak there is; it includes the weights, the copy of the starting
  weights this script keeps, activations and allocator slack, so compare modes, not absolutes);
- ``cuda_peak``: ``torch.cuda.max_memory_allocated`` over the timed steps (reset per mode), with CUDA;
- ``step_s``: median wall time of a step (forward, backward, clipping, optimizer step).

``--bytes-table`` prints the arithmetic instead: bytes per parameter by mode and what fits one
80 GB GPU for 7B / 13B / 70B with bf16 weights (activations excluded).

    python bench/bench_sparse.py                           # the embedded default, densities 0.01 0.1
    python bench/bench_sparse.py --steps 5 --rounds 3 --json bench/results/sparse.json
    python bench/bench_sparse.py --bytes-table
    python bench/bench_sparse.py --tiny --steps 2 --rounds 1   # a smoke test on a random tiny Llama
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

GB = 1e9
SIZES = {"7B": 6.74e9, "13B": 13.0e9, "70B": 69.0e9}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def state_bytes(optimizer) -> int:
    return tensor_bytes(t for state in optimizer.state.values() for t in state.values())


class PeakRSS:
    """Highest resident set size seen by a 1 ms sampling thread while the context is open."""

    def __enter__(self):
        import psutil

        self.process, self.peak, self.running = psutil.Process(), 0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


def random_masks(model, density: float, seed: int) -> dict[str, torch.Tensor]:
    """Drawn on each parameter's device (an 8B model's masks drawn on the CPU would take minutes)."""
    gens = {}
    out = {}
    for n, p in model.named_parameters():
        gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        out[n] = torch.rand(p.shape, generator=gen, device=p.device) < density
    return out


def setup_mode(model, mode: str, density: float | None, seed: int):
    """(trainable parameters, the handle or None, bytes the mode keeps besides state and gradients)."""
    from fisher_select.training.enforce import apply_masks

    if mode == "full":
        return [p for p in model.parameters() if p.requires_grad], None, 0
    masks = random_masks(model, density, seed)
    if mode == "dense":
        handle = apply_masks(model, masks)
        extra = tensor_bytes(t for part in handle._partials for t in (part.keep, part.saved))
        return [p for p in model.parameters() if p.requires_grad], handle, extra
    handle = apply_masks(model, masks, sparse=True)
    extra = tensor_bytes(t for e in handle.entries for t in (e.values, e.indices, e.base))
    return handle.parameters(), handle, extra


def one_step(model, params, optimizer, ids, measure: dict | None = None) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    if measure is not None:
        measure["gradients"] = tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_mode(model, start, mode, density, args, ids) -> dict:
    """One mode's warm-up and timed steps; out of memory is a result (``error``), not a crash."""
    with torch.no_grad():
        for p, s in zip(model.parameters(), start):
            p.copy_(s)
    params, handle, extra = setup_mode(model, mode, density, args.seed)
    try:
        return _timed_mode(model, params, mode, density, args, ids, extra)
    except torch.OutOfMemoryError as exc:
        return {"mode": mode, "density": density, "error": "out of memory: " + str(exc).splitlines()[0][:160]}
    finally:
        model.zero_grad(set_to_none=True)
        if handle is not None:
            handle.remove()
        if ids.device.type == "cuda":
            torch.cuda.empty_cache()


def _timed_mode(model, params, mode, density, args, ids, extra) -> dict:
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01)
    one_step(model, params, optimizer, ids)  # warm-up: state allocated, kernels chosen
    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    measure, times = {}, []
    with PeakRSS() as rss:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            one_step(model, params, optimizer, ids, measure)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    out = {"mode": mode, "density": density, "optimizer_state": state_bytes(optimizer),
           "gradients": measure["gradients"], "mode_extra": extra, "peak_rss": rss.peak,
           "cuda_peak": torch.cuda.max_memory_allocated() if cuda else None, "step_s": statistics.median(times)}
    del optimizer
    return out


def load(args):
    if args.shape:  # a random model of a real shape, built on the device in bf16 (bench/shapes.py)
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from shapes import build

        model = build(args.shape, args.device, getattr(torch, args.dtype))
        return model, model.config.vocab_size
    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        return LlamaForCausalLM(config).to(args.device), 512
    from fisher_select.models import load_model

    model = load_model(args.model, device=args.device)[0]
    return model, model.config.vocab_size


def measure(args) -> list[dict]:
    model, vocab = load(args)
    model.train()
    start = [p.detach().clone() for p in model.parameters()]
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(args.seed))
    ids = ids.to(args.device)
    modes = [(m, None if m == "full" else d) for d in args.densities for m in args.modes
             if m != "full" or d == args.densities[0]]  # full once
    rows = {key: [] for key in modes}
    for _ in range(args.rounds):  # interleaved: drift of the machine hits every mode alike
        for mode, density in modes:
            rows[(mode, density)].append(run_mode(model, start, mode, density, args, ids))
    return [summarize(runs) for runs in rows.values()]


def summarize(runs: list[dict]) -> dict:
    out = dict(runs[-1])
    if any("error" in r for r in runs):
        return next(r for r in runs if "error" in r)
    out["step_s"] = statistics.median(r["step_s"] for r in runs)
    out["peak_rss"] = max(r["peak_rss"] for r in runs)
    return out


def print_measured(rows: list[dict]) -> None:
    full = next((r for r in rows if r["mode"] == "full" and "error" not in r), None)
    full_train = full["optimizer_state"] + full["gradients"] if full else None
    print("| mode | density | optimizer state | gradients | mode keeps | state+grads+kept vs full | peak RSS | "
          "CUDA peak | step time | vs full |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | {r['density'] or 1:g} | {r['error']} |" + " |" * 7)
            continue
        kept = r["optimizer_state"] + r["gradients"] + r["mode_extra"]
        vs_full = f"{kept / full_train:.2%}" if full else "-"
        step_vs = f"{r['step_s'] / full['step_s']:.2f}x" if full else "-"
        cuda = f"{r['cuda_peak'] / GB:.3f} GB" if r["cuda_peak"] is not None else "-"
        print(f"| {r['mode']} | {r['density'] or 1:g} | {r['optimizer_state'] / GB:.4f} GB | {r['gradients'] / GB:.4f} GB | "
              f"{r['mode_extra'] / GB:.4f} GB | {vs_full} | {r['peak_rss'] / GB:.3f} GB | {cuda} | "
              f"{r['step_s'] * 1e3:.1f} ms | {step_vs} |")


def bytes_per_parameter(mode: str, density: float) -> float:
    """Training bytes per parameter with bf16 weights, activations excluded (see print_bytes_table)."""
    if mode == "full":
        return 2 + 4 + 4 + 8  # bf16 weights, fp32 master weights, fp32 gradients, AdamW m and v (fp32)
    if mode == "dense":
        return 2 + 4 + 4 + 8 + (1 - density) * 2 + 1  # + the handle's copy of the masked values and a bool mask
    return 2 + density * (4 + 4 + 4 + 8 + 2)  # bf16 weights + per selected: values, index, grad, m, v, base copy


def print_bytes_table(densities: list[float]) -> None:
    modes = [("full", 1.0)] + [(m, d) for d in densities for m in ("dense", "sparse")]
    print("Bytes per parameter with bf16 weights (activations, and the sparse mode's one transient dense gradient "
          "of the largest layer, excluded):\n")
    print("| mode | density | bytes / parameter | " + " | ".join(f"{k} (GB)" for k in SIZES) + " | fits 80 GB |")
    print("|---|---|---|" + "---|" * len(SIZES) + "---|")
    for mode, d in modes:
        b = bytes_per_parameter(mode, d)
        fits = [k for k, n in SIZES.items() if b * n <= 80 * GB]
        print(f"| {mode} | {d:g} | {b:.2f} | " + " | ".join(f"{b * n / GB:.0f}" for n in SIZES.values())
              + f" | {', '.join(fits) or 'none'} |")
    print("\nfull: bf16 weights 2 + fp32 master 4 + fp32 gradient 4 + AdamW m, v 8. dense (apply_masks): full + "
          "the masked values' copy 2(1-d) + a bool mask 1. sparse: bf16 weights 2 + d x (fp32 value 4 + int32 "
          "index 4 + fp32 gradient 4 + m, v 8 + bf16 base copy 2).")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a --model spec (default: the embedded default)")
    p.add_argument("--tiny", action="store_true", help="a random tiny Llama instead (smoke test)")
    p.add_argument("--shape", help="a random model of a real shape instead (bench/shapes.py: llama3-8b, ...)")
    p.add_argument("--dtype", default="bfloat16", help="with --shape: the weights' dtype")
    p.add_argument("--modes", nargs="+", default=["full", "dense", "sparse"], choices=["full", "dense", "sparse"],
                   help="in this order (full once, at the first density)")
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.1])
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the modes (interleaved)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", metavar="FILE", help="also write the measurements as JSON")
    p.add_argument("--bytes-table", action="store_true", help="print the bytes-per-parameter arithmetic and exit")
    args = p.parse_args(argv)
    if args.bytes_table:
        print_bytes_table(args.densities)
        return
    rows = measure(args)
    print_measured(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
