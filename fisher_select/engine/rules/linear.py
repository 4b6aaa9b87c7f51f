"""nn.Linear: ``Y = X W^T + b``; per sample ``dW_n = dY_n^T X_n``, ``db_n = sum_t dY_n,t``."""

from __future__ import annotations

import torch
from torch import nn

from fisher_select.engine.rules.base import Contribution, Rule, Summed, as_3d, blocks
from fisher_select.engine.rules.registry import register


def linear_contributions(x, grad_output, out_features: int, in_features: int, has_bias: bool, block: int,
                         dtype: torch.dtype):
    """Shared by nn.Linear and the bitsandbytes layers (same math, dequantized weight shape)."""
    x3 = as_3d(x, dtype)  # (B, T, in)
    dy_t = as_3d(grad_output, dtype).transpose(1, 2)  # (B, out, T)
    for samples, rows in blocks(x3.shape[0], out_features, in_features, block):
        dy_part = dy_t[samples] if rows is None else dy_t[samples, rows]  # (b, out', T)
        # (b, out', T) @ (b, T, in) -> (b, out', in): a cache-sized piece of one layer's per-sample block.
        yield Contribution("weight", samples.start, torch.bmm(dy_part, x3[samples]), rows)
    if has_bias:
        yield Contribution("bias", 0, dy_t.sum(2))  # (B, out)


def linear_weighted_sum(x, grad_output, has_bias: bool, weights: torch.Tensor, dtype: torch.dtype):
    """``sum_n w_n dW_n = (w * dY)^T X`` over all samples and positions: one GEMM, no per-sample blocks."""
    x2 = as_3d(x, dtype).flatten(0, 1)  # (B*T, in)
    dy = as_3d(grad_output, dtype) * weights.to(dtype)[:, None, None]  # (B, T, out)
    dy2 = dy.flatten(0, 1)  # (B*T, out)
    yield Summed("weight", dy2.T @ x2)  # (out, in)
    if has_bias:
        yield Summed("bias", dy2.sum(0))  # (out,)


@register(nn.Linear)
class LinearRule(Rule):
    linear_like = True

    def contributions(self, module, captured, grad_output, block, dtype):
        yield from linear_contributions(
            captured, grad_output, module.out_features, module.in_features, module.bias is not None, block, dtype
        )

    def weighted_sum(self, module, captured, grad_output, weights, dtype):
        return linear_weighted_sum(captured, grad_output, module.bias is not None, weights, dtype)
