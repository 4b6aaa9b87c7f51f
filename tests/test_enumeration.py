"""Exact enumeration of every response of a tiny model: exact F, RL gradient and S.

The bound |g_i| <= sqrt(F_i S) must hold for every coordinate, the score must average to zero,
a prompt-only baseline must leave the gradient unchanged, and calibrate()'s Monte Carlo
estimates must agree with the exact values within their statistical error.
"""

from __future__ import annotations

import math

import pytest
import torch

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import RLObjective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.engine.reference import enumerate_responses, sequence_logprob
from tests.tiny import TinyTokenizer, enumeration_model

PROMPTS = [[2, 3], [4, 2, 0]]
MAX_NEW = 3
EOS = 1


def reward(record, text):
    """1 when the response contains token 3, 0.5 for token 2 first, else 0 (a response-only reward)."""
    ids = [int(t) for t in text.split()]
    return 1.0 if 3 in ids else (0.5 if ids[:1] == [2] else 0.0)


def _score(model, prompt, response):
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(sequence_logprob(model, prompt, response), list(params.values()))
    return {n: g.double() for n, g in zip(params, grads)}


@pytest.fixture(scope="module")
def exact():
    """Per prompt: outcomes with probabilities, scores and rewards; then the exact F, g, S."""
    model = enumeration_model()
    tok = TinyTokenizer(5)
    per_prompt = []
    for prompt in PROMPTS:
        outcomes = enumerate_responses(model, prompt, {EOS}, MAX_NEW)
        rows = []
        for o in outcomes:
            r = reward(None, tok.decode(o.response, skip_special_tokens=True))
            rows.append((o.prob, _score(model, prompt, o.response), r))
        per_prompt.append(rows)
    names = list(per_prompt[0][0][1])
    F = {n: sum(p * h[n] ** 2 for rows in per_prompt for p, h, _ in rows) / len(PROMPTS) for n in names}
    mean_h = {n: sum(p * h[n] for rows in per_prompt for p, h, _ in rows) / len(PROMPTS) for n in names}
    g, S_terms = {n: 0.0 for n in names}, []
    for rows in per_prompt:
        rbar = sum(p * r for p, _, r in rows)
        S_terms.append(sum(p * (r - rbar) ** 2 for p, _, r in rows))
        for n in names:
            g[n] = g[n] + sum(p * (r - rbar) * h[n] for p, h, r in rows) / len(PROMPTS)
    return dict(model=model, tok=tok, per_prompt=per_prompt, F=F, g=g, S=sum(S_terms) / len(PROMPTS),
                mean_h=mean_h, names=names)


def test_outcome_probabilities_sum_to_one(exact):
    for rows in exact["per_prompt"]:
        assert abs(sum(p for p, _, _ in rows) - 1.0) < 1e-5


def test_score_has_zero_mean(exact):
    for n in exact["names"]:
        scale = exact["F"][n].sqrt().max() + 1e-12
        assert float(exact["mean_h"][n].abs().max() / scale) < 1e-4, n


def test_bound_holds_for_every_coordinate(exact):
    S = exact["S"]
    assert S > 0
    tightest = 0.0
    for n in exact["names"]:
        bound = (exact["F"][n] * S).sqrt()
        assert bool((exact["g"][n].abs() <= bound * (1 + 1e-6) + 1e-12).all()), n
        tightest = max(tightest, float((exact["g"][n].abs() / (bound + 1e-30)).max()))
    assert 0 < tightest <= 1


def test_prompt_only_baseline_leaves_gradient_unchanged(exact):
    baselines = [3.7, -1.2]
    for n in exact["names"]:
        shifted = sum(
            p * (r + b) * h[n] for rows, b in zip(exact["per_prompt"], baselines) for p, h, r in rows
        ) / len(PROMPTS)
        uncentred = sum(p * r * h[n] for rows in exact["per_prompt"] for p, h, r in rows) / len(PROMPTS)
        assert torch.allclose(shifted, uncentred, atol=1e-6 * (1 + float(uncentred.abs().max())))
        assert torch.allclose(uncentred, exact["g"][n], atol=1e-6 * (1 + float(uncentred.abs().max())))


def _exact_moments(exact, fn):
    """Per-prompt mean and variance of a per-sample scalar fn(h, r) under the model."""
    out = []
    for rows in exact["per_prompt"]:
        m = sum(p * fn(h, r) for p, h, r in rows)
        v = sum(p * (fn(h, r) - m) ** 2 for p, h, r in rows)
        out.append((m, v))
    return out


@pytest.fixture(scope="module")
def monte_carlo(exact):
    records = [PromptRecord(i, " ".join(map(str, p)), None, {}) for i, p in enumerate(PROMPTS)]
    k = 600
    cal = calibrate(exact["model"], exact["tok"], records, RLObjective(reward), samples_per_prompt=k,
                    max_new_tokens=MAX_NEW, seed=1, batch_size=k, progress=False)
    return cal, k


