"""Token-level Fisher F^tok = E_y sum_t h_t^2.

The Rademacher-signed backward ``u = sum_t eps_t log pi(y_t|s_t)`` has ``E_eps[(d_i u)^2] =
sum_t h_{t,i}^2``: checked exactly by enumerating all 2^L sign vectors, and statistically for
random signs against one backward per token (``reference.per_token_scores``). calibrate()'s
``TokenLevel`` estimate is compared with the exact F^tok of a tiny model whose responses can all
be enumerated.
"""

from __future__ import annotations

import itertools
import math

import torch

from fisher_select import score_sums
from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import OPDFullObjective
from fisher_select.calibration.teachers import Teacher
from tests.enumeration import (
    MAX_NEW,
    PROMPTS,
    VOCAB,
    _one_response,
    exact_fisher,
    exact_token_fisher,
    flat,
    records,
    stratified_sd,
    student,
    student_outcomes,
    teacher,
)
from tests.tiny import TinyTokenizer


def test_all_sign_vectors_average_to_sum_of_token_squares():
    """E_eps[(d u)^2] = sum_t h_t^2 exactly: average over all 2^3 sign vectors, one batch row each."""
    o, ids, resp = _one_response()
    signs = torch.tensor(list(itertools.product([1.0, -1.0], repeat=3)))  # (8, 3)
    weights = torch.zeros(8, ids.shape[1])
    weights[:, len(PROMPTS[0]) :] = signs
    sums = score_sums(student(), ids.repeat(8, 1), torch.ones(8, ids.shape[1], dtype=torch.long),
                      resp.repeat(8, 1), token_weights=weights)
    mean_sq = flat(sums.squares) / 8
    exact = (o.ht**2).sum(0)
    assert float((mean_sq - exact).abs().max() / exact.abs().max()) < 1e-5
    # and it differs from the sequence square (h summed over tokens) whenever tokens interact
    assert float((o.h**2 - exact).abs().max() / exact.abs().max()) > 1e-2


def test_random_signs_converge_to_token_fisher():
    """Mean of (d u)^2 over R random sign draws vs sum_t h_t^2 from one backward per token.

    For the drawn signs the mean is exactly sum_t h_t^2 + 2 sum_{s<t} m_st h_s h_t with
    m_st = mean_r eps_s eps_t (checked per coordinate, relative 1e-5); the cross term has mean 0
    and, along a fixed direction u, variance 4 sum_{s<t} (u.(h_s h_t))^2 / R: |z| < 4.
    """
    o, ids, resp = _one_response()
    reps = 512
    gen = torch.Generator().manual_seed(3)
    eps = torch.randint(0, 2, (reps, 3), generator=gen) * 2.0 - 1  # (R, L)
    weights = torch.zeros(reps, ids.shape[1])
    weights[:, len(PROMPTS[0]) :] = eps
    sums = score_sums(student(), ids.repeat(reps, 1), torch.ones(reps, ids.shape[1], dtype=torch.long),
                      resp.repeat(reps, 1), token_weights=weights)
    mean_sq = flat(sums.squares) / reps
    ht = o.ht
    exact = (ht**2).sum(0)
    pairs = [(s, t) for s in range(3) for t in range(s + 1, 3)]
    cross = sum(2 * float((eps[:, s] * eps[:, t]).double().mean()) * ht[s] * ht[t] for s, t in pairs)
    assert float((mean_sq - exact - cross).abs().max() / exact.abs().max()) < 1e-5
    u = torch.rand(exact.shape, generator=gen, dtype=torch.float64)
    sd = math.sqrt(sum(4 * float((ht[s] * ht[t] * u).sum()) ** 2 for s, t in pairs) / reps)
    assert abs(float(((mean_sq - exact) * u).sum())) < 4 * sd


def test_token_fisher_equals_sequence_fisher_in_expectation():
    """Under the model's own sampling the cross terms E[h_s h_t] (s < t) vanish, so F^tok = F exactly.

    (The two estimators differ only in their noise; this is an identity of the exact values.)
    """
    f, ftok = exact_fisher(), exact_token_fisher()
    assert float((f - ftok).abs().max() / f.abs().max()) < 1e-5


def test_calibrate_token_fisher_matches_exact():
    """calibrate()'s TokenLevel F^tok (K = 128 per prompt, 2 sign draws) vs the exact F^tok.

    Scalar check along a fixed positive direction u: per-sample estimate q = mean over draws of
    sum_i u_i (d_i u)^2; Var = Var_y(sum_t u.h_t^2) + E_y[4 sum_{s<t} (sum_i u_i h_s,i h_t,i)^2] / draws.
    Tolerance 4 standard deviations.
    """
    k, draws = 128, 2
    objective = OPDFullObjective(Teacher(teacher("near")), sign_draws=draws)
    cal = calibrate(student(), TinyTokenizer(VOCAB), records(), objective, samples_per_prompt=k,
                    max_new_tokens=MAX_NEW, seed=5, batch_size=k, progress=False)
    gen = torch.Generator().manual_seed(4)
    u = torch.rand(exact_token_fisher().shape, generator=gen, dtype=torch.float64)
    variances = []
    for rows in student_outcomes():
        q = [float(((o.ht**2).sum(0) * u).sum()) for o in rows]
        mean = sum(o.prob * v for o, v in zip(rows, q))
        var_y = sum(o.prob * (v - mean) ** 2 for o, v in zip(rows, q))
        sign_var = sum(o.prob * sum(4 * float((o.ht[s] * o.ht[t] * u).sum()) ** 2
                                    for s in range(len(o.response)) for t in range(s + 1, len(o.response)))
                       for o in rows)
        variances.append(var_y + sign_var / draws)
    sd = stratified_sd(variances, k)
    mc = float((flat(cal.token_fisher) * u).sum())
    exact = float((exact_token_fisher() * u).sum())
    assert abs(mc - exact) < 4 * sd, (mc, exact, sd)
    assert cal.fisher_for(objective.name) is cal.token_fisher
