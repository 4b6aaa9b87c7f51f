"""The engine's fast paths against the brute-force per-sample loop (``reference.brute_force_sums``).

Pieces that hold every sample of a few rows (reduced over samples in cache, added once), the
weighted GEMM that gives score sums and signal sums, the output head cut into vocabulary
chunks, the memory modes (which accumulators, which parameters, which device), and dtypes.
"""

from __future__ import annotations

import pytest
import torch

from fisher_select import FisherSelectError, plan_coverage, score_sums
from fisher_select.engine.reference import brute_force_sums
from fisher_select.engine.rules.base import blocks
from fisher_select.engine.scoring import ScoreSums
from tests.tiny import random_batch, tiny_model

TOL = 1e-4  # fp32 engine vs float64-accumulated brute force (as tests/test_engine.py)


def rel(a, b):
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def assert_sums(sums, ref, names=None, squares=True, signal=True, totals=True, tol=TOL):
    ref_squares, ref_signal, ref_total = ref
    names = set(ref_squares) if names is None else set(names)
    for kind, mine, want, wanted in (("squares", sums.squares, ref_squares, squares),
                                     ("signal", sums.signal, ref_signal, signal),
                                     ("total", sums.total, ref_total, totals)):
        if not wanted:
            assert mine is None, kind
            continue
        assert set(mine) == names, kind
        for n in names:
            assert rel(mine[n], want[n]) < tol, (kind, n, rel(mine[n], want[n]))


def test_pieces_run_over_rows_with_every_sample():
    # every (sample, row) exactly once; all samples in a piece when a row of all samples fits
    for batch, rows, row_size, block in [(4, 64, 16, 256), (8, 10, 3, 1 << 19), (4, 5, 16, 7), (3, 7, 2, 12)]:
        seen = torch.zeros(batch, rows, dtype=torch.long)
        for samples, part in blocks(batch, rows, row_size, block):
            part = part or slice(0, rows)
            n = (samples.stop - samples.start) * (part.stop - part.start) * row_size
            assert n <= block or (part.stop - part.start == 1 and samples.stop - samples.start == 1)
            if batch * row_size <= block:
                assert (samples.start, samples.stop) == (0, batch)
            seen[samples, part] += 1
        assert bool((seen == 1).all()), (batch, rows, row_size, block)
    assert list(blocks(4, 64, 16, 256)) == [(slice(0, 4), slice(r, r + 4)) for r in range(0, 64, 4)]  # head chunks


@pytest.mark.parametrize("name", ["llama-tied", "llama-untied", "gpt2", "qwen2-bias", "linear-called-twice",
                                  "llama-fallback"])
@pytest.mark.parametrize("block", [1 << 19, 256, 40], ids=["one-piece", "vocab-chunks", "split-samples"])
def test_reordered_accumulation_matches_brute_force(name, block):
    # 256: the 64 x 16 head of 4 samples is cut into 16 vocabulary chunks of 4 rows;
    # 40: one row of all samples does not fit, so rows are split over samples too
    model = tiny_model(name)
    ids, attn, resp, signal = random_batch()
    sums = score_sums(model, ids, attn, resp, signal, block=block)
    assert_sums(sums, brute_force_sums(model, ids, attn, resp, signal))


def test_weighted_gemm_gives_every_objective_signal_sum():
    model = tiny_model("llama-tied")
    ids, attn, resp, _ = random_batch()
    g = torch.Generator().manual_seed(5)
    signals = torch.randn(3, ids.shape[0], generator=g)  # three objectives in one GEMM
    sums = score_sums(model, ids, attn, resp, signals, block=256)
    for o in range(3):
        squares, weighted, total = brute_force_sums(model, ids, attn, resp, signals[o])
        for n in squares:
            assert rel(sums.signal[n][o], weighted[n]) < TOL, (o, n)
            assert rel(sums.total[n], total[n]) < TOL, n


def test_float64_accumulation_is_exact_to_float64_rounding_of_the_pieces():
    # float64 model and accumulators: the reorderings (chunks, sample reductions, the GEMM) add
    # no error of their own beyond what the fp32 log-softmax leaves in both computations
    model = tiny_model("gpt2").double()
    ids, attn, resp, signal = random_batch()
    sums = score_sums(model, ids, attn, resp, signal.double(), block=256, accumulate_dtype=torch.float64)
    assert all(v.dtype == torch.float64 for v in sums.squares.values())
    assert_sums(sums, brute_force_sums(model, ids, attn, resp, signal.double()), tol=1e-5)


@pytest.mark.parametrize("mode", ["squares-only", "squares+signal", "gradient-only", "totals-only", "signal-only"])
def test_memory_modes_keep_only_the_accumulators_asked_for(mode):
    model = tiny_model("llama-tied")
    ids, attn, resp, signal = random_batch()
    kw = {"squares-only": dict(signal=None, totals=False), "squares+signal": dict(signal=signal, totals=False),
          "gradient-only": dict(signal=signal, squares=False), "totals-only": dict(signal=None, squares=False),
          "signal-only": dict(signal=signal, squares=False, totals=False)}[mode]
    sums = score_sums(model, ids, attn, resp, block=256, **kw)
    assert_sums(sums, brute_force_sums(model, ids, attn, resp, signal), squares=kw.get("squares", True),
                signal=kw["signal"] is not None, totals=kw.get("totals", True))
    per_param = {"squares-only": 4, "squares+signal": 8, "gradient-only": 8, "totals-only": 4, "signal-only": 4}[mode]
    assert sums.nbytes() == per_param * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-bias", "linear-called-twice"])
