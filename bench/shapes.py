"""Randomly initialized models of real shapes, for timings: speed and memory do not depend on the weights.

Each shape is a real model's published config (layer widths, heads, vocabulary), optionally with fewer
layers so that it fits; ``tiny-*`` are the same architectures at toy widths, for ``--cpu-smoke`` runs.
Models are built directly on the target device in the target dtype (an 8B model initialized on the
CPU first would take minutes).

    python -c "import bench.shapes as s; print(s.parameter_count('llama3-8b'))"
"""

from __future__ import annotations

import torch

# The embedded default's config (SmolLM2-135M-Instruct, from the converted GGUF's config.json).
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
               max_position_embeddings=8192, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
               bos_token_id=1, eos_token_id=2, pad_token_id=2)
# Meta-Llama-3-8B's config.json.
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                 max_position_embeddings=8192, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
                 bos_token_id=128000, eos_token_id=128001)
# Qwen3-30B-A3B's config.json with 8 of its 48 layers (5.6 B parameters: its accumulators fit one GPU).
QWEN3_MOE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                 num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
                 max_position_embeddings=40960, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
                 bos_token_id=151643, eos_token_id=151645)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
            pad_token_id=2)

SHAPES = {  # name: (architecture, config keywords)
    "smollm2-135m": ("llama", SMOLLM2),
    "llama3-8b": ("llama", LLAMA3_8B),
    "qwen3-moe": ("qwen3_moe", QWEN3_MOE),
    "tiny-smollm2": ("llama", {**SMOLLM2, **TINY, "tie_word_embeddings": True}),
    "tiny-llama": ("llama", {**LLAMA3_8B, **TINY}),
    "tiny-moe": ("qwen3_moe", {**QWEN3_MOE, **TINY, "moe_intermediate_size": 32, "num_experts": 4,
                               "num_experts_per_tok": 2}),
}


def config_of(name: str):
    """The transformers config of a named shape."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; pass one of {', '.join(SHAPES)}")
    arch, keywords = SHAPES[name]
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**keywords)
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**keywords)


def build(name: str, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A randomly initialized model of the named shape, created on ``device`` in ``dtype``, in eval mode."""
    from transformers import AutoModelForCausalLM

    config = config_of(name)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in dtype: no fp32 copy of an 8B model
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def parameter_count(name: str) -> int:
    """Parameters of the named shape, counted on the meta device (no memory)."""
    return sum(p.numel() for p in build(name, "meta", torch.bfloat16).parameters())
