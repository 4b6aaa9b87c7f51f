"""bitsandbytes 4-bit / 8-bit Linear layers.

Their weight is stored packed/quantized and gets no ``.grad``, but the layer still computes
``Y = X dequant(W)^T + b``, so ``dY_n^T X_n`` is sample n's gradient with respect to the
dequantized weight: the Fisher has the shape (out_features, in_features), not the packed
storage's shape. Backward only runs when the layer's input requires grad, which the engine
ensures by anchoring the graph at the first rule module's output.

Both classes are registered lazily: bitsandbytes is imported only when a model holds one of its
layers. Nothing here imports it at module level.
"""

from __future__ import annotations

from contextlib import contextmanager

from fisher_select.errors import FisherSelectError
from fisher_select.engine.rules.linear import LinearRule
from fisher_select.engine.rules.registry import Lazy, guard_model, register


@register(Lazy("bitsandbytes.nn", "Linear8bitLt"))
class BnbLinearRule(LinearRule):
    """The Linear rule's math (dY_n^T X_n is the gradient of the dequantized weight); the Fisher has
    the dequantized shape."""

    def fisher_shape(self, module, name, param):
        # The packed storage has another shape; the Fisher is over the dequantized weight.
        return (module.out_features, module.in_features) if name == "weight" else tuple(param.shape)


@register(Lazy("bitsandbytes.nn", "Linear4bit"))
class Bnb4bitRule(BnbLinearRule):
    """4-bit layers: as 8-bit, plus a guard against bitsandbytes' CPU inference repacking.

    In eval mode, on a CPU with AVX512-BF16, ``Linear4bit.forward`` repacks its weight in place
    for a fast inference kernel (absmax rounded to bf16) that has no backward. Sampling would
    then draw from slightly different weights than the scores use, and scoring would fail.
    """

    @contextmanager
    def guard(self, module):
        # The layers themselves have no dropout, so marking them as training changes nothing else.
        saved = module.training
        try:
            module.training = True
            yield
        finally:
            module.training = saved

    def check(self, module):
        if getattr(getattr(module.weight, "quant_state", None), "packing_format_for_cpu", False):
            raise FisherSelectError(
                "bitsandbytes repacked some 4-bit weights into its CPU inference layout (it does so in eval "
                "mode without gradients), which has no backward; reload the model, or run inference before "
                "scoring inside fisher_select.engine.rules.guard_model(model), which keeps the Linear4bit "
                "layers in train mode"
            )


# The guard under its historical name (calibrate() used to import it from here).
keep_trainable_layout = guard_model