def test_one_weighted_sum_without_squares_is_one_gemm_per_linear(name, monkeypatch):
    # score sums alone (or one signal alone) need no per-sample gradient of any Linear
    from fisher_select.engine.rules.linear import LinearRule

    def refuse(*args, **kwargs):
        raise AssertionError("per-sample blocks built for a Linear in a squares-free, single-sum pass")

    model = tiny_model(name)
    ids, attn, resp, signal = random_batch()
    ref = brute_force_sums(model, ids, attn, resp, signal)
    monkeypatch.setattr(LinearRule, "contributions", refuse)
    total = score_sums(model, ids, attn, resp, squares=False)
    weighted = score_sums(model, ids, attn, resp, signal, squares=False, totals=False)
    for n in ref[0]:
        assert rel(total.total[n], ref[2][n]) < TOL, n
        assert rel(weighted.signal[n], ref[1][n]) < TOL, n


def test_modes_do_not_change_the_numbers_they_share():
    model = tiny_model("gpt2")
    ids, attn, resp, signal = random_batch()
    full = score_sums(model, ids, attn, resp, signal)
    squares_only = score_sums(model, ids, attn, resp, totals=False)
    for n in full.squares:
        assert torch.equal(squares_only.squares[n], full.squares[n]), n


@pytest.mark.parametrize("chosen", [
    {"model.layers.1.mlp.down_proj.weight", "model.norm.weight"},  # late layers: shorter backward
    {"model.embed_tokens.weight"},  # tied embedding and head: both parts, squared as one
    {"model.layers.0.mlp.down_proj.0.scale", "model.layers.0.self_attn.q_proj.weight"},  # fallback + rule
])
def test_chosen_parameters_only(chosen):
    model = tiny_model("llama-fallback")
    ids, attn, resp, signal = random_batch()
    sums = score_sums(model, ids, attn, resp, signal, params=chosen, block=256)
    assert_sums(sums, brute_force_sums(model, ids, attn, resp, signal), names=chosen)
    assert all(p.grad is None for p in model.parameters())


def test_unknown_parameter_name_is_refused():
    model = tiny_model("llama-tied")
    with pytest.raises(FisherSelectError, match="params names no parameter"):
        score_sums(model, *random_batch()[:3], params={"lm_head.weight"})  # tied: named once, as the embedding


def test_accumulators_on_cpu_take_the_copy_path():
    # On a CPU machine the accumulators' device is the compute device; accumulate_on still takes
    # the reduce-then-copy path (no in-place GEMM into the accumulator) that a GPU run uses.
    model = tiny_model("llama-tied")
    ids, attn, resp, signal = random_batch(batch=6)
    run = score_sums(model, ids[:2], attn[:2], resp[:2], signal[:2], accumulate_on="cpu", block=256)
    score_sums(model, ids[2:], attn[2:], resp[2:], signal[2:], into=run, accumulate_on="cpu", block=256)
    for d in (run.squares, run.signal, run.total):
        for t in d.values():
            assert t.device.type == "cpu"
            assert t.is_pinned() == torch.cuda.is_available()  # pinned host memory next to a GPU
    assert run.count == 6
    assert_sums(run, brute_force_sums(model, ids, attn, resp, signal))


def test_zeros_on_another_device_are_where_they_were_asked_for():
    model = tiny_model("llama-untied")
    cov = plan_coverage(model)
    sums = ScoreSums.zeros(cov, 2, device="meta", totals=False)
    assert sums.total is None
    assert all(t.device.type == "meta" for t in sums.squares.values())
    assert all(t.shape == (2, *cov.shapes[n]) for n, t in sums.signal.items())


def test_bf16_model_keeps_fp32_accumulators_through_many_batches():
    model = tiny_model("llama-untied").to(torch.bfloat16)
    ids, attn, resp, signal = random_batch()
    once = score_sums(model, ids, attn, resp, signal, block=256)
    run = None
    for _ in range(4):
        run = score_sums(model, ids, attn, resp, signal, block=256, into=run)
    for n, sq in run.squares.items():
        assert sq.dtype == torch.float32 and run.total[n].dtype == torch.float32
        assert rel(sq, 4 * once.squares[n]) < 1e-6, n  # fp32 running sums: no bf16 rounding per add
    # against the loop on the same (bf16-rounded) weights in fp32: only the bf16 forward differs
    ref = brute_force_sums(model.float(), ids, attn, resp, signal)
    for n, sq in once.squares.items():
        assert rel(sq, ref[0][n]) < 0.05, n


@pytest.mark.parametrize("where", [None, "cpu"])
def test_one_sample_per_pass_adds_in_place_like_the_reference(where):
    """Batches of one row: every dense piece holds one sample (the in-place adds of ``_Sums._add_one``),
    with two objectives' signal sums, on the accumulators' own device and on the copy path."""
    from fisher_select.engine.reference import per_sample_scores

    model = tiny_model("llama-tied")
    ids, attn, resp, signal = random_batch(batch=3)
    signals = torch.stack([signal, 1.0 - 2.0 * signal])  # (2, B)
    run = None
    for n in range(3):
        row = slice(n, n + 1)
        run = score_sums(model, ids[row], attn[row], resp[row], signals[:, row], into=run, accumulate_on=where,
                         block=256)
    scores = per_sample_scores(model, ids, attn, resp)  # float64, one backward per sample
    for name in scores[0]:
        h = torch.stack([s[name] for s in scores])  # (B, *shape)
        assert rel(run.squares[name], (h**2).sum(0)) < TOL, name
        assert rel(run.total[name], h.sum(0)) < TOL, name
        want = torch.einsum("ob,b...->o...", signals.double(), h.double())  # (2, *shape)
        assert rel(run.signal[name], want) < TOL, name
