"""nn.Linear: ``Y = X W^T + b``; per sample ``dW_n = dY_n^T X_n``, ``db_n = sum_t dY_n,t``."""

from __future__ import annotations

import torch

from fisher_select.engine.rules.base import Contribution, Rule, as_3d, blocks


def linear_contributions(x, grad_output, out_features: int, in_features: int, has_bias: bool, block: int):
    """Shared by nn.Linear and the bitsandbytes layers (same math, dequantized weight shape)."""
    x3 = as_3d(x)  # (B, T, in)
    dy_t = as_3d(grad_output).transpose(1, 2)  # (B, out, T)
    for samples, rows in blocks(x3.shape[0], out_features, in_features, block):
        dy_part = dy_t[samples] if rows is None else dy_t[samples, rows]  # (b, out', T)
        # (b, out', T) @ (b, T, in) -> (b, out', in): a cache-sized piece of one layer's per-sample block.
        yield Contribution("weight", samples.start, torch.bmm(dy_part, x3[samples]), rows)
    if has_bias:
        yield Contribution("bias", 0, dy_t.sum(2))  # (B, out)


class LinearRule(Rule):
    def contributions(self, module, captured, grad_output, block):
        yield from linear_contributions(
            captured, grad_output, module.out_features, module.in_features, module.bias is not None, block
        )
