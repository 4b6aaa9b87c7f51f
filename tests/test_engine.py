"""score_sums against the brute-force per-sample backward loop, over a table of tiny models."""

from __future__ import annotations

import pytest
import torch

from fisher_select import FisherSelectError, plan_coverage, score_sums
from fisher_select.engine.reference import brute_force_sums
from fisher_select.engine.rules import lookup
from fisher_select.engine.rules.embedding import EmbeddingRule
from fisher_select.engine.rules.linear import LinearRule
from fisher_select.engine.rules.norm import FunctionalNormRule, LayerNormRule
from tests.tiny import TINY_MODELS, random_batch, tiny_model

TOL = 1e-4  # relative error, fp32 engine vs float64-accumulated brute force


def rel(a, b):
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def assert_matches(sums, ref, with_signal=True):
    squares, weighted, total = ref
    assert set(sums.squares) == set(squares)
    for name in squares:
        assert sums.squares[name].dtype == torch.float32
        assert rel(sums.squares[name], squares[name]) < TOL, name
        assert rel(sums.total[name], total[name]) < TOL, name
        if with_signal:
            assert rel(sums.signal[name], weighted[name]) < TOL, name


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
@pytest.mark.parametrize("block", [1 << 19, 7], ids=["block-default", "block-tiny"])
def test_exact_against_per_sample_loop(name, block):
    model = tiny_model(name)
    ids, attn, resp, signal = random_batch()
    sums = score_sums(model, ids, attn, resp, signal, block=block)
    assert sums.count == 4
    assert_matches(sums, brute_force_sums(model, ids, attn, resp, signal))


@pytest.mark.parametrize("name", ["llama-tied", "gpt2"])
def test_left_padded_row_equals_unpadded_row(name):
    model = tiny_model(name)
    ids, attn, resp, _ = random_batch(pad_rows=((0, 4),))
    padded = score_sums(model, ids[:1], attn[:1], resp[:1])
    keep = attn[0].bool()
    alone = score_sums(model, ids[:1, keep], attn[:1, keep], resp[:1, keep])
    for n in padded.squares:
        assert rel(padded.squares[n], alone.squares[n]) < TOL, n


def test_token_weights_match_brute_force():
    model = tiny_model("qwen2-bias")
    ids, attn, resp, signal = random_batch()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3))
    sums = score_sums(model, ids, attn, resp, signal, token_weights=weights)
    assert_matches(sums, brute_force_sums(model, ids, attn, resp, signal, token_weights=weights))


def test_several_signals_at_once_equal_separate_passes():
    model = tiny_model("gpt2")
    ids, attn, resp, signal = random_batch()
    both = torch.stack([signal, signal.flip(0) * 2])
    sums = score_sums(model, ids, attn, resp, both)
    for i, s in enumerate(both):
        single = score_sums(model, ids, attn, resp, s)
        for n in single.signal:
            assert rel(sums.signal[n][i], single.signal[n]) < 1e-6


def test_accumulating_into_running_sums_equals_one_batch():
    model = tiny_model("llama-tied")
    ids, attn, resp, signal = random_batch(batch=6)
    whole = score_sums(model, ids, attn, resp, signal)
    run = score_sums(model, ids[:2], attn[:2], resp[:2], signal[:2])
    score_sums(model, ids[2:], attn[2:], resp[2:], signal[2:], into=run)
    assert run.count == 6
    for n in whole.squares:
        assert rel(run.squares[n], whole.squares[n]) < 1e-5
        assert rel(run.signal[n], whole.signal[n]) < 1e-5


def test_rules_resolve_along_class_hierarchy_and_by_norm_name():
    llama = tiny_model("llama-tied")
    assert isinstance(lookup(llama.model.norm), FunctionalNormRule)  # LlamaRMSNorm: not a torch norm class
    assert isinstance(lookup(llama.model.embed_tokens), EmbeddingRule)

    class MyLinear(torch.nn.Linear):
        pass

    assert isinstance(lookup(MyLinear(2, 3)), LinearRule)
    assert isinstance(lookup(tiny_model("gpt2").transformer.ln_f), LayerNormRule)
    assert isinstance(lookup(torch.nn.GroupNorm(2, 4)), FunctionalNormRule)  # per-sample: exact by vjp
    assert lookup(torch.nn.BatchNorm1d(4)) is None  # batch statistics couple samples: the fallback


def test_coverage_claims_every_parameter_once():
    model = tiny_model("llama-fallback")
    cov = plan_coverage(model)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(set(cov.users) | set(cov.fallback)) == sorted(names)
    assert not set(cov.users) & set(cov.fallback)
    assert cov.fallback.keys() == {"model.layers.0.mlp.down_proj.0.scale"}
    tied = plan_coverage(tiny_model("llama-tied"))
    assert len(tied.users["model.embed_tokens.weight"]) == 2  # embedding and output head share it


def test_bf16_model_accumulates_in_fp32():
    model = tiny_model("llama-untied").to(torch.bfloat16)
    ids, attn, resp, signal = random_batch()
    sums = score_sums(model, ids, attn, resp, signal)
    ref = brute_force_sums(tiny_model("llama-untied"), ids, attn, resp, signal)
    for n, sq in sums.squares.items():
        assert sq.dtype == torch.float32
        assert rel(sq, ref[0][n]) < 0.1, n  # bf16 forward; the sums themselves are fp32


def test_non_reentrant_checkpointing_counts_each_call_once():
    model = tiny_model("llama-untied")
    ids, attn, resp, signal = random_batch()
    plain = score_sums(model, ids, attn, resp, signal)
    model.train()  # transformers only checkpoints in train mode (dropout is 0 here)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = score_sums(model, ids, attn, resp, signal)
    for n in plain.squares:
        assert rel(checkpointed.squares[n], plain.squares[n]) < 1e-5, n


def test_reentrant_checkpointing_is_refused():
    model = tiny_model("llama-untied").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids, attn, resp, signal = random_batch()
    with pytest.raises(FisherSelectError, match="use_reentrant"):
        score_sums(model, ids, attn, resp, signal)


def test_parameters_are_left_as_they_were():
    model = tiny_model("llama-fallback")
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    score_sums(model, *random_batch()[:3])
    assert before == {n: p.requires_grad for n, p in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters())


def test_bad_arguments():
    model = tiny_model("llama-tied")
    ids, attn, resp, signal = random_batch()
    resp[:, 0] = True
    with pytest.raises(FisherSelectError, match="position 0|first token"):
        score_sums(model, ids, attn, resp)
    resp[:, 0] = False
    with pytest.raises(FisherSelectError, match="signal must have shape"):
        score_sums(model, ids, attn, resp, signal[:2])


def test_gradient_only_pass_skips_squares():
    model = tiny_model("llama-tied")  # tied head: the shared-parameter path too
    ids, attn, resp, signal = random_batch()
    full = score_sums(model, ids, attn, resp, signal)
    grad_only = score_sums(model, ids, attn, resp, signal, squares=False)
    assert grad_only.squares is None
    for n in full.total:
        assert torch.equal(grad_only.total[n], full.total[n])
        assert torch.equal(grad_only.signal[n], full.signal[n])
