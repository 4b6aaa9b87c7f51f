"""SFT toward a demonstrator nu: signal ``w - 1``, ``w = nu(y|x) / pi(y|x)``, scale chi-square(nu || pi).

The expected SFT gradient is ``E_nu[h]``; on the model's own samples it reads
``E_pi[(w - 1) h] = E_nu[h] - E_pi[h] = E_nu[h]``, so the bound is ``sqrt(F_i * chi2)`` with
``chi2 = E_pi[(w - 1)^2]``. Two objectives share the recipe type ``sft``:

- ``SFTObjective``: nu has a density (another model with the same tokenizer, or the model itself
  under another context: context distillation). ``log w`` is computed in fp64 from summed fp32
  log-probabilities; S from ``expm1(log w)^2`` in fp64 (no cancellation when w is near 1, inf
  only when the value itself exceeds fp64), the weight diagnostics with logsumexp.
- ``SFTDemonstrationsObjective``: only demonstrations, no density. F still comes from the
  model's own samples; S is unknown (the ranking by F holds up to that common factor). The
  demonstrations' mean score ``E_nu[h]`` is the SFT gradient estimate (the objective gives the
  demonstration rows, the calibrator scores them), and ``max_i (E_nu h_i)^2 / F_i`` is the
  smallest chi-square consistent with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fisher_select.calibration.objectives.config import SFT, SFT_DEMONSTRATIONS, SFTConfig
from fisher_select.errors import FisherSelectError
from fisher_select.calibration.prompts import PromptRecord, load_demonstrations, render_prompt
from fisher_select.calibration.objectives.teacher_based import TeacherObjective
from fisher_select.calibration.teachers import TeacherConfig
from fisher_select.calibration.objectives.base import (Context, ExtraResult, Group, GroupSignal, Objective, ScoringRow,
                                                       Statistics)

# Warn when the weights say S is unreliable (heuristics; the numbers are reported either way).
ESS_WARN = 0.5  # mean over prompts of ESS / K below this
SHARE_WARN = 0.9  # one sample carries more than this share of a prompt's weight
MEAN_WEIGHT_RANGE = (0.5, 2.0)  # E_pi[w] = 1 exactly; a sample mean outside this is suspicious
# Signals above this are clipped so the fp32 score engine cannot overflow (a warning says so).
MAX_SIGNAL = 1e30


@dataclass
class SFTStatistics(Statistics):
    """Scale terms plus, per group, the prompt index and the K log-weights (fp64 values)."""

    prompt_index: list[int] = field(default_factory=list)
    log_w: list[list[float]] = field(default_factory=list)  # per group: (K,) log w
    clipped: int = 0  # signals w - 1 above MAX_SIGNAL, clipped in the gradient estimate

    def add(self, signal: GroupSignal) -> None:
        super().add(signal)
        self.prompt_index.append(signal.prompt_index)
        self.log_w.append(list(signal.values))
        excess = torch.expm1(torch.tensor(signal.values, dtype=torch.float64))  # (K,) w - 1
        self.clipped += int((excess > MAX_SIGNAL).sum())


class SFTObjective(TeacherObjective):
    """SFT toward a demonstrator with a density: a = w - 1, S = E[(w - 1)^2] = chi-square(nu || pi)."""

    about = SFT
    statistics_type = SFTStatistics
    role = "demonstrator"

    def signals(self, group: Group, ctx: Context) -> GroupSignal:
        log_nu = self.sequence_logprobs(group, ctx)  # (K,) float64, -inf allowed
        if torch.isnan(log_nu).any():
            raise FisherSelectError(f"{self.teacher.name} gave NaN log-probabilities on {group.record.describe()}")
        log_w = log_nu - torch.tensor(group.logprobs, dtype=torch.float64)  # (K,)
        excess = torch.expm1(log_w)  # w - 1, exact near w = 1; -1 where nu(y|x) = 0
        scale_term = float(excess.square().mean())  # inf only if the term exceeds the fp64 range
        return GroupSignal(excess.clamp(max=MAX_SIGNAL), scale_term, log_w.tolist(),
                           prompt_index=group.record.index)


    def summary(self, stats: SFTStatistics) -> dict:
        log_ws = [(i, torch.tensor(lw, dtype=torch.float64)) for i, lw in zip(stats.prompt_index, stats.log_w)]
        diag = weight_diagnostics(log_ws)
        diag["clipped_signals"] = stats.clipped
        return {**super().summary(stats), "weights": diag, "warnings": self._warnings(diag, stats)}

    def _warnings(self, diag: dict, stats: SFTStatistics) -> list[str]:
        out = []
        scale = self.signal_scale(stats)
        if scale is not None and math.isinf(scale):
            out.append("chi-square overflows fp64 (some log w > 354): the bound is vacuous for this demonstrator")
        if diag["ess_mean_fraction"] is not None and diag["ess_mean_fraction"] < ESS_WARN:
            out.append(f"effective sample size is {diag['ess_mean_fraction']:.0%} of K on average (< {ESS_WARN:.0%}): "
                       "a few samples dominate, S is unreliable (usually underestimated); raise samples_per_prompt")
        if diag["prompts_dominated"]:
            out.append(f"in {diag['prompts_dominated']} prompt(s) one sample carries > {SHARE_WARN:.0%} of the weight: "
                       "S there rests on one sample")
        low, high = MEAN_WEIGHT_RANGE
        if diag["mean_weight"] is not None and not low <= diag["mean_weight"] <= high:
            out.append(f"the weights average {diag['mean_weight']:.3g} but E_pi[w] = 1: nu puts mass where the model "
                       "rarely samples, so S is likely underestimated")
        if stats.clipped:
            out.append(f"{stats.clipped} signal(s) w - 1 above {MAX_SIGNAL:g} were clipped in the gradient estimate "
                       "(S uses the unclipped log-weights)")
        return out


def weight_diagnostics(log_ws: list[tuple[int, torch.Tensor]]) -> dict:
    """Per-prompt effective sample size ``(sum w)^2 / sum w^2`` and largest weight share, from log w.

    Computed with logsumexp, so no weight is ever formed (w may overflow fp32 and fp64). A prompt
    whose weights are all zero (nu gives its samples probability 0) has neither.
    """
    per_prompt, fractions, shares, dominated = [], [], [], 0
    for index, lw in log_ws:
        lse = torch.logsumexp(lw, 0)
        ess = share = None
        if torch.isfinite(lse):
            ess = float(torch.exp(2 * lse - torch.logsumexp(2 * lw, 0)))
            share = float(torch.exp(lw.max() - lse))
            fractions.append(ess / lw.numel())
            shares.append(share)
            dominated += int(share > SHARE_WARN)
        per_prompt.append({"prompt_index": index, "ess": ess, "max_weight_share": share})
    all_lw = torch.cat([lw for _, lw in log_ws]) if log_ws else torch.zeros(0, dtype=torch.float64)
    mean_w = float(torch.exp(torch.logsumexp(all_lw, 0) - math.log(all_lw.numel()))) if all_lw.numel() else None
    return {
        "mean_weight": mean_w,  # E_pi[w] = 1 exactly
        "ess_mean_fraction": sum(fractions) / len(fractions) if fractions else None,
        "ess_min": min((p["ess"] for p in per_prompt if p["ess"] is not None), default=None),
        "max_weight_share": max(shares, default=None),
        "prompts_dominated": dominated,
        "zero_weight_samples": int(torch.isneginf(all_lw).sum()),
        "per_prompt": per_prompt,
        "meaning": "ESS = (sum w)^2 / sum w^2 over a prompt's K samples; a small ESS or a weight share near 1 "
                   "means a few samples dominate and S is unreliable",
    }


class SFTDemonstrationsObjective(Objective):
    """SFT from demonstrations without a density: S unknown, gradient = the demonstrations' mean score."""

    about = SFT_DEMONSTRATIONS

    def __init__(self, demonstrations: str | Path, append_eos: bool = True, name: str | None = None):
        super().__init__(name)
        self.path = Path(demonstrations)
        self.demos = load_demonstrations(self.path)
        self.append_eos = append_eos
        # resolved against the calibration prompts by prepare():
        self.pairs: list[tuple[PromptRecord, str]] = []  # (calibration prompt, demonstrated response)
        self.unused = 0

    def prepare(self, ctx: Context, prompts: list[PromptRecord]) -> None:
        """Match demonstrations to the calibration prompts by content; every prompt needs one."""
        by_key: dict[str, list[str]] = {}
        for d in self.demos:
            by_key.setdefault(_prompt_key(d), []).append(d.fields["response"])
        missing = [r for r in prompts if _prompt_key(r) not in by_key]
        if missing:
            raise FisherSelectError(
                f"demonstrations file {self.path} has no demonstration for {missing[0].describe()} "
                f"({len(missing)} of {len(prompts)} calibration prompts lack one); each line needs the "
                "\"prompt\" or \"messages\" of a line of the prompts file and a \"response\""
            )
        # Each demonstration line counts once: a prompt repeated in the prompts file is paired with its
        # demonstrations once, so its weight in E_nu[h] is its number of demonstration lines.
        first = {}
        for r in prompts:
            first.setdefault(_prompt_key(r), r)
        self.pairs = [(r, resp) for key, r in first.items() for resp in by_key[key]]
        self.unused = sum(len(v) for k, v in by_key.items() if k not in first)

    def signals(self, group: Group, ctx: Context) -> GroupSignal:
        # No density: no per-sample signal. The gradient estimate comes from the extra rows.
        return GroupSignal(torch.zeros(len(group.responses), dtype=torch.float64), float("nan"))

    def signal_scale(self, stats: Statistics) -> float | None:
        return None

    def scale_stderr(self, stats: Statistics) -> float | None:
        return None

    def extra_rows(self, ctx: Context) -> list[ScoringRow]:
        """The demonstration pairs as prompt + response rows: their mean score is E_nu[h]."""
        if not self.pairs:
            raise FisherSelectError("no demonstration pairs: prepare(ctx, prompts) must run first (calibrate does)")
        return demonstration_rows(ctx.tokenizer, self.pairs, self.append_eos)

    def extra_result(self, mean_score: dict[str, torch.Tensor], fisher: dict[str, torch.Tensor]) -> ExtraResult:
        """E_nu[h] (the rows' mean score) replaces the gradient estimate; chi-square lower bound from F."""
        return ExtraResult(mean_score, demonstration_summary(mean_score, fisher, self.path, len(self.pairs),
                                                             self.unused))

    def summary(self, stats: Statistics) -> dict:
        return {**super().summary(stats), "prompts_without_signal": None}

    def describe(self) -> dict:
        return {**super().describe(), "demonstrations_file": str(self.path), "append_eos": self.append_eos}


