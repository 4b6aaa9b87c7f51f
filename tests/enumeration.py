"""Exact enumeration shared by the objective tests: a tiny Llama (vocabulary 5, EOS = 1, up to 3
response tokens) whose responses can all be listed, with token scores, teacher log-probabilities
and per-state KL terms."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from fisher_select.engine.logprob import forward_logits
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.engine.reference import enumerate_responses, per_token_scores
from tests.tiny import enumeration_model

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
