"""Dispatch cannot be silently wrong: a subclass of a ruled layer whose ``forward`` computes something
else never gets its parent's rule. For each ruled layer family, a synthetic subclass that changes the
computation lands on the exact per-sample fallback (or, for ``*Norm`` classes, on the functional
rule that differentiates its own forward) and the model stays exact in float64 against the
per-sample reference; a subclass that keeps ``forward`` keeps the rule and stays exact too."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from fisher_select import FisherSelectError, plan_coverage, score_sums
from fisher_select.engine import rules
from fisher_select.engine.rules.conv1d import Conv1DRule
from fisher_select.engine.rules.embedding import EmbeddingRule
from fisher_select.engine.rules.linear import LinearRule
from fisher_select.engine.rules.norm import FunctionalNormRule, LayerNormRule, RMSNormRule
from tests.rule_checks import ShiftedNorm, assert_exact_f64
from tests.tiny import random_batch, tiny_model


class TripledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 3.0


class ScaledLookup(nn.Embedding):  # what Gemma's scaled embedding does
    def forward(self, ids):
        return super().forward(ids) * 4.0


class ShiftedConv1D(Conv1D):
    def forward(self, x):
        return torch.tanh(super().forward(x))


class LayerNormSquared(nn.LayerNorm):  # the name ends in neither "Norm": no functional rule either
    def forward(self, x):
        return super().forward(x) ** 2


class RMSNormPlusOne(nn.RMSNorm):
    def forward(self, x):
        return super().forward(x) * (1 + self.weight)


class SquaredShiftedNorm(ShiftedNorm):  # a model-specific norm: the functional rule follows its forward
    def forward(self, x):
        return super().forward(x) ** 2


class PlainLinear(nn.Linear):
    pass


class PlainEmbedding(nn.Embedding):
    pass


class PlainConv1D(Conv1D):
    pass


class PlainLayerNorm(nn.LayerNorm):
    pass


class PlainRMSNorm(nn.RMSNorm):
    pass


def _copy_into(new: nn.Module, old: nn.Module) -> nn.Module:
    new.load_state_dict(old.state_dict())
    return new


def _linear(cls):
    return lambda old: _copy_into(cls(old.in_features, old.out_features, bias=old.bias is not None), old)


def _embedding(cls):
    return lambda old: _copy_into(cls(old.num_embeddings, old.embedding_dim), old)


def _conv1d(cls):
    return lambda old: _copy_into(cls(old.nf, old.weight.shape[0]), old)


def _layer_norm(cls):
    return lambda old: _copy_into(cls(old.normalized_shape, eps=old.eps), old)


def _rms_norm(cls):  # from a LlamaRMSNorm
    def make(old):
        new = cls(old.weight.shape, eps=old.variance_epsilon)
        with torch.no_grad():
            new.weight.copy_(old.weight)
        return new
    return make


def _shifted(cls):
    def make(old):
        new = cls(old.weight.shape[0])
        with torch.no_grad():
            new.weight.copy_(old.weight)
        return new
    return make


# family: (tiny model, module path, (changed subclass, its rule or None), (plain subclass, the parent's rule))
CASES = {
    "linear": ("llama-untied", "model.layers.0.mlp.up_proj", _linear, TripledLinear, PlainLinear, LinearRule),
    "embedding": ("llama-tied", "model.embed_tokens", _embedding, ScaledLookup, PlainEmbedding, EmbeddingRule),
    "conv1d": ("gpt2", "transformer.h.0.mlp.c_fc", _conv1d, ShiftedConv1D, PlainConv1D, Conv1DRule),
    "layer-norm": ("gpt2", "transformer.h.1.ln_1", _layer_norm, LayerNormSquared, PlainLayerNorm, LayerNormRule),
    "rms-norm": ("llama-untied", "model.layers.1.input_layernorm", _rms_norm, RMSNormPlusOne, PlainRMSNorm,
                 RMSNormRule),
    "named-norm": ("llama-untied", "model.norm", _shifted, SquaredShiftedNorm, ShiftedNorm, FunctionalNormRule),
}


def _swapped(model_name: str, path: str, make) -> tuple[nn.Module, nn.Module]:
    model = tiny_model(model_name)
    parent, _, child = path.rpartition(".")
    new = make(model.get_submodule(path))
    setattr(model.get_submodule(parent), child, new)
    if model_name == "llama-tied" and child == "embed_tokens":
        model.tie_weights()  # the head shares the new embedding's weight again
    return model, new


@pytest.mark.parametrize("family", sorted(CASES))
def test_subclass_that_changes_forward_is_never_given_its_parents_rule(family):
    model_name, path, builder, changed, _, _ = CASES[family]
    model, layer = _swapped(model_name, path, builder(changed))
    cov = plan_coverage(model)
    names = [f"{path}.{n}" for n, _ in layer.named_parameters(recurse=False)]
    if family == "named-norm":  # differentiates the subclass's own forward: still a rule, still exact
        assert isinstance(rules.lookup(layer), FunctionalNormRule)
        assert not cov.fallback
    else:
        assert rules.lookup(layer) is None
        assert set(names) <= set(cov.fallback), (names, sorted(cov.fallback))
        assert not rules.is_linear_like(layer)  # not a LoRA target by its parent's rule either
    assert_exact_f64(model)


@pytest.mark.parametrize("family", sorted(CASES))
def test_subclass_that_keeps_forward_keeps_the_rule(family):
    model_name, path, builder, _, plain, rule = CASES[family]
    model, layer = _swapped(model_name, path, builder(plain))
    assert type(rules.lookup(layer)) is rule
    assert not plan_coverage(model).fallback
    assert_exact_f64(model)


def test_an_explicitly_registered_subclass_gets_its_own_rule():
    """The scaled embedding's rule (registered for Gemma's class) is what the registry gives it."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from fisher_select.engine.rules.embedding import ScaledEmbeddingRule

    layer = Gemma3TextScaledWordEmbedding(10, 4, padding_idx=0, embed_scale=2.0)
    assert type(rules.lookup(layer)) is ScaledEmbeddingRule
    assert rules.same_computation(type(layer), nn.Embedding, LinearRule()) is False