def demonstration_summary(mean: dict[str, torch.Tensor], fisher: dict[str, torch.Tensor], path: Path,
                          pairs: int, unused: int) -> dict:
    """Report fields of SFT from demonstrations, from their mean score and the model Fisher."""
    bound = chi_square_lower_bound(mean, fisher)
    norm = math.sqrt(sum(float(m.double().square().sum()) for m in mean.values()))
    return {
        "signal_scale_status": "unknown: demonstrations have no density; bounds are sqrt(F), "
                               "the ranking holds up to the common factor sqrt(chi-square)",
        "demonstrations": {"file": str(path), "pairs": pairs, "unused_lines": unused,
                           "mean_score_norm": norm,
                           "mean_score_meaning": "E_nu[h] over the demonstration pairs: the SFT gradient estimate"},
        "chi_square_lower_bound": bound,
        "warnings": _demo_warnings(bound),
    }


def _prompt_key(record: PromptRecord) -> str:
    """What identifies a prompt: its conversation (a bare prompt is one user turn)."""
    messages = record.messages or [{"role": "user", "content": record.prompt}]
    return json.dumps([[m["role"], m["content"]] for m in messages])


def demonstration_rows(tok, pairs: list[tuple[PromptRecord, str]], append_eos: bool) -> list[ScoringRow]:
    """One prompt + response row per demonstration pair (the response tokenized without special tokens)."""
    eos = tok.eos_token_id
    if append_eos and eos is None:
        raise FisherSelectError("append_eos is set but the tokenizer has no EOS token")
    rows = []
    for record, response in pairs:
        prompt = render_prompt(tok, record)
        resp = list(tok(response, add_special_tokens=False)["input_ids"]) + ([eos] if append_eos else [])
        if not resp:
            raise FisherSelectError(
                f"an empty demonstration for {record.describe()}: give a response or set append_eos")
        rows.append(ScoringRow(prompt + resp, len(prompt)))
    return rows


