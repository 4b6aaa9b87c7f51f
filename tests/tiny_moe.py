"""Tiny MoE causal LMs of the four transformers 5 MoE families, built from config objects.

Experts run the eager implementation (transformers' default ``grouped_mm`` has no float64 kernel);
the rules read the layout from the instance, so the implementation does not change what they do.
"""

from __future__ import annotations

import torch
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

_COMMON = dict(vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, eos_token_id=1,
               bos_token_id=None, pad_token_id=1, tie_word_embeddings=False)


def _build(family: str, experts: int, top_k: int, layers: int, hidden: int, inner: int):
    common = dict(_COMMON, hidden_size=hidden, num_hidden_layers=layers, num_experts_per_tok=top_k)
    if family == "mixtral":  # gate and up as concatenated halves, softmax then top-k, renormalised
        return MixtralForCausalLM(MixtralConfig(intermediate_size=inner, num_local_experts=experts, **common))
    if family == "qwen3_moe":  # same layout, q/k norms, optional renormalisation
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=2 * inner, moe_intermediate_size=inner,
                                                  num_experts=experts, norm_topk_prob=True,
                                                  head_dim=hidden // 2, **common))
    if family == "olmoe":  # same layout, no renormalisation
        return OlmoeForCausalLM(OlmoeConfig(intermediate_size=inner, num_experts=experts, norm_topk_prob=False,
                                            **common))
    if family == "gpt_oss":  # interleaved gate/up, transposed, biases, clamped swiglu; top-k then softmax
        kinds = ["sliding_attention", "full_attention"] * layers
        return GptOssForCausalLM(GptOssConfig(intermediate_size=inner, num_local_experts=experts, head_dim=hidden // 2,
                                              layer_types=kinds[:layers], sliding_window=4, swiglu_limit=1.5,
                                              **common))
    raise ValueError(family)


FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss")


def tiny_moe(family: str, experts: int = 4, top_k: int = 2, layers: int = 2, hidden: int = 32, inner: int = 16,
             seed: int = 0, std: float = 0.3, dtype: torch.dtype = torch.float64):
    """An eval-mode tiny MoE with every weight matrix and expert tensor drawn N(0, std^2).

    ``std`` is large enough that routing varies between tokens and gpt-oss's clamp is active.
    """
    torch.manual_seed(seed)
    model = _build(family, experts, top_k, layers, hidden, inner).to(dtype)
    model.config._experts_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()