def test_monte_carlo_fisher_agrees_within_statistical_error(exact, monte_carlo):
    cal, k = monte_carlo
    # Scalar summary q = sum_i F_i u_i with fixed random weights u: its MC estimate is a mean of
    # independent per-sample values with exactly known per-prompt variance (stratified by prompt).
    gen = torch.Generator().manual_seed(0)
    u = {n: torch.rand(exact["F"][n].shape, generator=gen, dtype=torch.float64) for n in exact["names"]}
    q = lambda h, r: float(sum((h[n] ** 2 * u[n]).sum() for n in u))  # noqa: E731
    moments = _exact_moments(exact, q)
    exact_q = sum(m for m, _ in moments) / len(moments)
    sd = math.sqrt(sum(v / k for _, v in moments)) / len(moments)
    mc_q = float(sum((cal.fisher[n].double() * u[n]).sum() for n in u))
    assert abs(mc_q - exact_q) < 4 * sd, (mc_q, exact_q, sd)  # 4 sigma
    # Per coordinate: the RMS of z-scores is about 1 when the estimator is unbiased.
    zs = []
    for n in exact["names"]:
        var = sum(sum(p * (h[n] ** 2 - sum(pp * hh[n] ** 2 for pp, hh, _ in rows)) ** 2 for p, h, _ in rows) / k
                  for rows in exact["per_prompt"]) / len(PROMPTS) ** 2
        ok = var > 1e-20
        zs.append(((cal.fisher[n].double() - exact["F"][n]) / var.sqrt())[ok])
    rms = float(torch.cat(zs).square().mean().sqrt())
    assert 0.5 < rms < 1.6, rms


def test_monte_carlo_gradient_and_scale_agree(exact, monte_carlo):
    cal, k = monte_carlo
    # Signal scale: mean over prompts of unbiased variances; its sd from the exact reward moments.
    var_terms = []
    for rows in exact["per_prompt"]:
        mu = sum(p * r for p, _, r in rows)
        m2 = sum(p * (r - mu) ** 2 for p, _, r in rows)
        m4 = sum(p * (r - mu) ** 4 for p, _, r in rows)
        var_terms.append((m4 - (k - 3) / (k - 1) * m2**2) / k)  # Var of the unbiased sample variance
    sd_s = math.sqrt(sum(var_terms)) / len(PROMPTS)
    assert abs(cal.signal_scale - exact["S"]) < 4 * sd_s, (cal.signal_scale, exact["S"], sd_s)
    # Gradient along a fixed direction u: leave-one-out estimate ~ mean of (r - rbar) u.h, whose
    # variance we take from the exact distribution, inflated by K/(K-1) for the estimated baseline.
    gen = torch.Generator().manual_seed(1)
    u = {n: torch.randn(exact["F"][n].shape, generator=gen, dtype=torch.float64) for n in exact["names"]}
    proj = lambda h: float(sum((h[n] * u[n]).sum() for n in u))  # noqa: E731
    sd = 0.0
    for rows in exact["per_prompt"]:
        rbar = sum(p * r for p, _, r in rows)
        m = sum(p * (r - rbar) * proj(h) for p, h, r in rows)
        sd += sum(p * ((r - rbar) * proj(h) - m) ** 2 for p, h, r in rows) / k * k / (k - 1)
    sd = math.sqrt(sd) / len(PROMPTS)
    exact_gu = float(sum((exact["g"][n] * u[n]).sum() for n in u))
    mc_gu = float(sum((cal.grad_estimate[n].double() * u[n]).sum() for n in u))
    assert abs(mc_gu - exact_gu) < 5 * sd, (mc_gu, exact_gu, sd)
    # The score mean is zero within its error.
    assert 0.5 < cal.checks["score_mean"]["rms_z"] < 1.6


def test_bound_object_is_sqrt_f_times_s(monte_carlo):
    cal, _ = monte_carlo
    for n, b in cal.bound().items():
        assert torch.allclose(b, (cal.fisher[n] * cal.signal_scale).sqrt())


def test_bound_with_infinite_scale_is_infinite_except_where_fisher_is_zero():
    from fisher_select.calibration.calibrator import Calibration, ObjectiveResult

    fisher = {"w": torch.tensor([0.0, 4.0])}
    cal = Calibration(fisher, {"w": torch.zeros(2)}, [ObjectiveResult("o", math.inf, {}, {})], 1, 2, 0)
    assert cal.bound()["w"].tolist() == [0.0, math.inf]


