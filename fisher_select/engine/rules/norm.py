"""Normalisation layers: per sample ``dw_n = sum_t dY_n,t * x_hat_n,t``, ``db_n = sum_t dY_n,t``.

``LayerNormRule`` and ``RMSNormRule`` recompute ``x_hat`` from the captured input for torch's
own classes. ``FunctionalNormRule`` covers model-specific classes (``LlamaRMSNorm``, Gemma's
``1 + w`` variant, ...) whatever their formula: it differentiates the module's own forward for
each sample with ``torch.func`` (a vector-Jacobian product with that sample's output gradient),
which is exact for any module that acts on each sample separately.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.modules.batchnorm import _BatchNorm

from fisher_select.engine.rules.base import Contribution, Rule
from fisher_select.engine.rules.registry import register, register_fallback


def _sum_positions(t: torch.Tensor, normalized_ndim: int) -> torch.Tensor:
    """(B, ..., *normalized) -> (B, *normalized): sum over every position axis."""
    dims = tuple(range(1, t.ndim - normalized_ndim))
    return t.sum(dim=dims) if dims else t


@register(nn.LayerNorm)
class LayerNormRule(Rule):
    def contributions(self, module, captured, grad_output, block, dtype):
        shape = module.normalized_shape
        x_hat = F.layer_norm(captured.to(dtype), shape, eps=module.eps)  # (B, ..., *shape)
        dy = grad_output.to(dtype)
        if module.weight is not None:
            yield Contribution("weight", 0, _sum_positions(dy * x_hat, len(shape)))
        if module.bias is not None:
            yield Contribution("bias", 0, _sum_positions(dy, len(shape)))


@register(nn.RMSNorm)
class RMSNormRule(Rule):
    def contributions(self, module, captured, grad_output, block, dtype):
        shape = module.normalized_shape
        x_hat = F.rms_norm(captured.to(dtype), shape, eps=module.eps)  # (B, ..., *shape)
        if module.weight is not None:
            yield Contribution("weight", 0, _sum_positions(grad_output.to(dtype) * x_hat, len(shape)))


def _named_norm(cls: type) -> bool:
    """Model-specific norms (LlamaRMSNorm, GroupNorm, ...) that derive from no registered class."""
    return cls.__name__.endswith("Norm")


@register_fallback(_named_norm)
class FunctionalNormRule(Rule):
    @staticmethod
    def accepts(module) -> bool:
        if isinstance(module, _BatchNorm):  # batch statistics couple samples: exact fallback instead
            return False
        names = {n for n, _ in module.named_parameters(recurse=False)}
        has_child_params = any(True for c in module.children() for _ in c.parameters())
        return bool(names) and names <= {"weight", "bias"} and not has_child_params

    def contributions(self, module, captured, grad_output, block, dtype):
        params = {n: p.detach() for n, p in module.named_parameters(recurse=False)}

        def inner(p, x, dy):  # one sample: x (..., d), dy (..., d)
            out = functional_call(module, p, (x.unsqueeze(0),))
            return (out.to(dtype) * dy.unsqueeze(0).to(dtype)).sum()

        per_sample = vmap(grad(inner), in_dims=(None, 0, 0))(params, captured, grad_output)
        for name, value in per_sample.items():
            yield Contribution(name, 0, value.to(dtype))  # (B, *shape)
