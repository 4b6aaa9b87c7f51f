"""``compile=True``: the fused reductions of dense pieces give the brute-force sums.

The plumbing (row pieces, the K = 1 + O linear targets, squares-free passes) is checked with the
reductions run eagerly; the compiled kernel itself in a slow test (inductor compiles C++ for
~20 s per graph on a 2-core CPU).
"""

from __future__ import annotations

import pytest
import torch

from fisher_select.engine import sums
from fisher_select.engine.reference import brute_force_sums
from fisher_select.engine.scoring import score_sums
from tests.rule_checks import EXACT, ROW_BLOCK, rel
from tests.tiny import random_batch, tiny_model


def _check(model, dtype, tol, block=1 << 19):
    model = model.to(dtype)
    ids, attn, resp, signal = random_batch()
    two = torch.stack([signal, signal.flip(0) * 2 - 1])  # (O=2, B)
    got = score_sums(model, ids, attn, resp, two, block=block, accumulate_dtype=dtype, compile=True)
    grad_only = score_sums(model, ids, attn, resp, signal, block=block, accumulate_dtype=dtype, compile=True,
                           squares=False, totals=False)
    for o in range(2):
        squares, weighted, total = brute_force_sums(model, ids, attn, resp, two[o])
        for name in squares:
            assert rel(got.squares[name], squares[name]) <= tol, name
            assert rel(got.total[name], total[name]) <= tol, name
            assert rel(got.signal[name][o], weighted[name]) <= tol, name
            if o == 0:
                assert rel(grad_only.signal[name], weighted[name]) <= tol, name


@pytest.mark.parametrize("name,block", [("llama-tied", 1 << 19), ("qwen2-bias", ROW_BLOCK), ("gpt2", 1 << 19),
                                        ("llama-fallback", ROW_BLOCK)])
def test_fused_plumbing_matches_brute_force(monkeypatch, name, block):
    monkeypatch.setitem(sums._COMPILED, "fn", sums._reductions)  # eager: the same function inductor compiles
    _check(tiny_model(name), torch.float64, EXACT, block)


@pytest.mark.slow  # inductor: ~20 s of C++ compilation per graph on a 2-core CPU
@pytest.mark.parametrize("dtype,tol", [(torch.float64, EXACT), (torch.float32, 1e-5)])
def test_compiled_reductions_match_brute_force(dtype, tol):
    _check(tiny_model("llama-tied"), dtype, tol, ROW_BLOCK)


@pytest.mark.slow  # compiles (see above)
def test_a_compiled_calibration_equals_the_eager_one():
    from tests.test_batching import _calibrate

    fused, eager = _calibrate(compile=True, max_batch_tokens=8), _calibrate(compile=False, max_batch_tokens=8)
    assert fused.samples == eager.samples
    for name in eager.fisher:
        assert torch.allclose(fused.fisher[name], eager.fisher[name], rtol=1e-5, atol=1e-7)
        for a, b in zip(fused.objectives, eager.objectives):
            assert torch.allclose(a.grad_estimate[name], b.grad_estimate[name], rtol=1e-5, atol=1e-7)