def chi_square_lower_bound(mean: dict[str, torch.Tensor], fisher: dict[str, torch.Tensor]) -> dict:
    """``max_i (E_nu h_i)^2 / F_i``: Cauchy-Schwarz read backwards, over coordinates with F_i > 0.

    Coordinates with F_i = 0 (no model sample touched them) but a nonzero mean score are counted:
    there the sampled Fisher misses what the demonstrations move.
    """
    best, where, unseen = 0.0, None, 0
    for name, m in mean.items():
        f = fisher[name]  # fp32, like m: one pass per tensor, no fp64 copies of a whole model
        seen = f > 0
        unseen += int(((~seen) & (m != 0)).sum())
        if seen.any():
            ratio = torch.where(seen, m.square() / torch.where(seen, f, 1.0), 0.0)
            value, index = ratio.flatten().max(0)
            if float(value) > best:
                best, where = float(value), {"parameter": name, "index": int(index)}
    return {"value": best, "at": where, "coordinates_with_zero_fisher": unseen,
            "label": "noisy lower bound on chi-square(nu || pi): max over coordinates of (E_nu h_i)^2 / F_i "
                     "from Monte Carlo estimates (noise biases the max upwards)"}


def _demo_warnings(bound: dict) -> list[str]:
    out = ["signal scale unknown: no density for the demonstrations; the bound sqrt(F) ranks coordinates "
           "but has no absolute scale"]
    if bound["coordinates_with_zero_fisher"]:
        out.append(f"{bound['coordinates_with_zero_fisher']} coordinate(s) have F = 0 in the model's samples but a "
                   "nonzero demonstration gradient: raise samples_per_prompt or num_prompts")
    return out


def build_sft(cfg: SFTConfig, base_dir=None) -> Objective:
    if cfg.demonstrator is not None:
        return SFTObjective(TeacherConfig(**cfg.demonstrator), cfg.name)
    path = Path(cfg.demonstrations)  # made absolute by load_recipe; else relative to base_dir
    if base_dir is not None and not path.is_absolute():
        path = Path(base_dir) / path
    return SFTDemonstrationsObjective(path.resolve(), cfg.append_eos, cfg.name)
