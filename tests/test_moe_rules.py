"""MoE experts and routers of transformers 5 (rules/moe.py) against the brute-force per-sample loop.

Tiny Mixtral, Qwen3-MoE, OLMoE and gpt-oss (4 experts, top-2, hidden 32, 2 layers) in float64 with
left-padded rows: every accumulator mode and a ``params`` subset equal one unpadded backward per
row (``engine.reference.per_sample_scores``), and no expert or router parameter is on the fallback.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fisher_select import score_sums
from fisher_select.engine.reference import per_sample_scores
from fisher_select.engine.scoring import plan_coverage
from fisher_select.errors import FisherSelectError
from tests.rule_checks import rel
from tests.tiny import random_batch
from tests.tiny_moe import FAMILIES, tiny_moe

EXACT = 1e-10  # float64 both sides (the routers' fp32 softmax is the same function on both sides)
MOE_RULES = {"FusedExpertsRule", "TopKRouterRule"}


def _is_moe(name: str) -> bool:
    return ".experts." in name or ".gate." in name or ".router." in name


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(model, batch, signal, per-sample gradients of every parameter) for one family."""
    model = tiny_moe(request.param)
    ids, attn, resp, signal = random_batch(vocab=64)  # rows 1 and 2 left padded
    scores = per_sample_scores(model, ids, attn, resp)
    return request.param, model, (ids, attn, resp), signal, scores


def _want(scores, names, signal=None):
    squares = {n: sum(s[n] ** 2 for s in scores) for n in names}
    total = {n: sum(s[n] for s in scores) for n in names}
    weighted = None if signal is None else {n: sum(float(a) * s[n] for a, s in zip(signal, scores)) for n in names}
    return squares, total, weighted


def _same(got, want, what):
    assert set(got) == set(want), what
    for n, v in want.items():
        assert rel(got[n], v) <= EXACT, (what, n, rel(got[n], v))


def test_experts_and_routers_are_covered_by_the_moe_rules(family):
    name, model, *_ = family
    cov = plan_coverage(model)
    moe = [n for n in cov.params if _is_moe(n)]
    assert len(moe) >= 4 and not set(moe) & set(cov.fallback), cov.fallback
    assert {type(cov.users[n][0].rule).__name__ for n in moe} == MOE_RULES
    if name == "gpt_oss":  # the attention sinks are attention, not MoE: not this file's rule
        assert all(n.endswith("self_attn.sinks") for n in cov.fallback)
    else:
        assert not cov.fallback


@pytest.mark.parametrize("mode", ["full", "gradient", "fisher", "weighted_sum", "totals_only"])
def test_every_accumulator_mode_equals_the_per_sample_loop(family, mode):
    _, model, batch, signal, scores = family
    squares = mode in ("full", "gradient", "fisher")
    totals = mode in ("full", "totals_only")
    sig = signal if mode in ("full", "gradient", "weighted_sum") else None
    sums = score_sums(model, *batch, sig, squares=squares, totals=totals, accumulate_dtype=torch.float64)
    want_sq, want_total, want_signal = _want(scores, list(scores[0]), sig)
    assert (sums.squares is not None) == squares and (sums.total is not None) == totals
    if squares:
        _same(sums.squares, want_sq, "squares")
    if totals:
        _same(sums.total, want_total, "total")
    if sig is not None:
        _same(sums.signal, want_signal, "signal")


def test_a_params_subset_of_experts_and_one_router_equals_the_loop(family):
    _, model, batch, signal, scores = family
    names = {n for n in scores[0] if ".layers.1." in n and ".experts." in n}
    names |= {n for n in scores[0] if ".layers.0." in n and (".gate." in n or ".router." in n)}
    assert len(names) >= 3
    small = 64  # pieces smaller than one expert's gradient: samples in several blocks
    sums = score_sums(model, *batch, signal, params=names, block=small, accumulate_dtype=torch.float64)
    want_sq, want_total, want_signal = _want(scores, names, signal)
    _same(sums.squares, want_sq, "squares")
    _same(sums.total, want_total, "total")
    _same(sums.signal, want_signal, "signal")


def _routed_by_hooks(model, attention_mask, response_mask):
    """Tokens per expert counted from the routers' own outputs (forward hooks), per experts module."""
    found = {}

    def hook(block_name, experts):
        def count(module, args, output):
            index = output[2].reshape(*attention_mask.shape, -1)  # (B, T, k)
            found[block_name] = [torch.bincount(index[m.bool()].flatten(), minlength=experts)
                                 for m in (response_mask, attention_mask)]
        return count

    handles = [m.register_forward_hook(hook(n.rsplit(".", 1)[0] + ".experts", m.num_experts))
               for n, m in model.named_modules() if n.endswith((".gate", ".router"))]
    return found, handles


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_an_expert_no_token_reached_has_zero_fisher_and_zero_tokens(name):
    """16 experts, 3 positions of 2 rows, top-2: at most 12 choices, so some experts get no token."""
    model = tiny_moe(name, experts=16, seed=1)
    ids, attn, resp, signal = random_batch(batch=2, length=3, pad_rows=((1, 1),))
    sums = score_sums(model, ids, attn, resp, signal, accumulate_dtype=torch.float64)
    scores = per_sample_scores(model, ids, attn, resp)
    want_sq, want_total, want_signal = _want(scores, list(scores[0]), signal)
    _same(sums.squares, want_sq, "squares")
    _same(sums.signal, want_signal, "signal")
    found, handles = _routed_by_hooks(model, attn, resp)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attn)
    for h in handles:
        h.remove()
    assert set(sums.expert_tokens) == set(found) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    for module, (response, real) in found.items():
        assert torch.equal(sums.expert_tokens[module], response) and torch.equal(sums.expert_positions[module], real)
        unreached = (real == 0).nonzero().flatten()
        assert len(unreached) >= 4
        for param in ("gate_up_proj", "down_proj"):
            assert sums.squares[f"{module}.{param}"][unreached].abs().max() == 0
    assert int(sums.expert_tokens["model.layers.0.mlp.experts"].sum()) == 2 * int(resp.sum())  # top-2 each


