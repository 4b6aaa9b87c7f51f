"""nn.Embedding rule: per-sample row sums of the output gradient at the sample's own tokens.

Exact in float64 against brute force, alone (untied) and tied to the output head, where the
dense head part and the sparse embedding part of one weight must be summed before squaring.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fisher_select import plan_coverage
from fisher_select.engine import rules
from fisher_select.engine.rules.embedding import EmbeddingRule
from fisher_select.engine.rules.linear import LinearRule
from tests.rule_checks import ROW_BLOCK, assert_exact_f64, rule_vs_autograd
from tests.tiny import tiny_model


@pytest.mark.parametrize("padding_idx", [None, 1])
def test_embedding_rule_equals_per_sample_autograd(padding_idx):
    torch.manual_seed(0)
    table = nn.Embedding(7, 3, padding_idx=padding_idx)
    ids = torch.tensor([[1, 2, 2, 5], [1, 1, 6, 2], [3, 3, 3, 3]])  # repeats and padding ids
    rule_vs_autograd(EmbeddingRule(), table, ids)


@pytest.mark.parametrize("block", [1 << 19, ROW_BLOCK], ids=["block-default", "block-rows"])
@pytest.mark.parametrize("name", ["llama-untied", "llama-tied"])
def test_embedding_models_exact_in_float64(name, block):
    assert_exact_f64(tiny_model(name), block=block)


def test_tied_weight_has_two_users_and_one_entry():
    model = tiny_model("llama-tied")
    cov = plan_coverage(model)
    users = cov.users["model.embed_tokens.weight"]
    assert sorted(type(u.rule).__name__ for u in users) == ["EmbeddingRule", "LinearRule"]
    assert "lm_head.weight" not in cov.shapes


@pytest.mark.parametrize("tied", [True, False])
def test_embeddings_and_head_are_found_by_identity(tied):
    model = tiny_model("llama-tied" if tied else "llama-untied")
    found = rules.embeddings_and_heads(model)
    assert found[0] is model.model.embed_tokens and found[1] is model.lm_head and len(found) == 2
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert plan_coverage(model).embeddings == ["model.embed_tokens", "lm_head"]
    assert isinstance(rules.lookup(model.lm_head), LinearRule)  # the head is a Linear, found by identity


def test_modules_without_embedding_getters_have_no_heads():
    assert rules.embeddings_and_heads(nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4))) == []
    assert plan_coverage(tiny_model("linear-called-twice")).embeddings == []


@pytest.mark.parametrize("options", [{"max_norm": 1.0}, {"scale_grad_by_freq": True}])
def test_embeddings_whose_gradient_the_rule_cannot_rebuild_go_to_the_fallback(options):
    table = nn.Embedding(4, 2, **options)
    assert isinstance(rules.lookup(table), EmbeddingRule) and not EmbeddingRule.accepts(table)
    assert set(plan_coverage(nn.Sequential(table)).fallback) == {"0.weight"}
