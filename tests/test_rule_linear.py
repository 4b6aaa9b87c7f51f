"""nn.Linear rule: per-sample dW = dY^T X, db = sum_t dY, exact in float64 against brute force."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fisher_select import plan_coverage
from fisher_select.engine import rules
from fisher_select.engine.rules.linear import LinearRule
from tests.rule_checks import ROW_BLOCK, assert_exact_f64, rule_vs_autograd
from tests.tiny import tiny_model


@pytest.mark.parametrize("block", [1 << 19, 7], ids=["block-default", "block-rows"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_rule_equals_per_sample_autograd(bias, block):
    torch.manual_seed(0)
    layer = nn.Linear(6, 5, bias=bias)
    rule_vs_autograd(LinearRule(), layer, torch.randn(3, 4, 6), block)  # (B, T, in)
    rule_vs_autograd(LinearRule(), layer, torch.randn(3, 2, 4, 6), block)  # extra position axes


@pytest.mark.parametrize("block", [1 << 19, ROW_BLOCK], ids=["block-default", "block-rows"])
@pytest.mark.parametrize("name", ["qwen2-bias", "llama-untied", "linear-called-twice"])
def test_linear_models_exact_in_float64(name, block):
    """q/k/v with bias (Qwen2), an untied head, and one Linear called twice per forward."""
    assert_exact_f64(tiny_model(name), block=block)


def test_linear_rule_covers_subclasses_and_is_linear_like():
    class MyLinear(nn.Linear):
        pass

    for layer in (nn.Linear(2, 3), MyLinear(2, 3)):
        assert isinstance(rules.lookup(layer), LinearRule)
        assert rules.is_linear_like(layer)
    assert not rules.is_linear_like(nn.Embedding(4, 2))
    assert not rules.is_linear_like(nn.LayerNorm(2))
    model = tiny_model("qwen2-bias")
    cov = plan_coverage(model)
    assert isinstance(cov.users["model.layers.0.self_attn.q_proj.bias"][0].rule, LinearRule)
    linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(cov.linear_like) == linear and "lm_head" in linear
