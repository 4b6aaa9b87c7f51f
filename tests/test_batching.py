"""Token-budget micro-batches: any split of a batch's rows gives the same sums as one pass.

Signals are computed per prompt group before scoring, so a budget that splits a group (or
leaves one row per micro-batch) must score exactly what the whole batch scores.
"""

from __future__ import annotations

import pytest
import torch

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import OPDFullObjective, RLObjective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.calibration.teachers import Teacher
from fisher_select.engine.batching import (DEFAULT_ACTIVATION_BYTES, auto_max_tokens, bytes_per_token, micro_batches,
                                          score_in_budget)
from fisher_select.engine.reference import brute_force_sums
from fisher_select.engine.scoring import score_sums
from tests.rule_checks import EXACT, rel
from tests.tiny import TinyTokenizer, enumeration_model, random_batch, tiny_model

PADS = ((1, 3), (2, 1), (4, 5), (5, 2))  # left padding of rows 1, 2, 4, 5: rows of four lengths


def _batch():
    ids, attn, resp, signal = random_batch(batch=6, length=10, pad_rows=PADS)
    two = torch.stack([signal, signal.flip(0) * 2 - 1])  # (O=2, B): two objectives at once
    return ids, attn, resp, two


def test_micro_batches_are_sorted_by_length_and_respect_budget_and_rows():
    _, attn, _, _ = _batch()  # lengths: 10, 7, 9, 10, 5, 8
    assert micro_batches(attn, None) == [[0, 3, 2, 5, 1, 4]]
    assert micro_batches(attn, 20) == [[0, 3], [2, 5], [1, 4]]  # 2 x 10, 2 x 9 (the longer one pads), 2 x 7
    assert micro_batches(attn, 3) == [[b] for b in (0, 3, 2, 5, 1, 4)]  # budget below one row: one row each
    assert micro_batches(attn, None, max_rows=4) == [[0, 3, 2, 5], [1, 4]]


@pytest.mark.parametrize("budget", [None, 40, 27, 16, 1])
def test_micro_batched_sums_equal_one_pass_and_brute_force(budget):
    model = tiny_model("llama-tied").double()
    ids, attn, resp, two = _batch()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)  # (B, T)
    kw = dict(accumulate_dtype=torch.float64)
    got = score_in_budget(model, ids, attn, resp, two, max_tokens=budget, **kw)
    whole = score_sums(model, ids, attn, resp, two, **kw)
    assert got.count == 6
    for o in range(2):
        squares, weighted, total = brute_force_sums(model, ids, attn, resp, two[o])
        for name in squares:
            assert rel(got.squares[name], squares[name]) <= EXACT
            assert rel(got.total[name], total[name]) <= EXACT
            assert rel(got.signal[name][o], weighted[name]) <= EXACT
            assert rel(got.signal[name][o], whole.signal[name][o]) <= EXACT
    # token weights travel with their rows (the token-level objectives' pass)
    tok = score_in_budget(model, ids, attn, resp, max_tokens=budget, token_weights=weights, **kw)
    squares, _, total = brute_force_sums(model, ids, attn, resp, token_weights=weights)
    for name in squares:
        assert rel(tok.squares[name], squares[name]) <= EXACT and rel(tok.total[name], total[name]) <= EXACT


def test_the_auto_budget_follows_the_layer_widths():
    model = tiny_model("llama-tied")
    # 2 layers x (q 16 + k 8 + v 8 + o 16 + gate 32 + up 32 + down 16) + head 64, + vocab 64; fp32, x2
    assert bytes_per_token(model) == 4 * 2 * (2 * 128 + 64 + 64)
    assert auto_max_tokens(model) == DEFAULT_ACTIVATION_BYTES // bytes_per_token(model)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to fp32 accumulation in another order: the accumulators are fp32 by design, so an entry near 0
    (cancellation) may differ by a few fp32 ulps of the tensor's largest entry; a lost or doubled micro-batch
    moves entries by the size of a whole term, far above this."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


TINY = [PromptRecord(i, p, None, {}) for i, p in enumerate(["2 3", "4 2 0", "3 3", "0 4 4", "2 2", "3 0"])]


def _calibrate(**kw):
    # float64 models: each sample's terms are exact, so only the fp32 accumulators' order differs (fp32 models
    # differed by 5e-5 relative in the score mean on an Intel Xeon, from cancellation inside each term)
    model = enumeration_model().double()
    teacher = Teacher(enumeration_model(seed=1).double(), name="teacher")
    objectives = [RLObjective(lambda r, t: float(len(t.split()) % 2)), OPDFullObjective(teacher, sign_draws=2)]
    return calibrate(model, TinyTokenizer(5), TINY, objectives, samples_per_prompt=3, max_new_tokens=3, seed=7,
                     batch_size=6, progress=False, **kw)


@pytest.mark.parametrize("stability", [True, False])
def test_a_small_budget_calibrates_like_a_huge_one(stability):
    small, huge = _calibrate(max_batch_tokens=4, stability=stability), _calibrate(max_batch_tokens=10**9,
                                                                                  stability=stability)
    assert small.samples == huge.samples  # the same responses: the budget never touches the random streams
    assert [o.signal_scale for o in small.objectives] == [o.signal_scale for o in huge.objectives]
    for name in huge.fisher:
        assert _close(small.fisher[name], huge.fisher[name])
        assert _close(small.score_mean[name], huge.score_mean[name])
        assert _close(small.token_fisher[name], huge.token_fisher[name])
        for a, b in zip(small.objectives, huge.objectives):
            assert _close(a.grad_estimate[name], b.grad_estimate[name])


def test_the_autograd_check_runs_in_micro_batches_too():
    from fisher_select.calibration.calibrator import verify_against_autograd
    from fisher_select.engine.scoring import plan_coverage

    model = tiny_model("llama-tied")
    ids, attn, resp, two = _batch()
    cov = plan_coverage(model)
    sums = score_sums(model, ids, attn, resp, two, coverage=cov)
    for budget in (None, 16, 1):
        assert verify_against_autograd(model, ids, attn, resp, sums, cov, budget)["max_relative_error"] < 1e-5
