"""bitsandbytes 4-bit / 8-bit Linear layers.

Their weight is stored packed/quantized and gets no ``.grad``, but the layer still computes
``Y = X dequant(W)^T + b``, so ``dY_n^T X_n`` is sample n's gradient with respect to the
dequantized weight: the Fisher has the shape (out_features, in_features), not the packed
storage's shape. Backward only runs when the layer's input requires grad, which the engine
ensures by anchoring the graph at the first rule module's output.
"""

from __future__ import annotations

from .base import Rule
from .linear import linear_contributions


class BnbLinearRule(Rule):
    def contributions(self, module, captured, grad_output, block):
        yield from linear_contributions(
            captured, grad_output, module.out_features, module.in_features, module.bias is not None, block
        )

    def fisher_shape(self, module, name, param):
        # The packed storage has another shape; the Fisher is over the dequantized weight.
        return (module.out_features, module.in_features) if name == "weight" else tuple(param.shape)


def register_bnb(register) -> None:
    try:
        import bitsandbytes as bnb
    except Exception:  # not installed, or no usable backend: no quantized layers to cover
        return
    rule = BnbLinearRule()
    for name in ("Linear4bit", "Linear8bitLt"):
        cls = getattr(bnb.nn, name, None)
        if cls is not None:
            register(cls, rule)

