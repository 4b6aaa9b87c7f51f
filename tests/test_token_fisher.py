"""Token-level Fisher F^tok = E_y sum_t h_t^2, and the exact enumeration shared by the objective tests.

The Rademacher-signed backward ``u = sum_t eps_t log pi(y_t|s_t)`` has ``E_eps[(d_i u)^2] =
sum_t h_{t,i}^2``: checked exactly by enumerating all 2^L sign vectors, and statistically for
random signs against one backward per token (``reference.per_token_scores``). calibrate()'s
``TokenLevel`` estimate is compared with the exact F^tok of a tiny model whose responses can all
be enumerated. The helpers at the top (exact outcomes with token scores, teacher log-probabilities
and per-state KL terms) are imported by test_objectives_sft.py and test_objectives_distill.py.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from fisher_select import score_sums
from fisher_select.calibrate import calibrate
from fisher_select.logprob import forward_logits
from fisher_select.objectives import OPDFullObjective
from fisher_select.prompts import PromptRecord
from fisher_select.reference import enumerate_responses, per_token_scores
from fisher_select.teachers import Teacher
from tests.tiny import TinyTokenizer, enumeration_model

PROMPTS = [[2, 3], [4, 2, 0]]
MAX_NEW = 3
EOS = 1
VOCAB = 5

# ---------------------------------------------------------------------------
# Shared exact enumeration (tiny Llama, vocabulary 5, EOS = 1, up to 3 response tokens)


def student():
    return enumeration_model(seed=0, vocab=VOCAB)


def records() -> list[PromptRecord]:
    return [PromptRecord(i, " ".join(map(str, p)), None, {"answer": 3 + i}) for i, p in enumerate(PROMPTS)]


class BannedToken(nn.Module):
    """A teacher that gives one token probability 0 everywhere (its logit is -inf)."""

    def __init__(self, inner: nn.Module, token: int):
        super().__init__()
        self.inner, self.token, self.config = inner, token, inner.config

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        logits = out.logits.clone()
        logits[..., self.token] = -math.inf
        out.logits = logits
        return out


def teacher(kind: str) -> nn.Module:
    """near: the student with perturbed weights (moderate divergence, for Monte Carlo checks);
    far: independent random weights (large divergence); banned: near, but token 3 has probability 0."""
    if kind == "far":
        return enumeration_model(seed=1, vocab=VOCAB)
    near = copy.deepcopy(student())
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)  # chi-square ~0.12, light tails
    return BannedToken(near, 3).eval() if kind == "banned" else near.eval()


@dataclass
class Outcome:
    """One response of the student with everything the exact references need (float64)."""

    response: list[int]
    prob: float
    logpi: float
    ht: torch.Tensor  # (L, P) token scores, parameters flattened in named_parameters order
    table: torch.Tensor  # (L, V) student log pi(.|s_t)

    @property
    def h(self) -> torch.Tensor:  # (P,) sequence score
        return self.ht.sum(0)


@lru_cache(maxsize=None)
def student_outcomes() -> tuple[tuple[Outcome, ...], ...]:
    """Per prompt, every outcome with its exact probability and per-token scores (one backward each)."""
    model = student()
    names = [n for n, _ in model.named_parameters()]
    out = []
    for prompt in PROMPTS:
        rows = []
        for o in enumerate_responses(model, prompt, {EOS}, MAX_NEW):
            scores = per_token_scores(model, prompt, o.response)
            ht = torch.stack([torch.cat([s[n].flatten() for n in names]) for s in scores])
            table = state_tables(model, prompt, o.response)
            logpi = float(table.gather(1, torch.tensor(o.response)[:, None]).sum())
            rows.append(Outcome(o.response, o.prob, logpi, ht, table))
        out.append(tuple(rows))
    return tuple(out)


def state_tables(model, context: list[int], response: list[int]) -> torch.Tensor:
    """(L, V) float64 log-softmax at the response's states, computed alone (no padding)."""
    ids = torch.tensor([context + response])
    with torch.no_grad():
        logits = forward_logits(model, ids, torch.ones_like(ids))[0, len(context) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).double()


