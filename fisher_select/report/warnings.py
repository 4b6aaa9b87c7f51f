"""The run-level warnings of a report: degenerate or unreliable results, each with its number and what to do.

Pure functions of a ``RunReport`` (report.json): ``fisher-select report`` recomputes them from the
file alone.
"""

from __future__ import annotations

import math

from fisher_select.caveats import ZERO_SCALE_WARNING
from fisher_select.report.statistics import ReportStatistics
from fisher_select.report.text import fmt
from fisher_select.run.schema import ObjectiveEntry, RunReport
from fisher_select.stats.conformity import OFF_POLICY
from fisher_select.stats.stability import STABLE


# Thresholds of the run-level warnings (each warning states the number it saw).
TRUNCATION_WARN = 0.1  # share of responses cut at max_new_tokens
RMS_Z_RANGE = (0.5, 2.0)  # score-mean check: RMS z is about 1 when samples follow the model
RELATIVE_STDERR_WARN = 0.5  # standard error of S relative to S


def run_warnings(report: RunReport) -> list[str]:
    """Degenerate or unreliable results, each with its number and what to do."""
    out = mismatch_warnings(report.checks.get("rollouts"))  # first: off-policy rollouts estimate another Fisher
    if report.truncation_rate > TRUNCATION_WARN:
        out.append(f"{report.truncation_rate:.0%} of responses were cut at max_new_tokens: a cut "
                   "response is not a full sample of the model, so F describes the truncated distribution; "
                   "raise --max-new-tokens if training uses longer responses")
    cut = report.checks.get("prompts_truncated")
    if cut:
        out.append(f"{cut} of {report.num_prompts} prompts were cut to their last tokens to fit the model's context "
                   "(--truncate-prompts): those prompts lost their beginning; shorten them to calibrate on them whole")
    out += list(report.checks.get("memory", {}).get("missing", []))  # what a reduced memory mode left out
    stats = ReportStatistics.from_json(report.statistics)
    if stats.conformity is not None:  # the share of |z| > 3, robust to heavy-tailed embedding scores
        if stats.conformity.verdict == OFF_POLICY:
            out.append(f"score-mean check: {stats.conformity.message}")
    else:  # a report without statistics: the RMS z alone
        rms_z = report.checks.get("score_mean", {}).get("rms_z")
        if rms_z is not None and math.isfinite(rms_z) and not RMS_Z_RANGE[0] <= rms_z <= RMS_Z_RANGE[1]:
            out.append(f"score-mean check: RMS z = {rms_z:.3g} (about 1 expected): the samples may not follow the "
                       "model (off-policy sampling or a bug), or few samples of heavy-tailed scores inflate z; "
                       "raise --samples-per-prompt / --num-prompts")
    if stats.stability is not None and stats.stability.verdict != STABLE:
        out.append(f"estimator stability: {stats.stability.message}")
    for o in report.objectives:
        out += [f"({o.name}) {w}" for w in _objective_warnings(o, report.num_prompts)]
    return out


def _objective_warnings(o: ObjectiveEntry, num_prompts: int) -> list[str]:
    out = list(o.warnings)
    if o.signal_scale == 0.0:
        out.append(ZERO_SCALE_WARNING)
    silent = o.details.get("prompts_without_signal")
    if silent and o.signal_scale != 0.0:
        out.append(f"{silent} of {num_prompts} prompts carried no signal (constant rewards): S rests on the rest")
    stderr = o.details.get("signal_scale_stderr")
    if stderr is not None and o.signal_scale and math.isfinite(o.signal_scale) \
            and stderr > RELATIVE_STDERR_WARN * o.signal_scale:
        out.append(f"S = {fmt(o.signal_scale)} has a standard error of {fmt(stderr)} "
                   f"({stderr / o.signal_scale:.0%}): raise --num-prompts or --samples-per-prompt for a reliable scale")
    return out


def mismatch_warnings(check: dict | None) -> list[str]:
    """Loud report warnings of a rollout run (``checks["rollouts"]``), with the numbers."""
    if not check:
        return []
    out = []
    if check.get("prompts_in_file", 0) > check.get("prompts", 0):
        out.append(f"rollouts: only the first {check['prompts']} of the file's {check['prompts_in_file']} prompts were "
                   "scored (num_prompts); pass --num-prompts to use more")
    return out + _policy_warnings(check)


def _policy_warnings(check: dict) -> list[str]:
    if check.get("verdict") == "unchecked":
        return [f"rollouts: none of the {check['responses']} responses carries the sampler's log-probability, so "
                "nothing checks they were sampled from this model at temperature 1 (off-policy rollouts estimate "
                "another Fisher); add sampler_logprob or sampler_token_logprobs to the file (docs/ROLLOUTS.md)"]
    if check.get("verdict") != "off-policy":
        return []
    return [f"OFF-POLICY ROLLOUTS: {check['off_policy_responses']} of {check['with_sampler_logprob']} responses have a "
            f"sampler log-probability that differs from this model's by more than {check['tolerance_per_token']:g} "
            f"nats per token (mean |difference| {check['mean_abs_mismatch']:.4g} nats per response, "
            f"{check['mean_abs_mismatch_per_token']:.3g} per token, max {check['max_abs_mismatch']:.4g}; "
            f"KL(sampler || model) ~ {check['kl_estimate']:.4g}; importance-weight ESS {check['importance_ess']:.1%}): "
            "these responses were not drawn from this model, so F, S and the bounds describe another distribution; "
            "calibrate on samples of this exact checkpoint (no --rollouts, or rollouts re-generated from it)"]
