"""What a calibration returns (``Calibration``) and how it is built from the merged sums, statistics and samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fisher_select.engine.scoring import ScoreSums
from fisher_select.engine.selfcheck import rule_names
from fisher_select.stats.bounds import BoundsView
from fisher_select.stats.conformity import ScoreMeanConformity, score_mean_conformity
from fisher_select.stats.naming import module_of
from fisher_select.stats.stability import SplitHalf


@dataclass
class ObjectiveResult:
    """One objective's scale, gradient estimate and report fields."""

    name: str
    signal_scale: float | None
    grad_estimate: dict[str, torch.Tensor]
    summary: dict
    token_level: bool = False  # bounded with the token-level Fisher


@dataclass
class CalibrationDiagnostics:
    """What the report's uncertainty and stability sections need beyond F, S and g."""

    scale_terms: list[list[float]]  # per objective, per prompt: its estimate of E[a^2 | x]
    split_half: SplitHalf | None = None  # None: stability off, or a half without prompts
    conformity: ScoreMeanConformity | None = None  # None: no score sums (memory modes gradient / fisher)
    unit_names: list[str] = field(default_factory=list)  # parameter order of ``unit_masses``
    unit_masses: list[list[float]] = field(default_factory=list)  # per scoring unit: sum of h^2 per parameter
    unit_counts: list[int] = field(default_factory=list)  # per scoring unit: its samples


@dataclass
class Calibration(BoundsView):
    """Result of ``calibrate``: means over all N*K samples (not sums). Bounds: ``BoundsView``."""

    fisher: dict[str, torch.Tensor]  # F_i = mean_n h_{n,i}^2
    score_mean: dict[str, torch.Tensor]  # mean_n h_n, ~0 (a check of the sampling)
    objectives: list[ObjectiveResult]
    num_prompts: int
    num_samples: int
    num_truncated: int
    samples: list[dict] = field(default_factory=list)
    coverage: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    token_fisher: dict[str, torch.Tensor] | None = None  # F^tok, when a token-level objective ran
    diagnostics: CalibrationDiagnostics | None = None  # what the report's uncertainty and stability need
    warnings: list[str] = field(default_factory=list)  # degenerate results, one line each (also warnings.warn)
    # this process's seconds sampling and scoring, and what they handled (response tokens, samples)
    timings: dict = field(default_factory=dict)
    # MoE: per experts module (its name), how many sampled response tokens the routers sent to each expert
    # (a top-k choice counts once), over every rank; {} for a model without routed experts
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)
    # and over every real position, prompts included: an expert with none here has F = 0 exactly
    expert_positions: dict[str, list[int]] = field(default_factory=dict)

    @property
    def grad_estimate(self) -> dict[str, torch.Tensor]:
        return self.objectives[0].grad_estimate

    @property
    def truncation_rate(self) -> float:
        return self.num_truncated / max(1, self.num_samples)


def calibration_diagnostics(stats, stability, split: SplitHalf | None) -> CalibrationDiagnostics:
    """``stability``: the pass's ``calibration.stability.Stability`` (None: off)."""
    out = CalibrationDiagnostics([list(s.terms) for s in stats], split)
    if stability is not None:
        out.unit_names, out.unit_masses, out.unit_counts = stability.names, stability.unit_masses, stability.unit_counts
    return out


def score_mean_summary(c: ScoreMeanConformity) -> dict:
    """``checks["score_mean"]``: the check's headline numbers (``stats.conformity`` computes it)."""
    return {"rms_z": c.all.rms_z, "coordinates": c.all.coordinates, "share_above_3": c.robust.share_above,
            "expected_share": c.expected_share, "verdict": c.verdict,
            "meaning": "z = mean(h) / stderr per coordinate, about standard normal when E[h] = 0 holds (samples "
                       "from the model); rms_z over all coordinates, share_above_3 outside the embeddings and head"}


def build_result(loop, num_prompts: int, extra: list[dict | None]) -> tuple[Calibration, ScoreMeanConformity | None]:
    """The ``Calibration`` of a finished pass (``loop``: the ``calibrator._Calibrator``, its ranks merged), and
    the score-mean check (None without score sums: memory modes gradient / fisher)."""
    sums: ScoreSums = loop.sums
    n = sums.count
    fisher = {name: sq / n for name, sq in sums.squares.items()}
    total = sums.total or {}  # no score sums in the gradient / fisher memory modes
    score_mean = {name: t / n for name, t in total.items()}
    results = [_objective_result(loop, i, fisher, mean) for i, mean in enumerate(extra)]
    coverage = {**loop.cov.summary(), "parameter_rules": rule_names(loop.cov)}  # each parameter's rule or "fallback"
    conformity = None
    if total:  # the score-mean check: E[h] = 0 under the model (the report shows the whole check)
        heavy = {name for name in fisher if module_of(name) in set(coverage.get("embeddings") or [])}
        conformity = score_mean_conformity(fisher, score_mean, n, heavy)
        loop.checks["score_mean"] = score_mean_summary(conformity)
    cal = Calibration(fisher, score_mean, results, num_prompts, n,
                      sum(s["truncated"] for s in loop.samples), loop.samples, coverage, loop.checks,
                      expert_tokens={m: c.tolist() for m, c in sorted(sums.expert_tokens.items())},
                      expert_positions={m: c.tolist() for m, c in sorted(sums.expert_positions.items())})
    if loop.token is not None:
        cal.token_fisher = loop.token.fisher()
    return cal, conformity


def _objective_result(loop, i: int, fisher: dict, extra_mean: dict | None) -> ObjectiveResult:
    o, stats, sums = loop.objectives[i], loop.stats[i], loop.sums
    if o.token_level:
        grad = loop.token.grad_estimate(loop.token_index.index(i))
    else:
        # accumulators=fisher keeps no signal sums: no gradient estimate (said in checks["memory"])
        grad = {} if sums.signal is None else {name: s[i] / sums.count for name, s in sums.signal.items()}
    summary = o.summary(stats)
    if extra_mean is not None:  # results that need F (SFT from demonstrations)
        done = o.extra_result(extra_mean, fisher)
        summary.update(done.summary)
        grad = grad if done.grad_estimate is None else done.grad_estimate
    return ObjectiveResult(o.name, o.signal_scale(stats), grad, summary, token_level=o.token_level)
