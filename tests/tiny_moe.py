"""Tiny mixture-of-experts causal LMs of the four transformers 5 families with fused experts, built from configs."""

from __future__ import annotations

import torch
from transformers import (GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM, OlmoeConfig,
                          OlmoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

EXPERTS = 4  # routed experts per layer
TOP_K = 2
_COMMON = dict(vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, num_experts_per_tok=TOP_K, tie_word_embeddings=False, eos_token_id=1,
               bos_token_id=None, pad_token_id=1)

MOE_FAMILIES = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(num_local_experts=EXPERTS, **_COMMON)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=EXPERTS, moe_intermediate_size=8,
                                                            head_dim=8, **_COMMON)),
    "olmoe": lambda: OlmoeForCausalLM(OlmoeConfig(num_experts=EXPERTS, **_COMMON)),
    "gpt_oss": lambda: GptOssForCausalLM(GptOssConfig(num_local_experts=EXPERTS, head_dim=8,
                                                      layer_types=["full_attention"] * 2, **_COMMON)),
}


def tiny_moe(family: str, seed: int = 0, noise: float = 0.1):
    """A tiny MoE model in eval mode, weights perturbed so no gradient is trivially zero; its experts run the
    eager per-expert loop (transformers' default grouped_mm refuses float64)."""
    torch.manual_seed(seed)
    model = MOE_FAMILIES[family]()
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return model.eval()
