"""What fits on one GPU: bytes per parameter of each memory mode, for 7B / 13B / 70B Llama configs.

Memory of a calibration on one device = weights + the fp32 accumulators the memory mode keeps
+ activations of one scoring batch. The accumulators are parameter-sized (4 bytes per
parameter coordinate each, fp32 whatever the weights' dtype):

    full      squares F + O signal sums g + score sums       4 * (2 + O)
    gradient  squares F + O signal sums g                     4 * (1 + O)
    fisher    squares F                                       4
    (+ 4 for the split-half stability check, calibrate(stability=True), its default)

``accumulate_on=cpu`` moves them all to host memory (the device then holds weights and
activations). ``--ranks N`` gives the memory of one rank of ``calibrate --shard fsdp`` over N
GPUs: FSDP2 keeps 1/N of the weights and of every accumulator on each rank, plus the layers it
has all-gathered at once (the current decoder layer and the prefetched next one, and the root's
embedding, norm and head) and the activations of the rows that rank scores in one pass. Parameter counts come from transformers' ``LlamaConfig`` models built on the
meta device (no download, no memory). Activations are an estimate (formula in
``activation_bytes``); the accumulator bytes of each mode are also measured on the embedded
default with ``ScoreSums.nbytes()`` of real accumulators. Prints a Markdown table.

    python bench/memory_table.py                    # O = 1 objective, batch 8 x 512 tokens
    python bench/memory_table.py --objectives 3 --batch 16 --tokens 2048 --no-measure
    python bench/memory_table.py --ranks 8 --no-measure   # per rank under --shard fsdp on 8 GPUs
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
    return parameter_counts(config)[0]


def parameter_counts(config) -> tuple[int, int, int]:
    """(all, one decoder layer, the root: embedding + final norm + head) on the meta device."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    return total, layer, total - config.num_hidden_layers * layer


def gathered_bytes(config) -> int:
    """bf16 weights FSDP2 holds unsharded at once on a rank: two decoder layers (the one running and
    the prefetched next) and the root (embedding, norm, head), which stays gathered after sampling."""
    _, layer, root = parameter_counts(config)
    return (2 * layer + root) * WEIGHT_BYTES


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


def table(objectives: int, batch: int, tokens: int, stability: bool, ranks: int = 1) -> list[str]:
    """One row per model and memory mode; with ``ranks`` > 1, one FSDP2 rank's share (no CPU mode:
    ``--shard fsdp`` refuses ``accumulate_on=cpu``, each rank already keeps only its rows)."""
    held = "weights (bf16)" if ranks == 1 else f"weights per rank (1/{ranks} + gathered layers)"
    head = (f"| model | params | {held} | activations ({batch} x {tokens}, est.) | mode | "
            f"accumulators (B/param{'' if ranks == 1 else f', 1/{ranks} per rank'}) | on the GPU | "
            f"fits {' / '.join(GPUS)} |")
    lines = [head, "|" + "---|" * 8]
    for name in LLAMAS:
        config = llama_config(name)
        n = parameter_count(config)
        weights, act = n * WEIGHT_BYTES, activation_bytes(config, batch, tokens)
        if ranks > 1:
            weights = weights / ranks + gathered_bytes(config)
        rows = [(m, accumulator_bytes(m, objectives, stability), False) for m in MODES]
        if ranks == 1:
            rows.append(("fisher, accumulate_on=cpu", accumulator_bytes("fisher", objectives, stability), True))
        for mode, per, on_cpu in rows:
            kept = n * per / ranks
            device = weights + act + (0 if on_cpu else kept)
            where = f"{per} (host: {n * per / GB:.0f} GB)" if on_cpu else f"{per} ({kept / GB:.0f} GB)"
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
    ap.add_argument("--ranks", type=int, default=1, help="one rank's share under calibrate --shard fsdp over N GPUs")
    args = ap.parse_args(argv)
    stability = not args.no_stability
    print(f"Bytes per parameter: weights bf16 {WEIGHT_BYTES}; fp32 accumulators with O = {args.objectives} "
          f"objective(s){' and the stability half (+4)' if stability else ''}: "
          + ", ".join(f"{m} {accumulator_bytes(m, args.objectives, stability)}" for m in MODES) + ".\n")
    print("\n".join(table(args.objectives, args.batch, args.tokens, stability, args.ranks)))
    print("\nGPU sizes as sold (decimal GB); real cards hold a few % more, minus ~1 GB of CUDA context.")
    if not args.no_measure:
        print(f"\nMeasured on the embedded default (SmolLM2-135M-Instruct), ScoreSums.nbytes(), O = {args.objectives}, "
              "without the stability half:\n")
        print("| mode | accumulator bytes | bytes per parameter coordinate |\n|---|---|---|")
        for mode, m in measured_accumulators(args.objectives).items():
            print(f"| {mode} | {m['bytes'] / 1e6:.1f} MB | {m['per_parameter']:.2f} |")


if __name__ == "__main__":
    main()