def test_accelerate_style_instance_forward_wrapper_keeps_the_rule():
    """Device hooks (accelerate) replace ``forward`` on the instance; the class decides the rule."""
    layer = nn.Linear(3, 2)
    original = layer.forward
    layer.forward = lambda *a, **k: original(*a, **k)
    assert type(rules.lookup(layer)) is LinearRule


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_subclass_that_changes_forward_is_refused_with_one_error(kind):
    """bitsandbytes layers are registered by class; a subclass computing something else cannot take
    their rule, and its packed weight has no autograd gradient for the fallback: one clear error."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from tests.test_bnb import quantize

    base = bnb.nn.Linear4bit if kind == "nf4" else bnb.nn.Linear8bitLt
    q, _ = quantize(tiny_model("qwen2-bias"), kind)
    layer = q.model.layers[0].mlp.up_proj
    assert type(rules.lookup(layer)).__name__ in ("Bnb4bitRule", "BnbLinearRule")
    layer.__class__ = type("Plain" + base.__name__, (base,), {})
    assert type(rules.lookup(layer)).__name__ in ("Bnb4bitRule", "BnbLinearRule")  # forward kept: rule kept
    layer.__class__ = type("Tripled" + base.__name__, (base,), {"forward": lambda self, x: base.forward(self, x) * 3})
    assert rules.lookup(layer) is None
    ids, attn, resp, _ = random_batch(vocab=64)
    with pytest.raises(FisherSelectError, match=r"mlp\.up_proj\.weight.*stored packed"):
        score_sums(q, ids, attn, resp)


@pytest.mark.parametrize("changed", [False, True], ids=["plain-subclass", "changed-subclass"])
def test_subclasses_of_the_scaled_embedding(changed):
    """The explicitly registered scaled embedding is a ruled family too: a subclass keeps its rule only
    with its forward, and the model is exact either way (1e-6: Gemma's norms compute in float32)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from fisher_select.engine.reference import brute_force_sums
    from fisher_select.engine.rules.embedding import ScaledEmbeddingRule
    from tests.rule_checks import rel
    from tests.test_families import GEMMA_FP32_NORM, VOCAB, tiny_family

    body = {"forward": lambda self, ids: Gemma3TextScaledWordEmbedding.forward(self, ids) ** 2} if changed else {}
    model = tiny_family("gemma3").double()
    layer = model.model.embed_tokens
    layer.__class__ = type("Sub", (Gemma3TextScaledWordEmbedding,), body)
    assert (rules.lookup(layer) is None) if changed else type(rules.lookup(layer)) is ScaledEmbeddingRule
    assert ("model.embed_tokens.weight" in plan_coverage(model).fallback) == changed
    ids, attn, resp, _ = random_batch(vocab=VOCAB)
    sums = score_sums(model, ids, attn, resp, accumulate_dtype=torch.float64)
    squares, _, total = brute_force_sums(model, ids, attn, resp)
    for name in squares:
        assert rel(sums.squares[name], squares[name]) < GEMMA_FP32_NORM, name
        assert rel(sums.total[name], total[name]) < GEMMA_FP32_NORM, name
