"""On-policy distillation from a teacher T that shares the model's tokenizer.

- ``opd-pg`` (policy-gradient style): sequence signal ``sigma = log T(y|x) - log pi(y|x)``
  centred by its model-conditional mean, ``a = sigma - E_pi[sigma|x]``; scale
  ``E_x Var_pi(sigma|x)``. Same rules as RL: K >= 2, leave-one-out centring for the gradient
  estimate, unbiased within-prompt variance for S. Its expected gradient is that of
  ``-KL(pi || T)`` (ascent direction).
- ``opd-full`` (full vocabulary): at every state the model visits, the loss
  ``KL(pi(.|s_t) || T(.|s_t))`` with no gradient through the sampling of the states. Token
  signal ``A_t = log pi(y_t|s_t) - log T(y_t|s_t) - KL_t``; the gradient ``E_y sum_t A_t h_t`` is
  that of the summed KL (descent direction). It is bounded with the token-level Fisher
  ``F^tok_i = E_y sum_t h_{t,i}^2`` (calibrate's ``TokenLevel``) and
  ``S_tok = E_y sum_t Var_{v~pi(.|s_t)}(log pi(v|s_t) - log T(v|s_t))``, computed exactly over the
  vocabulary at each visited state; the noisier sampled-token estimate ``E_y sum_t A_t^2`` (same
  expectation) is reported beside it.

A teacher giving probability 0 to something the model can produce makes S infinite: the summary
says so (``signal_scale`` = inf and a warning) and such groups are left out of the gradient
estimate rather than turning it into NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fisher_select.calibration.objectives.config import OPD_FULL, OPD_PG, OPDFullConfig, OPDPGConfig
from fisher_select.errors import FisherSelectError
from fisher_select.calibration.objectives.teacher_based import TeacherObjective
from fisher_select.calibration.teachers import Teacher, TeacherConfig, token_tables
from fisher_select.calibration.objectives.base import (Context, Group, GroupSignal, Statistics, leave_one_out,
                                                       unbiased_variance)

_INFINITE_WARNING = (
    "the teacher gives probability 0 to {what} the model can produce: KL(pi || T) and the signal scale are "
    "infinite (no bound); {n} group(s) were left out of the gradient estimate"
)


@dataclass
class PGStatistics(Statistics):
    """Scale terms plus the groups with an infinite sigma and each finite group's mean sigma."""

    infinite_groups: int = 0
    sigma_means: list[float] = field(default_factory=list)  # per finite group: mean of sigma

    def add(self, signal: GroupSignal) -> None:
        super().add(signal)
        sigma = torch.tensor(signal.values, dtype=torch.float64)  # (K,)
        if torch.isfinite(sigma).all():
            self.sigma_means.append(float(sigma.mean()))
        else:
            self.infinite_groups += 1


@dataclass
class FullStatistics(Statistics):
    """Scale terms plus the groups with an infinite KL and each group's sampled-token scale term."""

    infinite_groups: int = 0
    sampled_terms: list[float] = field(default_factory=list)  # per group: mean_k sum_t A_t^2 (inf if infinite)

    def add(self, signal: GroupSignal) -> None:
        super().add(signal)
        if math.isinf(signal.scale_term):
            self.infinite_groups += 1
            self.sampled_terms.append(math.inf)
        else:
            sampled = [float(a.square().sum()) for a in signal.token_signal]
            self.sampled_terms.append(sum(sampled) / len(sampled))


def _infinite_warnings(what: str, n: int) -> list[str]:
    return [_INFINITE_WARNING.format(what=what, n=n)] if n else []


class OPDPGObjective(TeacherObjective):
    """PG-style on-policy distillation: a = sigma - E[sigma|x], S = E_x Var_pi(sigma|x)."""

    about = OPD_PG
    statistics_type = PGStatistics

    def signals(self, group: Group, ctx: Context) -> GroupSignal:
        log_t = self.sequence_logprobs(group, ctx)  # (K,) float64
        if torch.isnan(log_t).any():
            raise FisherSelectError(f"{self.teacher.name} gave NaN log-probabilities on {group.record.describe()}")
        sigma = log_t - torch.tensor(group.logprobs, dtype=torch.float64)  # (K,)
        if not torch.isfinite(sigma).all():  # log T = -inf: Var(sigma|x) is infinite
            return GroupSignal(torch.zeros_like(sigma), math.inf, sigma.tolist())
        return GroupSignal(leave_one_out(sigma), unbiased_variance(sigma), sigma.tolist())

    def summary(self, stats: PGStatistics) -> dict:
        means = stats.sigma_means
        kl = -sum(means) / len(means) if means else None
        return {**super().summary(stats), "reverse_kl_estimate": kl,
                "reverse_kl_meaning": "-mean(sigma): estimate of the sequence-level KL(pi || T) (finite groups)",
                "infinite_groups": stats.infinite_groups,
                "warnings": _infinite_warnings("responses", stats.infinite_groups)}


