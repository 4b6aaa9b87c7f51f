"""The lr advice that select and lora print: built from the study's records, applied to a mask by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch

from fisher_select.report.study_advice import (ONE_STEP, advice_from_records, finding_line, lora_line, no_advice_line,
                                               suggest_lr)
from fisher_select.studies.arms import mask_sums

ROOT = Path(__file__).resolve().parents[1]


def _record(loo: float, lora_edge: bool = False):  # what advice_from_records reads of an OutcomesRecord
    fit = {"n": 20, "slope": -0.9, "intercept": 2.0, "r": -0.92, "loo_error_factor": loo,
           "suggested_vs_tuned": {"n": 20, "same_point": 4, "one_step_off": 15}}
    return SimpleNamespace(lr_advice={"abs_g_hat": fit, "sqrt_fs": {"slope": None}},
                           lr_choices={"lora_all_linear_r1": {"chosen": 0.01, "on_edge": lora_edge}},
                           settings={"model": "smollm2-135m-instruct", "steps": 8, "optimizer": "adamw"},
                           discriminates={}, verdicts={}, arms={})


def test_a_fit_is_shipped_only_under_one_grid_step_and_a_lora_lr_only_off_its_edge():
    advice = advice_from_records({"sft": _record(2.96), "rl": _record(ONE_STEP + 0.01, lora_edge=True)})
    assert advice["sft"]["mask"] == {"intercept": 2.0, "slope": -0.9, "r": -0.92, "n": 20, "loo_error_factor": 2.96,
                                     "covered": 19}
    assert advice["sft"]["lora_all_linear_r1"] == 0.01 and advice["sft"]["source"] == "bench/results/outcomes-sft.json"
    assert advice["rl"]["mask"] is None and advice["rl"]["lora_all_linear_r1"] is None
    assert "did not predict the tuned lr" in no_advice_line("rl", advice)
    assert "has no opd-pg result yet" in no_advice_line("opd-pg", advice)
    assert lora_line("rl", advice) is None and "lr 0.01 for sft" in lora_line("sft", advice)


def test_the_suggestion_is_the_fit_at_the_masks_sum_of_abs_g_hat():
    advice = advice_from_records({"sft": _record(2.5)})
    g = {"a": torch.tensor([[0.5, -2.0], [1.0, 0.25]]), "b": torch.tensor([-3.0, 4.0])}
    masks = {"a": torch.tensor([[True, True], [False, False]]), "b": torch.tensor([False, True])}
    found = suggest_lr("sft", masks, g, advice)
    assert found.sum_abs_g_hat == 0.5 + 2.0 + 4.0
    fisher = {n: t.abs() for n, t in g.items()}
    assert found.sum_abs_g_hat == mask_sums(masks, fisher, g, None)["abs_g_hat"]  # the study's measure, the same
    assert math.isclose(found.lr, math.exp(2.0 - 0.9 * math.log(6.5)), rel_tol=1e-12)
    assert "covered the tuned lr for 19 of 20 masks" in found.line()
    assert suggest_lr("rl", masks, g, advice) is None  # no record of that kind
    assert suggest_lr("sft", {"a": torch.zeros(2, 2, dtype=torch.bool)}, g, advice) is None  # no gradient: none


def test_the_shipped_advice_is_the_one_built_from_the_committed_results():
    from scripts.readme_outcomes import advice_text

    shipped = (ROOT / "fisher_select" / "report" / "study_advice.json").read_text(encoding="utf-8")
    assert shipped == advice_text(ROOT / "bench" / "results")
    assert isinstance(json.loads(shipped), dict)


def test_the_finding_line_states_each_budgets_verdict_on_gain_and_forgetting():
    rec = _record(2.5)
    rec.settings["replicates"] = 6
    rec.discriminates = {"discriminates": False, "random_content_recovered": 0.957}
    rec.verdicts = {"0.0001": {"best_peer": "random", "verdict": "ties", "mean_difference": -0.007,
                               "forgetting_kl": {"verdict": "less", "mean_difference": -11.7}},
                    "1e-05": {"best_peer": "random_tensor_counts", "verdict": "loses", "mean_difference": -0.037}}
    line = finding_line("sft", advice_from_records({"sft": rec}))
    assert line.startswith("Outcome study (sft, smollm2-135m-instruct, 6 replicates, 8 AdamW steps;")
    assert ("at 0.001% it loses against random_tensor_counts on gain (-0.037); at 0.010% it ties against random on "
            "gain (-0.007), forgets less (KL per token -12)") in line  # budgets in order; no forgetting verdict, none said
    assert "does not discriminate (random at 0.01% recovers 0.96 of the content gain)" in line
    assert "no rl result yet" in finding_line("rl", advice_from_records({"sft": rec}))
    rec.arms = {"bound@0.0001": {"replicates": {r: {"gain": g} for r, g in enumerate([0.1, -0.2, 0.05, -0.01])}}}
    line = finding_line("sft", advice_from_records({"sft": rec}))
    assert ("at 0.010% it ties against random on gain (-0.007), forgets less (KL per token -12) and fell below the untrained model in "
            "2 of 4 replicates at its tuned lr") in line  # a collapse at the tuned lr is said, not averaged away
    assert "1e-05" in advice_from_records({"sft": rec})["sft"]["verdicts"] and "fell below" not in line.split(";")[0]
