"""transformers' Conv1D rule (GPT-2): ``Y = X W + b``, W stored (in, out); exact in float64."""

from __future__ import annotations

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from fisher_select import plan_coverage
from fisher_select.engine import rules
from fisher_select.engine.rules.conv1d import Conv1DRule
from tests.rule_checks import ROW_BLOCK, assert_exact_f64, rule_vs_autograd
from tests.tiny import tiny_model


@pytest.mark.parametrize("block", [1 << 19, 7], ids=["block-default", "block-rows"])
def test_conv1d_rule_equals_per_sample_autograd(block):
    torch.manual_seed(0)
    layer = Conv1D(5, 6)  # nf=out=5, nx=in=6: weight (6, 5)
    with torch.no_grad():
        layer.bias.normal_()
    rule_vs_autograd(Conv1DRule(), layer, torch.randn(3, 4, 6), block)


@pytest.mark.parametrize("block", [1 << 19, ROW_BLOCK], ids=["block-default", "block-rows"])
def test_gpt2_exact_in_float64(block):
    """Conv1D with biases, LayerNorm, learned positions (wpe) and a tied head, left padded."""
    assert_exact_f64(tiny_model("gpt2"), block=block)


def test_conv1d_is_linear_like_and_keeps_its_stored_shape():
    model = tiny_model("gpt2")
    c_attn = model.transformer.h[0].attn.c_attn
    assert isinstance(rules.lookup(c_attn), Conv1DRule) and rules.is_linear_like(c_attn)
    assert rules.fisher_shape(c_attn, "weight", c_attn.weight) == (16, 48)  # (in, out), as stored
    cov = plan_coverage(model)
    assert "transformer.h.1.mlp.c_proj" in cov.linear_like and "transformer.wpe" not in cov.linear_like
    assert cov.embeddings == ["transformer.wte", "lm_head"]  # wpe is an embedding, not the input one


def test_lazy_classes_are_resolved_only_for_models_holding_their_package_layers(monkeypatch):
    """Lazy classes are imported for a model whose layers come from their package, and never else.

    The registry's state is replaced for the test: others resolve the real entries in this process.
    """
    from fisher_select.engine.rules import registry

    rule = Conv1DRule()
    pending = [(registry.Lazy("transformers.pytorch_utils", "Conv1D"), rule),
               (registry.Lazy("bitsandbytes.nn", "Linear4bit"), rule),
               (registry.Lazy("no_such_package_here.nn", "Layer"), rule)]
    monkeypatch.setattr(registry, "_PENDING", list(pending))
    monkeypatch.setattr(registry, "_BY_CLASS", {k: v for k, v in registry._BY_CLASS.items() if k is not Conv1D})
    for module in (torch.nn.Linear(2, 2), torch.nn.Embedding(3, 2), torch.nn.LayerNorm(2)):
        assert rules.lookup(module) is not None
    assert registry._PENDING == pending  # torch layers resolve nothing

    assert rules.lookup(tiny_model("gpt2").transformer.h[0].attn.c_attn) is rule
    assert registry._PENDING == pending[1:] and registry._BY_CLASS[Conv1D] is rule

    odd = type("Layer", (torch.nn.Module,), {"__module__": "no_such_package_here.nn"})()
    assert rules.lookup(odd) is None  # the package cannot be imported: no rule, no error
    assert registry._PENDING == pending[1:2]
