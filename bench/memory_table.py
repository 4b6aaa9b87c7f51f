"""What fits on one GPU: bytes per parameter of each memory mode, for 7B / 13B / 70B Llama configs.

Memory of a calibration on one device = weights + the fp32 accumulators the memory mode keeps
+ activations of one scoring batch. The accumulators are parameter-sized (4 bytes per
parameter coordinate each, fp32 whatever the weights' dtype):

    full      squares F + O signal sums g + score sums       4 * (2 + O)
    gradient  squares F + O signal sums g                     4 * (1 + O)
    fisher    squares F                                       4
    (+ 4 for the split-half stability check, calibrate(stability=True), its default)

``accumulate_on=cpu`` moves them all to host memory (the device then holds weights and
activations). Parameter counts come from transformers' ``LlamaConfig`` models built on the
meta device (no download, no memory). Activations are an estimate (formula in
``activation_bytes``); the accumulator bytes of each mode are also measured on the embedded
default with ``ScoreSums.nbytes()`` of real accumulators. Prints a Markdown table.

    python bench/memory_table.py                    # O = 1 objective, batch 8 x 512 tokens
    python bench/memory_table.py --objectives 3 --batch 16 --tokens 2048 --no-measure
"""

from __future__ import annotations

import argparse

import torch

GB = 1e9  # decimal GB, as GPU memory is sold (an "80 GB" H100 reports 81,559 MiB = 85.5e9 bytes)
GPUS = {"80 GB": 80 * GB, "141 GB": 141 * GB}
# Llama-2 shapes (vocabulary 32,000): hidden, intermediate, layers, heads, kv heads
LLAMAS = {"7B": (4096, 11008, 32, 32, 32), "13B": (5120, 13824, 40, 40, 40), "70B": (8192, 28672, 80, 64, 8)}
WEIGHT_BYTES = 2  # bf16 weights
MODES = ("full", "gradient", "fisher")


def accumulator_bytes(mode: str, objectives: int, stability: bool) -> int:
    """fp32 bytes per parameter coordinate of one memory mode (see the module docstring)."""
    per = {"full": 4 * (2 + objectives), "gradient": 4 * (1 + objectives), "fisher": 4}[mode]
    return per + (4 if stability else 0)


def llama_config(name: str):
    from transformers import LlamaConfig

    h, i, layers, heads, kv = LLAMAS[name]
    return LlamaConfig(vocab_size=32000, hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=False)


def parameter_count(config) -> int:
    """Parameters of the model the config builds, on the meta device (shapes only, no memory)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def activation_bytes(config, batch: int, tokens: int) -> int:
    """Estimate of what one forward+backward of a batch keeps for backward (bf16 activations).

    Per token and layer, HF Llama saves about: the two norms' inputs and outputs (4 h), the
    attention inputs q, k, v, its output and o_proj's input (3 h + 2 kv-width), the MLP's gate,
    up, SiLU(gate) and down_proj's input (4 i): (7 h + 2 kv + 4 i) bf16 values. The head keeps
    bf16 logits plus the fp32 logits and log-softmax (10 bytes per vocabulary entry and token).
    The engine reuses the inputs autograd keeps; its per-sample pieces are 2 MiB blocks.
    """
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = h // config.num_attention_heads * config.num_key_value_heads
    per_token = layers * (7 * h + 2 * kv + 4 * i) * 2 + 10 * config.vocab_size
    return batch * tokens * per_token


def measured_accumulators(objectives: int) -> dict[str, dict]:
    """Real accumulators of each mode on the embedded default: ``ScoreSums.nbytes()``."""
    from fisher_select.engine.memory import MemoryMode
    from fisher_select.engine.scoring import plan_coverage
    from fisher_select.models import load_model

    model, _, _ = load_model("smollm2-135m-instruct", device="cpu")
    cov = plan_coverage(model)
    coords = sum(torch.Size(s).numel() for s in cov.shapes.values())
    out = {}
    for mode in MODES:
        sums = MemoryMode(mode).zeros(cov, objectives)
        out[mode] = {"bytes": sums.nbytes(), "per_parameter": sums.nbytes() / coords, "coordinates": coords}
        del sums
    return out


def fits(total: float) -> str:
    return " / ".join("yes" if total <= cap else "no" for cap in GPUS.values())


def table(objectives: int, batch: int, tokens: int, stability: bool) -> list[str]:
    head = (f"| model | params | weights (bf16) | activations ({batch} x {tokens}, est.) | mode | "
            f"accumulators (B/param) | on the GPU | fits {' / '.join(GPUS)} |")
    lines = [head, "|" + "---|" * 8]
    for name in LLAMAS:
        config = llama_config(name)
        n = parameter_count(config)
        weights, act = n * WEIGHT_BYTES, activation_bytes(config, batch, tokens)
        rows = [(m, accumulator_bytes(m, objectives, stability), False) for m in MODES]
        rows.append(("fisher, accumulate_on=cpu", accumulator_bytes("fisher", objectives, stability), True))
        for mode, per, on_cpu in rows:
            device = weights + act + (0 if on_cpu else n * per)
            where = f"{per} (host: {n * per / GB:.0f} GB)" if on_cpu else f"{per} ({n * per / GB:.0f} GB)"
            lines.append(f"| {name} | {n / 1e9:.2f} B | {weights / GB:.1f} GB | {act / GB:.1f} GB | {mode} | "
                         f"{where} | {device / GB:.0f} GB | {fits(device)} |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objectives", type=int, default=1, help="objectives O (one signal sum each)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512, help="prompt + response tokens per row")
    ap.add_argument("--no-stability", action="store_true", help="calibrate(stability=False): 4 B/param less")
    ap.add_argument("--no-measure", action="store_true", help="skip the embedded default's measured bytes")
    args = ap.parse_args(argv)
    stability = not args.no_stability
    print(f"Bytes per parameter: weights bf16 {WEIGHT_BYTES}; fp32 accumulators with O = {args.objectives} "
          f"objective(s){' and the stability half (+4)' if stability else ''}: "
          + ", ".join(f"{m} {accumulator_bytes(m, args.objectives, stability)}" for m in MODES) + ".\n")
    print("\n".join(table(args.objectives, args.batch, args.tokens, stability)))
    print("\nGPU sizes as sold (decimal GB); real cards hold a few % more, minus ~1 GB of CUDA context.")
    if not args.no_measure:
        print(f"\nMeasured on the embedded default (SmolLM2-135M-Instruct), ScoreSums.nbytes(), O = {args.objectives}, "
              "without the stability half:\n")
        print("| mode | accumulator bytes | bytes per parameter coordinate |\n|---|---|---|")
        for mode, m in measured_accumulators(args.objectives).items():
            print(f"| {mode} | {m['bytes'] / 1e6:.1f} MB | {m['per_parameter']:.2f} |")


if __name__ == "__main__":
    main()