class OPDFullObjective(TeacherObjective):
    """Full-vocabulary on-policy distillation: token signal A_t, token-level Fisher, exact per-state S."""

    about = OPD_FULL
    statistics_type = FullStatistics

    def __init__(self, teacher: Teacher | TeacherConfig, sign_draws: int = 1, name: str | None = None):
        super().__init__(teacher, name)
        if sign_draws < 1:
            raise FisherSelectError(f"sign_draws must be at least 1, got {sign_draws}")
        self.sign_draws = sign_draws

    def signals(self, group: Group, ctx: Context) -> GroupSignal:
        contexts = [group.prompt_ids] * len(group.responses)
        student = token_tables(ctx.model, contexts, group.responses)  # per response (L_k, V)
        teacher = self._ready(ctx).token_tables(group)
        if any(torch.isnan(t).any() for t in teacher):
            raise FisherSelectError(f"{self.teacher.name} gave NaN log-probabilities on {group.record.describe()}")
        tokens, exact, kls = [], [], []
        for resp, lp_s, lp_t in zip(group.responses, student, teacher):
            a, var, kl = token_signal(lp_s, lp_t, torch.tensor(resp))  # (L_k,) each
            tokens.append(a)
            exact.append(float(var.sum()))
            kls.append(float(kl.sum()))
        scale_term = sum(exact) / len(exact)
        if math.isinf(scale_term) or math.isnan(scale_term):
            tokens = [torch.zeros_like(a) for a in tokens]  # the gradient is undefined: leave the group out
            scale_term = math.inf
        zeros = torch.zeros(len(group.responses), dtype=torch.float64)  # no sequence-level signal
        return GroupSignal(zeros, scale_term, kls, token_signal=tokens)

    def summary(self, stats: FullStatistics) -> dict:
        n = len(stats.sampled_terms)
        sampled = sum(stats.sampled_terms) / n if n else None
        return {**super().summary(stats), "sign_draws": self.sign_draws,
                "signal_scale_sampled": sampled,
                "signal_scale_sampled_meaning": "E_y sum_t A_t^2 at the sampled tokens (same expectation, noisier)",
                "infinite_groups": stats.infinite_groups,
                "warnings": _infinite_warnings("tokens", stats.infinite_groups)}


def token_signal(lp_student: torch.Tensor, lp_teacher: torch.Tensor, response: torch.Tensor):
    """Per visited state of one response: A_t (L,), Var_t (L,) and KL_t (L,), all float64.

    lp_student, lp_teacher: (L, V) fp32 log-softmax at the response's states; response: (L,) ids.
    Sums run over tokens with pi(v|s_t) > 0 only; where T(v|s_t) = 0 for such a token, KL_t and
    Var_t are +inf and A_t is NaN (the caller leaves the response out).
    """
    lp_s, lp_t = lp_student.double(), lp_teacher.double()
    p = lp_s.exp()  # (L, V)
    live = p > 0
    diff = torch.where(live, lp_s - lp_t, 0.0)  # log pi(v) - log T(v), +inf where T(v) = 0
    kl = (p * diff).sum(-1)  # (L,)
    var = torch.where(live, p * (diff - kl[:, None]).square(), 0.0).sum(-1)  # (L,)
    infinite = (live & torch.isinf(diff)).any(-1)
    kl = torch.where(infinite, math.inf, kl)
    var = torch.where(infinite, math.inf, var)
    picked = diff.gather(1, response[:, None]).squeeze(1)  # (L,)
    a = torch.where(infinite, math.nan, picked - kl)
    return a, var, kl


def build_opd_pg(cfg: OPDPGConfig, base_dir=None) -> OPDPGObjective:
    return OPDPGObjective(TeacherConfig(**cfg.teacher), cfg.name)


def build_opd_full(cfg: OPDFullConfig, base_dir=None) -> OPDFullObjective:
    return OPDFullObjective(TeacherConfig(**cfg.teacher), cfg.sign_draws, cfg.name)
