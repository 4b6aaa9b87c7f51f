"""What the outcome study advises, shipped with the package: the rule's verdicts and a starting lr.

**Verdicts.** ``study_advice.json``, beside this file, keeps per kind the study's verdict at each budget:
the bound against the best peer, on gain and on forgetting, and whether the task discriminates.
``finding_line`` puts them in one sentence, which the run's report shows for a run of that kind.

**Learning rate.** The study (docs/OUTCOMES.md) chose each mask's lr on validation. The chosen lr
falls as the sum of |g_hat_i| over the mask grows: under Adam every selected coordinate moves by about
lr per step, so a step's first-order progress is about lr * sum |g_i|. The file holds that fit for
each kind where the study supports it. ``suggest_lr`` applies the fit to a mask, and ``lora_line``
gives the study's tuned lr for all-linear LoRA at rank 1.

``scripts/readme_outcomes.py`` writes the file from the study's records (``advice_from_records``),
and a test keeps it equal to them. The lr is a suggestion, not a promise. It was fitted on one model and task per kind. The printed line
gives how often a sweep of three points around it covered the tuned lr.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from fisher_select.report.outcome_tables import worse_than_start

ADVICE_FILE = Path(__file__).with_name("study_advice.json")
ONE_STEP = math.sqrt(10)  # the study's grids are sqrt(10) apart; a fit off by more is not shipped
LORA_ARM = "lora_all_linear_r1"


def advice_from_records(records: dict) -> dict:
    """kind -> what the study supports (``records``: kind -> ``run.outcomes.OutcomesRecord``). ``mask`` is the
    fit of log lr on log sum |g_hat| when its leave-one-out error is under one grid step, else None."""
    out = {}
    for kind, rec in sorted(records.items()):
        fit = rec.lr_advice.get("abs_g_hat", {})
        lora = rec.lr_choices.get(LORA_ARM)
        mask = None
        if fit.get("slope") is not None and fit["loo_error_factor"] < ONE_STEP:
            versus = fit.get("suggested_vs_tuned") or {}
            mask = {k: fit[k] for k in ("intercept", "slope", "r", "n", "loo_error_factor")}
            mask["covered"] = versus.get("same_point", 0) + versus.get("one_step_off", 0)  # of n masks
        out[kind] = {"model": rec.settings.get("model"), "steps": rec.settings.get("steps"),
                     "optimizer": rec.settings.get("optimizer"), "replicates": rec.settings.get("replicates"),
                     "source": f"bench/results/outcomes-{kind}.json",
                     "mask": mask, "lora_all_linear_r1": None if not lora or lora["on_edge"] else lora["chosen"],
                     "discriminates": rec.discriminates.get("discriminates"),
                     "random_content_recovered": rec.discriminates.get("random_content_recovered"),
                     "verdicts": {b: _verdict(v, rec.arms.get(f"bound@{b}")) for b, v in rec.verdicts.items()}}
    return out


def _verdict(v: dict, bound: dict | None) -> dict:
    kl = v.get("forgetting_kl") or {}
    worse = [0, 0] if bound is None else list(worse_than_start(bound))  # the bound's replicates below the start
    return {"peer": v["best_peer"], "gain": v["verdict"], "gain_difference": v["mean_difference"],
            "forgetting": kl.get("verdict"), "forgetting_difference": kl.get("mean_difference"),
            "worse_than_start": worse}


def finding_line(kind: str, advice: dict | None = None) -> str:
    """The study's verdicts for ``kind`` in one sentence, or that it has none."""
    entry = (load_advice() if advice is None else advice).get(kind)
    if not entry or not entry.get("verdicts"):
        return (f"Outcome study: no {kind} result yet (docs/OUTCOMES.md), so nothing measured says whether the "
                "bound's mask beats a random one for this kind.")
    parts = []
    for budget, v in sorted(entry["verdicts"].items(), key=lambda kv: float(kv[0])):
        forgets = "" if v["forgetting"] is None else f", forgets {v['forgetting']}"
        if v["forgetting"] is not None and v.get("forgetting_difference") is not None:  # the size: "less" may be tiny
            forgets += f" (KL per token {v['forgetting_difference']:+.2g})"
        worse, n = v["worse_than_start"]
        fell = f" and fell below the untrained model in {worse} of {n} replicates at its tuned lr" if worse else ""
        parts.append(f"at {float(budget):.3%} it {v['gain']} against {v['peer']} on gain ({v['gain_difference']:+.3f})"
                     f"{forgets}{fell}")
    task = ("the task discriminates" if entry["discriminates"] else
            f"the task does not discriminate (random at 0.01% recovers {entry['random_content_recovered']:.2f} of the "
            "content gain)") if entry.get("discriminates") is not None else "whether the task discriminates is unknown"
    return (f"Outcome study ({kind}, {entry['model']}, {entry['replicates']} replicates, {entry['steps']} AdamW steps; "
            f"{entry['source']}): the bound's mask, against the best other mask rule, " + "; ".join(parts)
            + f". {task[0].upper()}{task[1:]}.")