def test_grpo_normalised_signal(exact):
    """GRPO divides advantages by the group's reward std: a = (r - rbar)/std(r|x), S = share of
    prompts whose rewards vary (1 here). Exact bound, and the MC estimate within 5 sd."""
    names, per_prompt = exact["names"], exact["per_prompt"]
    g = {n: 0.0 for n in names}
    sds = []
    for rows in per_prompt:
        rbar = sum(p * r for p, _, r in rows)
        sd = math.sqrt(sum(p * (r - rbar) ** 2 for p, _, r in rows))
        sds.append(sd)
        for n in names:
            g[n] = g[n] + sum(p * (r - rbar) / sd * h[n] for p, h, r in rows) / len(PROMPTS)
    for n in names:  # S = 1: |g| <= sqrt(F)
        assert bool((g[n].abs() <= exact["F"][n].sqrt() * (1 + 1e-6) + 1e-12).all()), n
    records = [PromptRecord(i, " ".join(map(str, p)), None, {}) for i, p in enumerate(PROMPTS)]
    k = 600
    cal = calibrate(exact["model"], exact["tok"], records, RLObjective(reward, normalize="grpo"),
                    samples_per_prompt=k, max_new_tokens=MAX_NEW, seed=2, batch_size=k, progress=False)
    assert cal.signal_scale == 1.0
    gen = torch.Generator().manual_seed(1)
    u = {n: torch.randn(exact["F"][n].shape, generator=gen, dtype=torch.float64) for n in names}
    proj = lambda h: float(sum((h[n] * u[n]).sum() for n in u))  # noqa: E731
    var = 0.0
    for rows, sd in zip(per_prompt, sds):
        rbar = sum(p * r for p, _, r in rows)
        m = sum(p * (r - rbar) / sd * proj(h) for p, h, r in rows)
        var += sum(p * ((r - rbar) / sd * proj(h) - m) ** 2 for p, h, r in rows) / (k - 1)
    sd_est = math.sqrt(var) / len(PROMPTS)
    exact_gu = float(sum((g[n] * u[n]).sum() for n in u))
    mc_gu = float(sum((cal.grad_estimate[n].double() * u[n]).sum() for n in u))
    assert abs(mc_gu - exact_gu) < 5 * sd_est, (mc_gu, exact_gu, sd_est)


def test_unfinished_reward_gives_a_cut_response_its_value_exactly(exact):
    """``unfinished_reward: 0``: a response cut at max_new_tokens earns 0. The reward is still a function
    of (x, y), so the exact g and S under it obey the bound on every coordinate, and calibrate()'s
    estimates agree with them (S within 4 sd, g along a fixed direction within 5 sd) and not with the
    plain reward's (the cut responses here earn rewards, so the two differ by more than the error)."""
    ended = [[o.ended for o in enumerate_responses(exact["model"], p, {EOS}, MAX_NEW)] for p in PROMPTS]
    per_prompt = [[(p, h, r if done else 0.0) for (p, h, r), done in zip(rows, flags)]
                  for rows, flags in zip(exact["per_prompt"], ended)]
    assert any(r > 0 and not done for rows, flags in zip(exact["per_prompt"], ended)
               for (_, _, r), done in zip(rows, flags))  # the option changes something
    names, k = exact["names"], 600
    g, S_terms, var_terms, sd = {n: 0.0 for n in names}, [], [], 0.0
    gen = torch.Generator().manual_seed(1)
    u = {n: torch.randn(exact["F"][n].shape, generator=gen, dtype=torch.float64) for n in names}
    proj = lambda h: float(sum((h[n] * u[n]).sum() for n in u))  # noqa: E731
    for rows in per_prompt:
        rbar = sum(p * r for p, _, r in rows)
        m2 = sum(p * (r - rbar) ** 2 for p, _, r in rows)
        m4 = sum(p * (r - rbar) ** 4 for p, _, r in rows)
        S_terms.append(m2)
        var_terms.append((m4 - (k - 3) / (k - 1) * m2**2) / k)
        for n in names:
            g[n] = g[n] + sum(p * (r - rbar) * h[n] for p, h, r in rows) / len(PROMPTS)
        m = sum(p * (r - rbar) * proj(h) for p, h, r in rows)
        sd += sum(p * ((r - rbar) * proj(h) - m) ** 2 for p, h, r in rows) / k * k / (k - 1)
    S, sd_s, sd = sum(S_terms) / len(PROMPTS), math.sqrt(sum(var_terms)) / len(PROMPTS), math.sqrt(sd) / len(PROMPTS)
    for n in names:
        assert bool((g[n].abs() <= (exact["F"][n] * S).sqrt() * (1 + 1e-6) + 1e-12).all()), n
    records = [PromptRecord(i, " ".join(map(str, p)), None, {}) for i, p in enumerate(PROMPTS)]
    cal = calibrate(exact["model"], exact["tok"], records, RLObjective(reward, unfinished_reward=0.0),
                    samples_per_prompt=k, max_new_tokens=MAX_NEW, seed=1, batch_size=k, progress=False)
    assert abs(cal.signal_scale - S) < 4 * sd_s, (cal.signal_scale, S, sd_s)
    exact_gu = float(sum((g[n] * u[n]).sum() for n in u))
    plain_gu = float(sum((exact["g"][n] * u[n]).sum() for n in u))
    mc_gu = float(sum((cal.grad_estimate[n].double() * u[n]).sum() for n in u))
    assert abs(mc_gu - exact_gu) < 5 * sd, (mc_gu, exact_gu, sd)
    assert abs(exact_gu - plain_gu) > 10 * sd or abs(S - exact["S"]) > 10 * sd_s, (exact_gu, plain_gu, S, exact["S"])
