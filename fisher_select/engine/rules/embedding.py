"""nn.Embedding: per sample, scatter-add the output-gradient rows at the sample's token ids.

Per-sample gradients are sparse (a sample touches only its own tokens' rows), so they are
returned as ``RowSparse`` entries (sample, row, value) with unique (sample, row) pairs.
Gemma's scaled token embeddings (rows times a constant) have a rule of their own: the plain rule
would miss the constant (the registry never gives a subclass that overrides ``forward`` its
parent's rule).
"""

from __future__ import annotations

import torch
from torch import nn

from fisher_select.engine.rules.base import Rule, RowSparse
from fisher_select.engine.rules.registry import Lazy, register


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


# Gemma's token embeddings: ``nn.Embedding`` rows times sqrt(hidden) (a 0-d buffer ``embed_scale``).
_SCALED = ("gemma", "gemma2", "gemma3")


@register(*(Lazy(f"transformers.models.{m}.modeling_{m}", f"{m.capitalize()}TextScaledWordEmbedding")
            for m in _SCALED))
class ScaledEmbeddingRule(EmbeddingRule):
    """``Y = embedding(ids) * c`` with one constant c: sample n's row gradients are c times the plain
    rule's (``dY`` scattered at its tokens), c cast to the weight's dtype as the forward casts it."""

    @staticmethod
    def accepts(module) -> bool:
        scale = getattr(module, "embed_scale", None)
        return EmbeddingRule.accepts(module) and torch.is_tensor(scale) and scale.numel() == 1

    def contributions(self, module, captured, grad_output, block, dtype):
        scale = module.embed_scale.to(module.weight.dtype).to(dtype)  # () as the forward multiplies
        for c in super().contributions(module, captured, grad_output, block, dtype):
            yield RowSparse(c.param, c.sample, c.row, c.value * scale)
