"""Plain ancestral sampling: the exact distribution, the full vocabulary, no hidden top-k."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from fisher_select import FisherSelectError
from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import RLObjective
from fisher_select.calibration.prompts import PromptRecord, render_prompt
from fisher_select.engine.reference import enumerate_responses, sequence_logprob
from fisher_select.calibration.sampling import BUCKET_WASTE, SamplingConfig, buckets, sample_responses
from tests.tiny import TinyTokenizer, enumeration_model, tiny_model


def _draw(model, prompt, n, seed=0, max_new=3):
    return sample_responses(model, [prompt] * n, eos_ids={1}, pad_id=1, max_new_tokens=max_new,
                            generator=torch.Generator().manual_seed(seed))



def assert_matches_exact(counts: Counter, exact: dict, n: int) -> None:
    """Pearson chi-square of n draws' outcome counts against exact probabilities, rare outcomes pooled
    so every expected count is >= 5; fails beyond about 5 sigma of the chi-square."""
    assert set(counts) <= set(exact)
    chi2, pooled_obs, pooled_exp, df = 0.0, 0, 0.0, -1
    for outcome, p in exact.items():
        if n * p >= 5:
            chi2 += (counts[outcome] - n * p) ** 2 / (n * p)
            df += 1
        else:
            pooled_obs, pooled_exp = pooled_obs + counts[outcome], pooled_exp + n * p
    if pooled_exp > 0:
        chi2, df = chi2 + (pooled_obs - pooled_exp) ** 2 / pooled_exp, df + 1
    assert chi2 < df + 5 * math.sqrt(2 * df), (chi2, df)


def test_outcome_frequencies_match_exact_distribution():
    model = enumeration_model()
    prompt = [2, 3]
    exact = {tuple(o.response): o.prob for o in enumerate_responses(model, prompt, {1}, 3)}
    n = 4000
    counts = Counter(tuple(s.response_ids) for s in _draw(model, prompt, n))
    assert_matches_exact(counts, exact, n)


def test_recorded_logprob_and_end_flags():
    model = enumeration_model()
    for s in _draw(model, [4, 2], 64, seed=3):
        with torch.no_grad():
            ref = float(sequence_logprob(model, [4, 2], s.response_ids))
        assert abs(s.logprob - ref) < 1e-4
        assert s.ended == (s.response_ids[-1] == 1)
        assert 1 not in s.response_ids[:-1]  # nothing after the first EOS
        assert s.ended or len(s.response_ids) == 3  # truncated only at max_new_tokens


def test_seeded():
    model = enumeration_model()
    a = [s.response_ids for s in _draw(model, [2, 3], 32, seed=5)]
    b = [s.response_ids for s in _draw(model, [2, 3], 32, seed=5)]
    c = [s.response_ids for s in _draw(model, [2, 3], 32, seed=6)]
    assert a == b and a != c


@pytest.mark.parametrize("setting", [{"top_k": 50}, {"top_p": 0.9}, {"temperature": 0.7}, {"min_p": 0.05},
                                     {"typical_p": 0.9}, {"repetition_penalty": 1.1}])
def test_non_plain_sampling_is_refused(setting):
    assert SamplingConfig(**setting).problems()
    model = enumeration_model()
    with pytest.raises(FisherSelectError, match="not plain sampling"):
        calibrate(model, TinyTokenizer(5), [PromptRecord(0, "2 3", None, {})], RLObjective(lambda r, t: 0.0),
                  samples_per_prompt=2, sampling=SamplingConfig(**setting), progress=False)


def test_plain_settings_are_accepted():
    assert SamplingConfig().problems() == []
    assert SamplingConfig(top_k=0, top_p=1.0, repetition_penalty=1.0).problems() == []


def test_tokens_beyond_rank_50_appear_at_the_model_rate(embedded):
    """generate(do_sample=True) keeps only the top 50 tokens by default; our sampler must not."""
    model, tok, _ = embedded
    ids = render_prompt(tok, PromptRecord(0, "Write one sentence about the sea.", None, {}))
    expected, variance, observed = 0.0, 0.0, 0

    def observer(probs, tokens, active):
        nonlocal expected, variance, observed
        top50 = probs.topk(50, dim=-1).indices  # (B, 50)
        beyond = 1 - probs.gather(1, top50).sum(-1)  # P(rank > 50) per row
        hit = ~(top50 == tokens[:, None]).any(-1)
        expected += float(beyond[active].sum())
        variance += float((beyond * (1 - beyond))[active].sum())
        observed += int(hit[active].sum())

    sample_responses(model, [ids] * 16, eos_ids={tok.eos_token_id}, pad_id=tok.pad_token_id, max_new_tokens=24,
                     generator=torch.Generator().manual_seed(0), observer=observer)
    assert expected > 5  # the model does put mass beyond its top 50
    assert observed > 0
    assert abs(observed - expected) < 4 * math.sqrt(variance), (observed, expected, variance)


# --- throughput paths: shared prefill, length buckets merged into one cache, finished rows dropped

MIXED = [[2, 3], [4, 2, 0, 3, 3, 2, 4, 0, 2], [3], [0, 4, 4, 2, 3]]  # lengths 2, 9, 1, 5: several buckets


def test_length_buckets_bound_the_padding():
    assert buckets([2, 9, 1, 5], None) == [[2, 0, 3, 1]]  # ascending length
    parts = buckets([2, 9, 1, 5, 9, 8], 0.25)
    assert sorted(i for p in parts for i in p) == list(range(6))
    for p in parts:
        lengths = [[2, 9, 1, 5, 9, 8][i] for i in p]
        assert len(lengths) * max(lengths) <= 1.25 * sum(lengths)
    assert len(buckets([10] * 8, 0.25)) == 1


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("bucket_waste,compact", [(BUCKET_WASTE, True), (None, True), (BUCKET_WASTE, False)],
                         ids=["buckets-compact", "one-prefill-compact", "buckets-no-compact"])
def test_mixed_length_batch_records_the_unpadded_logprob(name, bucket_waste, compact):
    # each row's recorded log-probability is that of its prompt alone, unpadded: the merged,
    # left-padded bucket caches and the dropped rows change nothing but the work done
    model = enumeration_model() if name == "llama" else tiny_model("gpt2")
    eos = {1} if name == "llama" else set(range(1, 9))  # 64-token GPT-2: several EOS ids, so rows end early
    rows = [p for p in MIXED for _ in range(3)]
    drawn = sample_responses(model, rows, eos_ids=eos, pad_id=1, max_new_tokens=6,
                             generator=torch.Generator().manual_seed(2), bucket_waste=bucket_waste, compact=compact)
    assert any(s.ended for s in drawn) and any(len(s.response_ids) > 1 for s in drawn)
    for prompt, s in zip(rows, drawn):
        with torch.no_grad():
            ref = float(sequence_logprob(model, prompt, s.response_ids))
        assert abs(s.logprob - ref) < 1e-4, (prompt, s.response_ids, s.logprob, ref)
        assert s.ended == (s.response_ids[-1] in eos) and not eos & set(s.response_ids[:-1])


def test_mixed_length_batch_samples_the_exact_distribution():
    # the short prompt's rows, drawn beside longer prompts (other buckets, rows leaving the batch)
    model = enumeration_model()
    prompt = [2, 3]
    exact = {tuple(o.response): o.prob for o in enumerate_responses(model, prompt, {1}, 3)}
    counts, n = Counter(), 0
    g = torch.Generator().manual_seed(9)
    for _ in range(10):
        rows = [p for p in MIXED for _ in range(100)]
        drawn = sample_responses(model, rows, eos_ids={1}, pad_id=1, max_new_tokens=3, generator=g)
        for p, s in zip(rows, drawn):
            if p == prompt:
                counts[tuple(s.response_ids)] += 1
                n += 1
    assert_matches_exact(counts, exact, n)


def test_seeded_with_mixed_lengths():
    model = enumeration_model()
    rows = [p for p in MIXED for _ in range(4)]

    def draw(seed):
        return [s.response_ids for s in sample_responses(model, rows, eos_ids={1}, pad_id=1, max_new_tokens=5,
                                                          generator=torch.Generator().manual_seed(seed))]

    assert draw(4) == draw(4) and draw(4) != draw(5)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("compact", [True, False])
def test_one_generator_per_row_makes_a_rows_response_independent_of_its_batch(name, compact):
    """Common random numbers: with one generator per row, a row's response is the one it draws alone (float64,
    so padding cannot flip a draw), whatever other rows share the pass and whenever they end."""
    model = (enumeration_model() if name == "llama" else tiny_model("gpt2")).double()
    eos = {1} if name == "llama" else set(range(1, 9))
    rows = [p for p in MIXED for _ in range(2)]
    seeds = [100 + i for i in range(len(rows))]

    def gens(chosen):
        return [torch.Generator().manual_seed(seeds[i]) for i in chosen]

    together = sample_responses(model, rows, eos_ids=eos, pad_id=1, max_new_tokens=6, generator=gens(range(len(rows))),
                                compact=compact)
    assert len({tuple(s.response_ids) for s in together}) > 2 and any(s.ended for s in together)
    for i, row in enumerate(rows):
        alone = sample_responses(model, [row], eos_ids=eos, pad_id=1, max_new_tokens=6, generator=gens([i]))[0]
        assert alone.response_ids == together[i].response_ids and alone.ended == together[i].ended
    reordered = list(reversed(range(len(rows))))
    back = sample_responses(model, [rows[i] for i in reordered], eos_ids=eos, pad_id=1, max_new_tokens=6,
                            generator=gens(reordered), compact=compact)
    assert [s.response_ids for s in back] == [together[i].response_ids for i in reordered]
    with pytest.raises(FisherSelectError, match="2 generators for 4 rows"):
        sample_responses(model, rows[:4], eos_ids=eos, pad_id=1, max_new_tokens=2, generator=gens([0, 1]))
