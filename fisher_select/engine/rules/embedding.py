"""nn.Embedding: per sample, scatter-add the output-gradient rows at the sample's token ids.

Per-sample gradients are sparse (a sample touches only its own tokens' rows), so they are
returned as ``RowSparse`` entries (sample, row, value) with unique (sample, row) pairs.
"""

from __future__ import annotations

import torch
from torch import nn

from fisher_select.engine.rules.base import Rule, RowSparse
from fisher_select.engine.rules.registry import register


@register(nn.Embedding)
class EmbeddingRule(Rule):
    sparse = True

    @staticmethod
    def accepts(module) -> bool:
        # max_norm renormalises the weight in place and scale_grad_by_freq rescales by batch
        # counts: both change the gradient, so such embeddings go to the exact fallback.
        return module.max_norm is None and not module.scale_grad_by_freq

    def _keys(self, module, ids: torch.Tensor):
        """Unique sample*V+row keys and, per position, which key it adds to."""
        ids = ids.reshape(ids.shape[0], -1)  # (B, T)
        batch, length = ids.shape
        sample = torch.arange(batch, device=ids.device).unsqueeze(1).expand(batch, length)
        keys = sample * module.num_embeddings + ids  # (B, T)
        valid = torch.ones_like(ids, dtype=torch.bool)
        if module.padding_idx is not None:
            valid = ids != module.padding_idx  # autograd gives the padding row no gradient
        unique, inverse = torch.unique(keys[valid], return_inverse=True)
        return unique, inverse, valid

    def support(self, module, captured):
        unique, _, _ = self._keys(module, captured)
        return unique // module.num_embeddings, unique % module.num_embeddings

    def contributions(self, module, captured, grad_output, block, dtype):
        unique, inverse, valid = self._keys(module, captured)
        dy = grad_output.reshape(*valid.shape, -1).to(dtype)[valid]  # (P, d) valid positions
        value = torch.zeros(unique.numel(), dy.shape[-1], dtype=dtype, device=dy.device)
        value.index_add_(0, inverse, dy)  # (M, d): per-sample row sums
        v = module.num_embeddings
        yield RowSparse("weight", unique // v, unique % v, value)