def load_advice(path: Path | None = None) -> dict:
    path = Path(ADVICE_FILE if path is None else path)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


@dataclass(frozen=True)
class Suggestion:
    """An lr for a mask (``lr``) from its sum of |g_hat_i| and the study's fit for ``kind``."""

    lr: float
    sum_abs_g_hat: float
    kind: str
    fit: dict
    model: str | None
    steps: int | None

    def line(self) -> str:
        f = self.fit
        low, high = self.lr / ONE_STEP, self.lr * ONE_STEP
        return (f"suggested AdamW lr for this mask: {self.lr:.2g} (sum of |g_hat| over it {self.sum_abs_g_hat:.3g}). "
                f"The outcome study's {self.kind} fit over {f['n']} masks ({self.model}, {self.steps} steps) was off by "
                f"a factor of {f['loo_error_factor']:.2f} (leave-one-out). Sweeping {low:.2g}, {self.lr:.2g} and "
                f"{high:.2g} covered the tuned lr for {f['covered']} of {f['n']} masks. Untested on other "
                "models and tasks.")


def suggest_lr(kind: str, masks: dict, grad_estimate: dict, advice: dict | None = None) -> Suggestion | None:
    """The fit of ``kind`` applied to ``masks`` (name -> bool tensor) with the run's ``grad_estimate``; None when
    the study supports no fit for that kind or the mask carries no gradient."""
    entry = (load_advice() if advice is None else advice).get(kind) or {}
    fit = entry.get("mask")
    if fit is None:
        return None
    from fisher_select.stats.ranking import masked_abs_sum  # here: the module itself loads without torch

    total = masked_abs_sum(grad_estimate, masks)  # the measure the fit was made on (studies/arms.mask_sums)
    if not total > 0:
        return None
    lr = math.exp(fit["intercept"] + fit["slope"] * math.log(total))
    return Suggestion(lr, total, kind, fit, entry.get("model"), entry.get("steps"))


def advice_line(kind: str, masks: dict, grad_estimate: dict, advice: dict | None = None) -> str:
    """What ``select`` prints: the suggestion for the mask, or why there is none."""
    advice = load_advice() if advice is None else advice
    found = suggest_lr(kind, masks, grad_estimate, advice)
    if found is not None:
        return found.line()
    if (advice.get(kind) or {}).get("mask") is not None:
        return ("no suggested lr: g_hat is zero over this mask (no sampled response carried signal to these "
                "coordinates); sweep the lr")
    return no_advice_line(kind, advice)


def no_advice_line(kind: str, advice: dict | None = None) -> str:
    """Why no lr is suggested for ``kind``, from what the study holds."""
    entry = (load_advice() if advice is None else advice).get(kind)
    if entry is None:
        return f"no suggested lr: the outcome study has no {kind} result yet (docs/OUTCOMES.md); sweep the lr"
    return (f"no suggested lr: in the outcome study's {kind} result, the mask's sum of |g_hat| did not predict the "
            "tuned lr within one grid step; sweep the lr")


def lora_line(kind: str, advice: dict | None = None) -> str | None:
    """The study's tuned lr for all-linear LoRA at rank 1 for ``kind``, or None when it has none."""
    entry = (load_advice() if advice is None else advice).get(kind) or {}
    lr = entry.get("lora_all_linear_r1")
    if lr is None:
        return None
    return (f"the outcome study tuned all-linear LoRA at rank 1 to lr {lr:.2g} for {kind} ({entry['model']}, "
            f"{entry['steps']} AdamW steps; {entry['source']}). It is a starting point for other ranks and targets, "
            "not a fit.")
