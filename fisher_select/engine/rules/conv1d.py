"""transformers' Conv1D (GPT-2): ``Y = X W + b`` with W of shape (in, out).

Registered lazily: transformers is imported only for models whose layers come from it.
"""

from __future__ import annotations

import torch

from fisher_select.engine.rules.base import Contribution, Rule, as_3d, blocks
from fisher_select.engine.rules.registry import Lazy, register


@register(Lazy("transformers.pytorch_utils", "Conv1D"))
class Conv1DRule(Rule):
    linear_like = True  # a Linear with its weight stored transposed (PEFT's fan_in_fan_out)

    def contributions(self, module, captured, grad_output, block, dtype):
        x_t = as_3d(captured, dtype).transpose(1, 2)  # (B, in, T)
        dy = as_3d(grad_output, dtype)  # (B, T, out)
        rows_total, row_size = module.weight.shape  # (in, out)
        for samples, rows in blocks(x_t.shape[0], rows_total, row_size, block):
            x_part = x_t[samples] if rows is None else x_t[samples, rows]  # (b, in', T)
            # (b, in', T) @ (b, T, out) -> (b, in', out), the layout of Conv1D.weight
            yield Contribution("weight", samples.start, torch.bmm(x_part, dy[samples]), rows)
        if module.bias is not None:
            yield Contribution("bias", 0, dy.sum(1))  # (B, out)