@dataclass
class TeacherView:
    """The teacher on one student outcome: log T(y|x) and per-state distillation terms."""

    logt: float
    a: torch.Tensor  # (L,) A_t = log pi(y_t) - log T(y_t) - KL_t
    var: torch.Tensor  # (L,) Var_{v~pi}(log pi(v) - log T(v))
    kl: torch.Tensor  # (L,) KL(pi || T) at s_t


@lru_cache(maxsize=None)
def teacher_views(kind: str, context: tuple[int, ...] = ()) -> tuple[tuple[TeacherView, ...], ...]:
    """Per prompt and outcome: the teacher's view; ``context`` ids are put before the prompt."""
    t = student() if kind == "self" else teacher(kind)
    out = []
    for prompt, rows in zip(PROMPTS, student_outcomes()):
        views = []
        for o in rows:
            lt = state_tables(t, list(context) + prompt, o.response)  # (L, V)
            p = o.table.exp()
            d = o.table - lt
            kl = torch.where(p > 0, p * d, 0.0).sum(-1)
            var = torch.where(p > 0, p * (d - kl[:, None]) ** 2, 0.0).sum(-1)
            y = torch.tensor(o.response)[:, None]
            views.append(TeacherView(float(lt.gather(1, y).sum()), d.gather(1, y).squeeze(1) - kl, var, kl))
        out.append(tuple(views))
    return tuple(out)


def param_names() -> list[str]:
    return [n for n, _ in student().named_parameters()]


def flat(tensors: dict) -> torch.Tensor:
    """A parameter-keyed dict (calibrate's output) as one float64 vector in named_parameters order."""
    return torch.cat([tensors[n].double().flatten() for n in param_names()])


def exact_fisher() -> torch.Tensor:
    """(P,) F = E_x E_y h^2."""
    return sum(sum(o.prob * o.h**2 for o in rows) for rows in student_outcomes()) / len(PROMPTS)


def exact_token_fisher() -> torch.Tensor:
    """(P,) F^tok = E_x E_y sum_t h_t^2."""
    return sum(sum(o.prob * (o.ht**2).sum(0) for o in rows) for rows in student_outcomes()) / len(PROMPTS)


def stratified_sd(per_prompt_var: list[float], k: int) -> float:
    """Standard deviation of a mean over N prompts of K-sample means, from per-prompt variances."""
    return math.sqrt(sum(v / k for v in per_prompt_var)) / len(per_prompt_var)


def moments(values: list[list[float]]) -> list[tuple[float, float]]:
    """Per prompt (mean, variance) of a per-outcome scalar under the model's distribution."""
    out = []
    for rows, vals in zip(student_outcomes(), values):
        m = sum(o.prob * v for o, v in zip(rows, vals))
        out.append((m, sum(o.prob * (v - m) ** 2 for o, v in zip(rows, vals))))
    return out


def bound_slack(g: torch.Tensor, fisher: torch.Tensor, scale: float) -> float:
    """Assert |g_i| <= sqrt(F_i S) for every coordinate; return the tightest ratio |g_i| / bound_i."""
    bound = (fisher * scale).sqrt()
    assert bool((g.abs() <= bound * (1 + 1e-6) + 1e-12).all())
    live = bound > 0
    return float((g.abs()[live] / bound[live]).max())


# ---------------------------------------------------------------------------
# The signed backward, exactly and statistically


def _one_response():
    """A 3-token response (last outcome of prompt 0) as a batch row, with its exact token scores."""
    o = student_outcomes()[0][-1]
    assert len(o.response) == 3
    ids = torch.tensor([PROMPTS[0] + o.response])
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[0, len(PROMPTS[0]) :] = True
    return o, ids, resp


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
