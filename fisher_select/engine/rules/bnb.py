"""bitsandbytes 4-bit / 8-bit Linear layers.

Their weight is stored packed/quantized and gets no ``.grad``, but the layer still computes
``Y = X dequant(W)^T + b``, so ``dY_n^T X_n`` is sample n's gradient with respect to the
dequantized weight: the Fisher has the shape (out_features, in_features), not the packed
storage's shape. Backward only runs when the layer's input requires grad, which the engine
ensures by anchoring the graph at the first rule module's output.
"""

from __future__ import annotations

from contextlib import contextmanager

from fisher_select.errors import FisherSelectError
from fisher_select.engine.rules.base import Rule
from fisher_select.engine.rules.linear import linear_contributions


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



def _linear4bit_modules(model):
    return [m for m in model.modules() if type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")]


@contextmanager
def keep_trainable_layout(model):
    """Keep bitsandbytes 4-bit layers out of their CPU inference layout while calibrating.

    In eval mode, on a CPU with AVX512-BF16, ``Linear4bit.forward`` repacks its weight in place
    for a fast inference kernel (absmax rounded to bf16) that has no backward. Sampling would
    then draw from slightly different weights than the scores use, and scoring would fail.
    The layers themselves have no dropout, so marking them as training changes nothing else.
    """
    layers = _linear4bit_modules(model)
    saved = [m.training for m in layers]
    try:
        for m in layers:
            m.training = True
        yield
    finally:
        for m, t in zip(layers, saved):
            m.training = t


def check_layout(model) -> None:
    """Refuse weights already repacked for CPU inference (their layer cannot be differentiated)."""
    packed = [m for m in _linear4bit_modules(model)
              if getattr(getattr(m.weight, "quant_state", None), "packing_format_for_cpu", False)]
    if packed:
        raise FisherSelectError(
            "bitsandbytes repacked some 4-bit weights into its CPU inference layout (it does so in eval mode "
            "without gradients), which has no backward; reload the model, or keep the Linear4bit layers in "
            "train mode (fisher_select.engine.rules.bnb.keep_trainable_layout) when running inference before scoring"
        )