def test_routing_counts_add_over_batches_with_into():
    model = tiny_moe("olmoe")
    ids, attn, resp, _ = random_batch(vocab=64)
    once = score_sums(model, ids, attn, resp, accumulate_dtype=torch.float64)
    twice = score_sums(model, ids, attn, resp, into=score_sums(model, ids, attn, resp, accumulate_dtype=torch.float64),
                       accumulate_dtype=torch.float64)
    for module, counts in once.expert_tokens.items():
        assert torch.equal(twice.expert_tokens[module], 2 * counts) and counts.sum() > 0


def test_an_experts_layout_the_rule_does_not_model_goes_to_the_named_fallback():
    model = tiny_moe("mixtral")
    model.model.layers[0].mlp.experts.has_post_expert_norm = True  # a layout flag the rule does not model
    cov = plan_coverage(model)
    assert set(cov.fallback) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}


class _LegacyMoeLM(nn.Module):
    """transformers 4.x's MoE shape: the router and each expert are nn.Linear on flattened (B*T, d) tokens."""

    def __init__(self, vocab=64, d=8, experts=4):
        super().__init__()
        self.config = type("Config", (), {"vocab_size": vocab})()
        self.embed = nn.Embedding(vocab, d)
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(experts))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **kwargs):
        h = self.embed(input_ids)  # (B, T, d)
        flat = h.reshape(-1, h.shape[-1])  # (B*T, d)
        weights, chosen = torch.softmax(self.gate(flat), -1).topk(1, dim=-1)  # (B*T, 1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (chosen[:, 0] == e).nonzero().flatten()
            out = out.index_add(0, rows, expert(flat[rows]) * weights[rows])
        h = h + out.reshape(h.shape).cumsum(1)
        return type("Out", (), {"logits": self.head(h)})()


def test_a_transformers_4_style_moe_on_flattened_tokens_is_refused_not_scored():
    model = _LegacyMoeLM().double()
    ids, attn, resp, _ = random_batch(vocab=64)
    with pytest.raises(FisherSelectError, match=r"Linear .* was called on 40 rows for a batch of 4 samples.*"
                                                r"transformers >= 5"):
        score_sums(model, ids, attn, resp, accumulate_dtype=torch.float64)
    # the experts alone (router left out) are refused too: each sees its routed rows, not the samples
    experts = {n for n, _ in model.named_parameters() if n.startswith("experts.")}
    with pytest.raises(FisherSelectError, match="rows for a batch of 4 samples"):
        score_sums(model, ids, attn, resp, params=experts, accumulate_dtype=torch.float64)


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_transformers_other_experts_forwards_get_the_same_sums_as_eager(implementation):
    """The rule reads the layout off the instance, not the forward: fp32 sums agree across forwards."""
    ids, attn, resp, signal = random_batch(vocab=64)
    sums = {}
    for forward in ("eager", implementation):
        model = tiny_moe("qwen3_moe", dtype=torch.float32)
        model.config._experts_implementation = forward
        sums[forward] = score_sums(model, ids, attn, resp, signal)
    for kind in ("squares", "total", "signal"):
        for name, want in getattr(sums["eager"], kind).items():
            assert rel(getattr(sums[implementation], kind)[name], want) <= 1e-5, (kind, name)
    assert all(torch.equal(sums[implementation].expert_tokens[m], c) for m, c in sums["eager"].expert_tokens.items())


def test_non_reentrant_checkpointing_scores_each_moe_call_once():
    """Recomputation in backward neither captures the experts or routers again nor counts tokens twice."""
    model = tiny_moe("olmoe")
    ids, attn, resp, signal = random_batch(vocab=64)
    want = score_sums(model, ids, attn, resp, signal, accumulate_dtype=torch.float64)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers checkpoints only in training mode (OLMoE has no dropout or router noise)
    got = score_sums(model, ids, attn, resp, signal, accumulate_dtype=torch.float64)
    _same(got.squares, want.squares, "squares")
    _same(got.signal, want.signal, "signal")
    assert all(torch.equal(got.expert_tokens[m], c) for m, c in want.expert_tokens.items())
