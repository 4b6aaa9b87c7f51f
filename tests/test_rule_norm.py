"""Norm rules: torch's LayerNorm and RMSNorm in closed form, model-specific ``*Norm`` classes by
differentiating their own forward per sample; each exact in float64 against brute force."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fisher_select import plan_coverage
from fisher_select.engine import rules
from fisher_select.engine.rules.norm import FunctionalNormRule, LayerNormRule, RMSNormRule
from tests.rule_checks import (
    ShiftedNorm,
    assert_exact_f64,
    replace_norms,
    rule_vs_autograd,
    shifted_norm,
    torch_rms_norm,
)
from tests.tiny import tiny_model


def _perturbed(module: nn.Module) -> nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return module


@pytest.mark.parametrize("module", [
    nn.LayerNorm(6), nn.LayerNorm(6, bias=False), nn.LayerNorm((2, 3)),
], ids=["affine", "no-bias", "2-d-shape"])
def test_layer_norm_rule_equals_per_sample_autograd(module):
    assert isinstance(rules.lookup(module), LayerNormRule)
    rule_vs_autograd(LayerNormRule(), _perturbed(module), torch.randn(3, 4, 6).reshape(3, 4, *module.normalized_shape))


@pytest.mark.parametrize("module", [nn.RMSNorm(6, eps=1e-5), nn.RMSNorm((2, 3))], ids=["1-d", "2-d-shape"])
def test_rms_norm_rule_equals_per_sample_autograd(module):
    assert isinstance(rules.lookup(module), RMSNormRule)
    x = torch.randn(3, 2, 4, 6).reshape(3, 2, 4, *module.normalized_shape)  # two position axes
    rule_vs_autograd(RMSNormRule(), _perturbed(module), x)


@pytest.mark.parametrize("module", [ShiftedNorm(6), nn.GroupNorm(2, 6)], ids=["shifted", "group"])
def test_functional_norm_rule_equals_per_sample_autograd(module):
    assert isinstance(rules.lookup(module), FunctionalNormRule)
    x = torch.randn(3, 4, 6) if isinstance(module, ShiftedNorm) else torch.randn(3, 6, 4)  # GroupNorm: (B, C, L)
    rule_vs_autograd(FunctionalNormRule(), _perturbed(module), x)


def test_llama_with_torch_rms_norm_exact_in_float64():
    model = replace_norms(tiny_model("llama-untied"), torch_rms_norm)
    cov = plan_coverage(model)
    assert isinstance(cov.users["model.norm.weight"][0].rule, RMSNormRule)
    assert isinstance(cov.users["model.layers.1.post_attention_layernorm.weight"][0].rule, RMSNormRule)
    assert not cov.fallback
    assert_exact_f64(model)


def test_torch_rms_norm_is_the_same_function_as_llama_rms_norm():
    """So the swap above tests RMSNormRule on a real architecture, not on another model."""
    model = tiny_model("llama-untied")
    swapped = replace_norms(tiny_model("llama-untied"), torch_rms_norm)
    ids = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, swapped(ids).logits, rtol=1e-5, atol=1e-6)


def test_model_specific_norm_through_functional_rule_exact_in_float64():
    model = replace_norms(tiny_model("llama-tied"), shifted_norm)
    cov = plan_coverage(model)
    assert isinstance(cov.users["model.layers.0.input_layernorm.bias"][0].rule, FunctionalNormRule)
    assert not cov.fallback
    assert_exact_f64(model)


def test_llama_rms_norm_resolves_by_name_and_is_exact():
    """LlamaRMSNorm normalises in fp32 even in a float64 model; engine and reference share that."""
    model = tiny_model("llama-untied")
    assert isinstance(rules.lookup(model.model.norm), FunctionalNormRule)
    assert_exact_f64(model)


def test_gpt2_layer_norms_use_the_closed_form_rule():
    cov = plan_coverage(tiny_model("gpt2"))
    assert isinstance(cov.users["transformer.ln_f.bias"][0].rule, LayerNormRule)


def test_norms_coupling_samples_or_holding_children_are_not_norm_rules():
    assert rules.lookup(nn.BatchNorm1d(4)) is None  # batch statistics couple samples: the fallback

    class NestedNorm(nn.Module):  # parameters in a child: the functional rule cannot see them all
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2))
            self.inner = nn.Linear(2, 2)

    assert rules.lookup(NestedNorm()) is None
    assert not rules.is_linear_like(nn.LayerNorm(2))
