"""Protocol v2 of the outcome study (fisher_select.studies) on tiny models, in seconds: the cell cache,
lr grid extension, paired statistics against brute-force references, the frozen teacher, and a whole
study from replicates' own calibrations to the assembled record."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats as sps

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import OPDPGObjective, SFTDemonstrationsObjective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.calibration.config import TeacherConfig
from fisher_select.errors import FisherSelectError
from fisher_select.models import fingerprint
from fisher_select.run.outcomes import OUTCOMES_PROTOCOL, read_outcomes
from fisher_select.studies import measures
from fisher_select.studies.arms import arm_masks, mask_sums, random_with_counts
from fisher_select.studies.assemble import assemble
from fisher_select.studies.cell_run import Replicate
from fisher_select.studies.cells import CellCache, CellKey, Clock, cell_costs, read_cells
from fisher_select.studies.grid import STEP, choose_lr, lr_grid
from fisher_select.studies.paired import paired, trained
from fisher_select.studies.protocol import ProtocolV2, draw
from fisher_select.studies.outcome_plots import gain_vs_forgetting, panels
from fisher_select.studies.study import run_study
from fisher_select.report.outcome_tables import record_markdown
from fisher_select.studies.loop import TrainConfig, make_task, train
from fisher_select.calibration.objectives.base import Context
from tests.runs import make_run
from tests.test_validate import DemoTokenizer
from tests.tiny import tiny_model

# --- the cell cache ------------------------------------------------------------------------------------------


def _cache(tmp_path, protocol="p1"):
    return CellCache(tmp_path / "cells", {0: {"protocol": protocol, "model": "m"}, 1: {"protocol": protocol}})


def test_a_resume_skips_finished_cells_and_a_changed_protocol_redoes_them(tmp_path):
    calls = []
    keys = [CellKey("sft", r, "bound", 1e-3, lr, "held_out") for r in (0, 1) for lr in (1e-3, 1e-2)]

    def compute(key):
        calls.append(key)
        return {"value": key.lr * (key.replicate + 1)}

    first = _cache(tmp_path)
    got = [first.run(k, lambda k=k: compute(k)) for k in keys]
    assert len(calls) == 4 and first.computed == 4 and first.skipped == 0
    again = _cache(tmp_path)  # a new session over the same folder
    assert [again.run(k, lambda k=k: compute(k)) for k in keys] == got
    assert len(calls) == 4 and again.skipped == 4
    changed = _cache(tmp_path, protocol="p2")
    changed.run(keys[0], lambda: compute(keys[0]))
    assert len(calls) == 5 and changed.computed == 1  # another protocol: the old cell is not reused
    assert not [p for p in (tmp_path / "cells").iterdir() if p.name.startswith(".")]  # no temporaries left
    cells = read_cells(tmp_path / "cells")
    assert len(cells) == 5 and {c["context"]["protocol"] for c in cells} == {"p1", "p2"}
    with pytest.raises(FisherSelectError, match="cells of 2 different protocol settings .* move the cells"):
        assemble(tmp_path / "cells")  # old and new protocols are never mixed into one table
    with pytest.raises(FisherSelectError, match="no finished cell of kind rl"):
        assemble(tmp_path / "cells", kind="rl")


def test_the_studys_extent_is_not_part_of_a_cells_hash_but_what_a_cell_does_is():
    base = ProtocolV2("sft")
    wider = dataclasses.replace(base, replicates=8, budgets=(1e-5, 1e-2, 0.05), grid_points=5, grid_cap=12,
                                bootstrap=500, arms=base.arms + ("magnitude",))
    assert wider.cell_settings() == base.cell_settings()  # more replicates, budgets or arms keep finished cells
    for change in ({"steps": 9}, {"seed": 1}, {"max_new_tokens": 17}, {"train_prompts": 40}, {"optimizer": "sgd"}):
        assert dataclasses.replace(base, **change).cell_settings() != base.cell_settings(), change


def test_a_calibration_redone_the_same_way_keeps_the_cells_identity():
    from types import SimpleNamespace
    from fisher_select.studies.study import calibration_identity

    def run(run_id, prompts, seed=3):
        report = SimpleNamespace(config={"model": "m", "prompts": prompts, "device": "cpu", "seed": seed},
                                 seed=seed, num_prompts=48)
        return SimpleNamespace(report=report, run_id=run_id)

    assert calibration_identity(run("a", "x/r0.jsonl")) == calibration_identity(run("b", "/elsewhere/r0.jsonl"))
    assert calibration_identity(run("a", "x", seed=3)) != calibration_identity(run("a", "x", seed=4))
    no_recipe = SimpleNamespace(report=SimpleNamespace(config=None), run_id="rep0")
    assert calibration_identity(no_recipe) == "rep0"


def test_a_cell_file_edited_by_hand_is_not_trusted(tmp_path):
    cache = _cache(tmp_path)
    key = CellKey("rl", 0, "random", 1e-4, 0.1, "pilot")
    path = cache.put(key, {"validation": 1.0})
    cell = json.loads(path.read_text())
    cell["context"]["model"] = "another"
    path.write_text(json.dumps(cell))
    assert cache.get(key) is None and read_cells(tmp_path / "cells") == []


def test_the_time_budget_stops_before_a_cell_would_overrun(tmp_path):
    cache = _cache(tmp_path)
    key = CellKey("sft", 0, "full", None, 1e-5, "pilot")
    clock = Clock(minutes=0.5, guess_s=60.0)  # a cell is guessed at a minute: it does not fit in 30 s
    assert cache.run(key, lambda: {"validation": 1.0}, clock) is None and clock.stopped
    assert not (tmp_path / "cells").exists() or not list((tmp_path / "cells").iterdir())
    roomy = Clock(minutes=5, guess_s=1.0)
    done = cache.run(key, lambda: {"validation": 1.0}, roomy)
    assert done == {"validation": 1.0, "cell_seconds": roomy.seen[0]} and len(roomy.seen) == 1


def test_the_time_budget_also_covers_loading_a_replicate(tmp_path):
    clock = Clock(minutes=3, guess_s=60.0)
    assert clock.fits(loading=True)  # no load seen yet: a 60 s cell fits in 3 minutes
    clock.record_load(150.0)  # a calibration took 150 s: it and a 60 s cell do not fit
    assert clock.fits() and not clock.fits(loading=True) and clock.stopped
    protocol = ProtocolV2("sft", replicates=2, train_prompts=4, validation_prompts=2, heldout_prompts=2,
                          budgets=(0.05,), arms=("bound", "full"), grid_cap=5, steps=1, prompts_per_step=2,
                          samples_per_prompt=1, max_new_tokens=3, bootstrap=100)
    loaded = []

    def load(r):  # a load would calibrate (minutes): with no room for a cell after it, it must not start
        loaded.append(r)
        raise AssertionError("loaded a replicate no cell of which fits the budget")

    out = run_study(protocol, tmp_path / "cells", load, budget_minutes=0.005)  # 0.3 s; a cell is guessed at 60 s
    assert loaded == [] and not out["finished"] and out["stopped_by_budget"] and out["computed"] == 0


# --- lr grids ------------------------------------------------------------------------------------------------


def _valley(best_lr):
    """A validation loss with its minimum at ``best_lr`` (lower is better), and the lrs it was asked for."""
    asked = []

    def evaluate(lr):
        asked.append(lr)
        return (math.log10(lr) - math.log10(best_lr)) ** 2

    return evaluate, asked


def test_grid_points_are_spaced_by_sqrt_10():
    assert lr_grid(1e-4, 4) == pytest.approx([1e-4, 1e-4 * STEP, 1e-3, 1e-3 * STEP])


def test_a_choice_on_the_upper_edge_extends_the_grid_until_it_is_inside():
    evaluate, asked = _valley(0.3)
    choice = choose_lr(evaluate, lr_grid(1e-4, 4), higher_is_better=False, cap=12)
    assert choice.chosen == pytest.approx(1e-4 * STEP**7)  # 0.316, the grid point nearest 0.3
    # points 4..7 reach it, point 8 shows it is not on the edge any more
    assert not choice.on_edge and choice.extended == 5 and len(asked) == 9
    assert choice.grid == pytest.approx(lr_grid(1e-4, 9))


def test_a_choice_on_the_lower_edge_extends_downward():
    evaluate, _ = _valley(1e-6)
    choice = choose_lr(evaluate, lr_grid(1e-4, 4), higher_is_better=False, cap=12)
    assert choice.chosen == pytest.approx(1e-6) and not choice.on_edge and choice.grid[0] < 1e-6


def test_the_cap_stops_the_extension_and_flags_the_edge():
    evaluate, asked = _valley(10.0)
    choice = choose_lr(evaluate, lr_grid(1e-4, 4), higher_is_better=False, cap=6)
    assert len(choice.grid) == 6 and choice.chosen == max(choice.grid) and choice.on_edge and len(asked) == 6


def test_a_diverged_run_never_wins_and_ties_take_the_smaller_lr():
    scores = {1e-3: 1.0, 1e-3 * STEP: float("nan"), 1e-2: 1.0, 1e-2 * STEP: 2.0, 0.1: 3.0}
    choice = choose_lr(lambda lr: scores[min(scores, key=lambda x: abs(x - lr))], sorted(scores),
                       higher_is_better=False, cap=5)
    assert choice.chosen == 1e-3 and choice.on_edge  # the cap is already reached


# --- paired statistics ---------------------------------------------------------------------------------------

BOUND = [0.91, 0.87, 0.95, 0.80, 0.93, 0.89]
PEER = [0.85, 0.88, 0.90, 0.71, 0.86, 0.84]


def test_paired_t_and_wilcoxon_against_brute_force():
    out = paired(BOUND, PEER, resamples=2000)
    d = np.subtract(BOUND, PEER)
    t = d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))
    assert out["mean_difference"] == pytest.approx(d.mean(), abs=1e-12)
    assert out["t_p"] == pytest.approx(2 * sps.t.sf(abs(t), len(d) - 1), rel=1e-9)
    # exact Wilcoxon signed-rank: every sign pattern of the ranked |d| (no ties, no zeros here)
    ranks = sps.rankdata(np.abs(d))
    observed = ranks[d > 0].sum()
    sums = [sum(r for r, s in zip(ranks, signs) if s) for signs in itertools.product((0, 1), repeat=len(d))]
    centre = ranks.sum() / 2
    exact = np.mean([abs(s - centre) >= abs(observed - centre) - 1e-12 for s in sums])
    assert out["wilcoxon_p"] == pytest.approx(exact, rel=1e-9)


def test_bootstrap_interval_matches_the_exact_bootstrap_distribution():
    bound, peer = [1.0, 2.5, 0.5, 3.0], [0.0, 1.0, 1.0, 1.0]
    d = np.subtract(bound, peer)
    means = sorted(np.mean([d[i] for i in idx]) for idx in itertools.product(range(4), repeat=4))  # all 256
    lo, hi = np.quantile(means, 0.025), np.quantile(means, 0.975)
    out = paired(bound, peer, resamples=200_000, seed=1)
    assert out["interval"][0] == pytest.approx(lo, abs=0.08) and out["interval"][1] == pytest.approx(hi, abs=0.08)


def test_degenerate_pairs_give_no_p_values():
    assert paired([1.0, 2.0], [1.0, 2.0])["wilcoxon_p"] is None
    assert paired([1.0], [0.5])["interval"] is None
    with pytest.raises(ValueError, match="one value per replicate"):
        paired([1.0, 2.0], [1.0])


def test_lr_advice_fits_log_lr_on_log_mask_sum_and_reports_its_leave_one_out_error():
    from fisher_select.studies.assemble import _lr_advice

    sums = [1e-3, 3e-3, 1e-2, 5e-2, 0.2]
    noise = [0.0, 0.3, -0.2, 0.1, -0.1]  # log-lr residuals
    choices = {f"m{i}": {"chosen": 1e-4 / s * math.exp(e), "on_edge": False,
                         "mask_sums": {"abs_g_hat": s, "sqrt_fs": None}} for i, (s, e) in enumerate(zip(sums, noise))}
    edge = {"chosen": 1.0, "on_edge": True, "mask_sums": {"abs_g_hat": 1e-5, "sqrt_fs": None}}  # a bound: left out
    got = _lr_advice({**choices, "edge": edge})["abs_g_hat"]
    xs, ys = np.log(sums), np.log([choices[f"m{i}"]["chosen"] for i in range(5)])
    fit = sps.linregress(xs, ys)
    assert got["slope"] == pytest.approx(fit.slope) and got["intercept"] == pytest.approx(fit.intercept)
    assert got["r"] == pytest.approx(fit.rvalue) and got["n"] == 5
    loo = []
    for i in range(5):  # brute force: refit without point i, predict it
        keep = [j for j in range(5) if j != i]
        f = sps.linregress(xs[keep], ys[keep])
        loo.append(ys[i] - (f.intercept + f.slope * xs[i]))
    assert got["loo_error_factor"] == pytest.approx(math.exp(math.sqrt(np.mean(np.square(loo)))))
    assert got["loo_error_factor"] > 1.0
    none = _lr_advice(choices)["sqrt_fs"]  # no signal scale: nothing to fit, said so
    assert none["n"] == 0 and none["slope"] is None and "nothing to fit" in none["meaning"]
    same = {k: {**c, "chosen": 1e-3} for k, c in choices.items()}  # one lr for all: no fit
    assert _lr_advice(same)["abs_g_hat"]["slope"] is None


def test_training_at_the_suggested_lr_is_scored_on_the_pilots_swept_grid_against_the_tuned_one():
    """Each mask's leave-one-out suggestion snaps to its grid's nearest point; its validation minus the chosen
    point's is the regret (lower is better here), counted by steps off, checked by brute force."""
    from fisher_select.studies.assemble import _lr_advice

    sums, noise = [1e-3, 3e-3, 1e-2, 5e-2, 0.2], [0.0, 1.5, -0.2, 0.1, -1.4]
    grid = [10 ** (k / 2) for k in range(-12, 1)]  # 1e-6 .. 1, sqrt(10) apart
    choices = {}
    for i, (s, e) in enumerate(zip(sums, noise)):
        chosen = min(grid, key=lambda g: abs(math.log(g / (1e-4 / s * math.exp(e)))))
        scores = [3.0 + (math.log10(g / chosen)) ** 2 for g in grid]  # best at the chosen lr
        choices[f"m{i}"] = {"chosen": chosen, "on_edge": False, "grid": grid, "validation": scores,
                            "mask_sums": {"abs_g_hat": s, "sqrt_fs": None}}
    got = _lr_advice(choices, higher_is_better=False)["abs_g_hat"]["suggested_vs_tuned"]
    xs = np.log(sums)
    ys = np.log([choices[f"m{i}"]["chosen"] for i in range(5)])
    steps, regrets = [], []
    for i in range(5):
        keep = [j for j in range(5) if j != i]
        f = sps.linregress(xs[keep], ys[keep])
        lr = math.exp(f.intercept + f.slope * xs[i])
        point = min(grid, key=lambda g: abs(math.log(g / lr)))
        steps.append(round(abs(math.log10(point / choices[f"m{i}"]["chosen"])) * 2))
        regrets.append(math.log10(point / choices[f"m{i}"]["chosen"]) ** 2)
    assert got["n"] == 5 and got["same_point"] == steps.count(0) and got["one_step_off"] == steps.count(1)
    assert max(steps) >= 1  # the noise puts some suggestions off the tuned point: the comparison can fail
    assert got["regret_mean"] == pytest.approx(np.mean(regrets)) and got["regret_max"] == pytest.approx(max(regrets))
    assert got["diverged"] == 0 and got["tuned_validation_mean"] == pytest.approx(3.0)


def test_a_task_discriminates_only_when_random_at_0_01_percent_recovers_under_80_percent_of_the_content_gain():
    from fisher_select.studies.arms import arm_name
    from fisher_select.studies.assemble import _discriminates

    def per(shares):
        return {arm_name("random", 1e-4): {r: {"content_recovered": s} for r, s in enumerate(shares)},
                arm_name("random", 1e-3): {0: {"content_recovered": 0.1}}}  # another budget never counts

    assert _discriminates(per([0.5, 0.7]))["discriminates"] is True
    assert _discriminates(per([0.5, 0.7]))["random_content_recovered"] == pytest.approx(0.6)
    assert _discriminates(per([0.79, 0.83]))["discriminates"] is False  # mean 0.81
    assert _discriminates({})["discriminates"] is None


def test_verdicts_pair_the_bound_with_the_best_peer_on_gain_and_on_forgetting():
    from fisher_select.studies.arms import arm_name
    from fisher_select.studies.assemble import _paired_table, _verdicts

    def reps(recovered, kl):
        return {r: {"recovered": x, "forgetting_kl": y} for r, (x, y) in enumerate(zip(recovered, kl))}

    per = {arm_name("bound", 1e-4): reps([0.90, 0.92, 0.91], [0.3, 0.4, 0.35]),
           arm_name("random", 1e-4): reps([0.95, 0.97, 0.96], [12.0, 12.5, 11.8]),  # the best gain, forgets most
           arm_name("grad_estimate", 1e-4): reps([0.80, 0.81, 0.82], [0.3, 0.5, 0.2])}
    tables = {m: _paired_table(per, [1e-4], m, 2000) for m in ("recovered", "forgetting_kl")}
    v = _verdicts(per, [1e-4], tables)["0.0001"]
    assert v["best_peer"] == "random" and v["verdict"] == "loses"
    assert v["mean_difference"] == pytest.approx(-0.05)
    assert v["forgetting_kl"]["verdict"] == "less"
    assert v["forgetting_kl"]["mean_difference"] == pytest.approx((0.3 + 0.4 + 0.35 - 12 - 12.5 - 11.8) / 3)
    per[arm_name("random", 1e-4)] = reps([0.95, 0.97, 0.96], [0.2, 0.5, 0.35])  # differences straddle 0
    tables = {m: _paired_table(per, [1e-4], m, 2000) for m in ("recovered", "forgetting_kl")}
    assert _verdicts(per, [1e-4], tables)["0.0001"]["forgetting_kl"]["verdict"] == "the same"
    # an interval that excludes 0 is not enough when the paired t-test does not agree (p >= 0.05)
    bound, random = [0.901, 0.93, 0.902, 0.96, 0.901, 0.902], [0.90] * 6  # every difference > 0, one large
    per[arm_name("random", 1e-4)] = reps(random, [0.3] * 6)
    per[arm_name("bound", 1e-4)] = reps(bound, [0.3] * 6)
    tables = {m: _paired_table(per, [1e-4], m, 2000) for m in ("recovered", "forgetting_kl")}
    v = _verdicts(per, [1e-4], tables)["0.0001"]
    stats = tables["recovered"]["bound@0.0001 vs random@0.0001"]
    assert stats["interval"][0] > 0 and stats["t_p"] == pytest.approx(sps.ttest_rel(bound, random).pvalue)
    assert stats["t_p"] >= 0.05 and v["verdict"] == "ties"


def test_the_discriminating_verdict_states_the_measured_share_beside_the_rule():
    from fisher_select.report.outcome_tables import verdict_lines
    from fisher_select.run.outcomes import OutcomesRecord
    from fisher_select.studies.arms import arm_name
    from fisher_select.studies.assemble import _discriminates

    d = _discriminates({arm_name("random", 1e-4): {0: {"content_recovered": 0.95}, 1: {"content_recovered": 0.97}}})
    record = OutcomesRecord("sft", {}, 0, False, {}, {}, {"n": 0, "rule": "r"}, None, d, {}, {}, {}, {})
    line = verdict_lines(record)[1]
    assert line.startswith("- discriminates: False (random at 0.01% recovers 0.960 of full's content gain; ")
    assert "discriminates when random at 0.0001 recovers less than 0.8" in line


def test_trained_needs_three_standard_errors():
    assert trained([1.0, 1.1, 0.9, 1.0])["trained"]
    assert trained([])["mean"] is None and trained([1.0])["se"] is None  # not judged: None, never NaN in JSON
    assert not trained([1.0])["trained"]
    noisy = trained([1.0, -0.8, 0.9, -0.7])
    assert not noisy["trained"] and noisy["se"] == pytest.approx(np.std([1.0, -0.8, 0.9, -0.7], ddof=1) / 2)


# --- arms ----------------------------------------------------------------------------------------------------


def test_random_with_the_bounds_counts_keeps_every_tensors_count():
    gen = torch.Generator().manual_seed(0)
    fisher = {"a": torch.rand(20, 10, generator=gen), "b": torch.rand(50, generator=gen) * 3}
    bound = arm_masks("bound", 0.1, fisher=fisher, grad_estimate=None, first_batch=None, seed=0)
    other = random_with_counts(bound, seed=0)
    assert {n: int(m.sum()) for n, m in other.items()} == {n: int(m.sum()) for n, m in bound.items()}
    assert any(not torch.equal(other[n], bound[n]) for n in bound)
    sums = mask_sums(bound, fisher, {n: -f for n, f in fisher.items()}, scale=4.0)
    brute = sum(math.sqrt(float(fisher[n].reshape(-1)[i])) for n in bound
                for i in range(fisher[n].numel()) if bound[n].reshape(-1)[i])
    assert sums["sqrt_fs"] == pytest.approx(2 * brute) and sums["count"] == 25
    assert sums["abs_g_hat"] == pytest.approx(sum(float(fisher[n][bound[n]].sum()) for n in bound))


# --- the frozen teacher --------------------------------------------------------------------------------------


def test_the_frozen_teacher_never_trains():
    model, tok = tiny_model("llama-tied"), DemoTokenizer(64)
    objective = OPDPGObjective(TeacherConfig(model="self", system_prompt=None, user_template="{prompt} 9 9"))
    frozen = measures.freeze_teacher(objective, model, tok)
    before = {n: p.detach().clone() for n, p in frozen.named_parameters()}
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompts = [PromptRecord(i, f"{3 + i} {5 + i} 7", None, {}) for i in range(3)]
    task = make_task(objective, Context(model, tok, "cpu"), prompts, 2, 4)
    assert task.objective.teacher.model is frozen and frozen is not model
    train(model, task, TrainConfig(3, "adamw", 0.05, 0.0, 0, 2, 2, 4, 8), progress=False)
    assert all(torch.equal(p, before[n]) for n, p in frozen.named_parameters())
    assert any(not torch.equal(p, start[n]) for n, p in model.named_parameters())  # the student did train
    assert not any(p.requires_grad for p in frozen.parameters())


def test_general_text_nll_is_the_mean_over_tokens():
    model, tok = tiny_model("llama-tied"), DemoTokenizer(64)
    text = " ".join(str(2 + i % 50) for i in range(40))
    ids = tok(text)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    brute = -float(logp.gather(-1, torch.tensor(ids[1:])[:, None]).mean())
    assert measures.general_text_nll(model, tok, text, window=len(ids)) == pytest.approx(brute, rel=1e-5)


# --- a whole study, tiny -------------------------------------------------------------------------------------


def _records(n):
    return [PromptRecord(i, " ".join(str(2 + (i * 7 + j) % 60) for j in range(3)), None,
                         {"prompt": "", "answer": 5 + i % 3}) for i in range(n)]


def _loader(tmp_path, protocol, records):
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"prompt": r.prompt, "response": str(r.fields["answer"])}) + "\n"
                             for r in records))

    def load(r):
        splits = draw(records, protocol, r)
        model, tok = tiny_model("llama-untied"), DemoTokenizer(64)
        cal = calibrate(model, tok, splits["training"], SFTDemonstrationsObjective(demos), samples_per_prompt=2,
                        max_new_tokens=3, seed=r, progress=False)
        run = make_run(cal.fisher, objectives=[{"name": "sft", "signal_scale": None}],
                       fingerprint=fingerprint(model), run_id=f"rep{r}")
        return Replicate(r, run, model, tok, SFTDemonstrationsObjective(demos), splits,
                         grad_estimate=cal.grad_estimate, general_text=" ".join(str(2 + i % 50) for i in range(60)),
                         general_prompts=["3 4 5", "6 7 8 9", "10 11"])

    return load


def test_a_tiny_study_runs_resumes_and_assembles(tmp_path):
    records = _records(12)
    protocol = ProtocolV2("sft", replicates=2, train_prompts=4, validation_prompts=2, heldout_prompts=3,
                          budgets=(0.05,), arms=("bound", "random", "random_tensor_counts", "full"), grid_cap=5,
                          steps=2, prompts_per_step=2, samples_per_prompt=1, max_new_tokens=3, bootstrap=200)
    load = _loader(tmp_path, protocol, records)
    first = run_study(protocol, tmp_path / "cells", load)
    assert first["finished"] and first["computed"] > 0
    again = run_study(protocol, tmp_path / "cells", load)
    assert again["finished"] and again["computed"] == 0 and again["skipped"] == first["computed"]
    more = dataclasses.replace(protocol, arms=protocol.arms + ("magnitude",))  # an arm added later
    added = run_study(more, tmp_path / "cells", load)
    assert added["finished"] and added["computed"] > 0 and added["skipped"] == first["computed"]  # nothing redone
    cells = read_cells(tmp_path / "cells")
    assert all(c["result"]["cell_seconds"] >= c["result"]["training_seconds"] for c in cells)  # it includes training
    costs = cell_costs(tmp_path / "cells")
    assert sum(e["cells"] for e in costs.values()) == len(cells) == first["computed"] + added["computed"]
    pilot = sorted(c["result"]["cell_seconds"] for c in cells if c["key"]["stage"] == "pilot")
    assert costs["pilot"]["cell_seconds"]["total"] == pytest.approx(sum(pilot))
    assert costs["pilot"]["cell_seconds"]["median"] == pytest.approx(statistics.median(pilot))
    record = read_outcomes(assemble(tmp_path / "cells", resamples=200))
    assert record.protocol == OUTCOMES_PROTOCOL and record.kind == "sft"
    assert set(record.arms) == {"start", "bound@0.05", "random@0.05", "random_tensor_counts@0.05", "magnitude@0.05",
                                "full"}
    for name in ("bound@0.05", "random@0.05", "full"):
        arm = record.arms[name]
        assert set(arm["replicates"]) == {0, 1} and arm["lr"] == first["lr_choices"][name]["chosen"]
        rep = arm["replicates"][0]
        assert len(rep["held_out_per_prompt"]) == 3 and "forgetting" in rep and "content_gain" in rep
        assert rep["forgetting_kl"] is not None and (name != "start" or rep["forgetting_kl"] == pytest.approx(0))
    assert record.arms["full"]["replicates"][1]["recovered"] == pytest.approx(1.0)
    assert "bound@0.05 vs random@0.05" in record.paired["recovered"]
    assert record.paired["recovered"]["bound@0.05 vs random@0.05"]["n"] == 2
    assert set(record.on_edge()) <= set(record.lr_choices)
    assert len(record.lr_choices["full"]["grid"]) >= 4
    verdict = record.verdicts["0.05"]
    assert verdict["best_peer"] in ("random", "random_tensor_counts", "magnitude") and verdict["n"] == 2
    assert record.arms["start"]["replicates"][0]["forgetting_kl"] == pytest.approx(0, abs=1e-5)  # its own responses
    lo, hi = verdict["interval"]
    pair = record.paired["recovered"][f"bound@0.05 vs {verdict['best_peer']}@0.05"]
    decisive = pair["t_p"] is None or pair["t_p"] < 0.05
    assert verdict["verdict"] == ("wins" if lo > 0 and decisive else "loses" if hi < 0 and decisive else "ties")
    kl = record.paired["forgetting_kl"][f"bound@0.05 vs {verdict['best_peer']}@0.05"]
    assert verdict["forgetting_kl"]["mean_difference"] == kl["mean_difference"]  # against the same peer
    assert record.training_rows["signal_share"] == 1.0 and record.training_rows["finished_share"] is None
    table = "\n".join(record_markdown(record))
    assert "| bound@0.05 |" in table and "bound@0.05 vs random@0.05" in table and "- trained:" in table
    row = next(line for line in table.splitlines() if line.startswith("| bound@0.05 |"))
    gains = [m["gain"] for m in record.arms["bound@0.05"]["replicates"].values()]
    assert row.endswith(f"| {sum(g < 0 for g in gains)} | {len(gains)} |")  # worse than start, replicates
    by_budget, references = panels(record)  # the figure: each budget's arms in its panel, full in every one
    assert list(by_budget) == [0.05] and [p[0] for p in references] == ["full"]
    assert sorted(p[0] for p in by_budget[0.05]) == ["bound", "magnitude", "random", "random_tensor_counts"]
    bound = next(p for p in by_budget[0.05] if p[0] == "bound")
    assert bound[1] == record.arms["bound@0.05"]["recovered"]["mean"]
    assert bound[3] == record.arms["bound@0.05"]["forgetting"]["mean"]
    gain_vs_forgetting(tmp_path / "gain.png", record)
    assert (tmp_path / "gain.png").stat().st_size > 0
    _check_the_product_shows_it(tmp_path, record, load)


def test_a_finished_replicate_is_skipped_unloaded_under_the_same_settings_and_redone_otherwise(tmp_path):
    records = _records(10)
    protocol = ProtocolV2("sft", replicates=2, train_prompts=4, validation_prompts=2, heldout_prompts=2,
                          budgets=(0.05,), arms=("bound", "full"), grid_cap=5, steps=1, prompts_per_step=2,
                          samples_per_prompt=1, max_new_tokens=3, bootstrap=100)
    load, identity = _loader(tmp_path, protocol, records), {"recipe": "a", "model": None}
    loaded = []

    def counting(r):
        loaded.append(r)
        return load(r)

    first = run_study(protocol, tmp_path / "cells", counting, identity=identity)
    assert first["finished"] and loaded == [0, 1] and sorted(p.name for p in (tmp_path / "cells/finished").iterdir()) \
        == ["r0.json", "r1.json"]
    again = run_study(protocol, tmp_path / "cells", counting, identity=identity)
    assert loaded == [0, 1] and again["finished"] and again["computed"] == 0  # neither replicate loaded again
    assert again["skipped"] == first["computed"] and again["lr_choices"] == first["lr_choices"]  # the pilot's lrs kept
    run_study(protocol, tmp_path / "cells", counting, identity={"recipe": "b", "model": None})
    assert loaded == [0, 1, 0, 1]  # another recipe: every replicate is loaded (its cells' hashes decide)
    more = dataclasses.replace(protocol, arms=protocol.arms + ("random",))  # an arm the markers do not cover
    run_study(more, tmp_path / "cells", counting, identity=identity)
    assert loaded[4:] == [0, 1]
    marker = json.loads((tmp_path / "cells/finished/r1.json").read_text())
    (tmp_path / "cells" / marker["cells"][0]).unlink()  # a cell file gone: its replicate is loaded and redone
    redo = run_study(more, tmp_path / "cells", counting, identity=identity)
    assert loaded[6:] == [1] and redo["computed"] == 1
    assert len(read_cells(tmp_path / "cells")) > 0  # the markers' folder is not read as cells


def _check_the_product_shows_it(tmp_path, record, load):
    """The run's report shows the protocol 2 tables with intervals; the README block is generated from the record."""
    from fisher_select.report.readme_outcomes import kind_table, readme_block
    from fisher_select.studies.assemble import keep_record_in_run
    from tests.runs import write_run_dir

    run_dir = write_run_dir(load(0).run, tmp_path / "run")
    folder = keep_record_in_run(record, run_dir)
    assert read_outcomes(folder / "outcomes.json").as_dict() == json.loads(json.dumps(record.as_dict()))  # JSON keys
    markdown, page = (run_dir / "report.md").read_text(), (run_dir / "report.html").read_text()
    pair = record.paired["recovered"]["bound@0.05 vs random@0.05"]
    assert "### outcomes-sft (protocol 2)" in markdown and "| bound@0.05 vs random@0.05 |" in markdown
    assert f"[{pair['interval'][0]:.3f}, {pair['interval'][1]:.3f}]" in markdown  # the interval, from the record
    assert "<h3>outcomes-sft (protocol 2)</h3>" in page and "<td>bound@0.05 vs random@0.05</td>" in page
    results = tmp_path / "results"
    results.mkdir()
    (results / "outcomes-sft-protocol1.json").write_text(json.dumps({"kind": "sft", "methods": {}}))  # skipped
    (results / "outcomes-sft.json").write_text(json.dumps(record.as_dict()))
    block = readme_block(results)
    shares = [m["recovered"] for m in record.arms["bound@0.05"]["replicates"].values()]
    verdict = record.verdicts["0.05"]
    row = next(line for line in kind_table(record) if line.startswith("| bound |"))
    assert row.startswith(f"| bound | {sum(shares) / len(shares):.2f} [")  # the mean over replicates
    assert f"**{verdict['verdict']}** vs {verdict['best_peer']}" in block and "No protocol-2 result" not in block
    assert "**No result yet for RL or distillation.**" in block  # the core's kinds without a record are named
    (results / "outcomes-rl.json").write_text(json.dumps({**record.as_dict(), "kind": "rl"}))
    assert "**No result yet for distillation.**" in readme_block(results)
    (results / "outcomes-opd-pg.json").write_text(json.dumps({**record.as_dict(), "kind": "opd-pg"}))
    assert "No result yet" not in readme_block(results)


def test_the_readme_block_says_plainly_when_no_protocol_2_result_exists(tmp_path):
    from fisher_select.report.readme_outcomes import readme_block

    (tmp_path / "outcomes-sft-protocol1.json").write_text(json.dumps({"kind": "sft", "methods": {}}))
    assert readme_block(tmp_path).startswith("**No protocol-2 result exists yet.**")
    assert readme_block(tmp_path / "missing").startswith("**No protocol-2 result exists yet.**")


def test_the_readme_verdicts_keep_small_differences_visible():
    from fisher_select.report.readme_outcomes import _difference

    assert _difference({"mean_difference": -0.00684, "interval": [-0.00951, -0.00352]}) == "-0.0068 [-0.0095, -0.0035]"
    assert _difference({"mean_difference": 0.0166, "interval": [0.0011, 0.0304]}) == "+0.017 [0.001, 0.030]"
    assert _difference({"mean_difference": -7.136, "interval": [-10.19, -4.06]}) == "-7.14 [-10.19, -4.06]"
    assert _difference({"mean_difference": 0.0, "interval": [0.0, 0.0]}) == "+0.00 [0.00, 0.00]"


def test_the_core_script_runs_shipped_recipes_into_folders_of_their_own():
    import shlex
    import subprocess

    from fisher_select.recipe import recipes_dir

    script = Path(__file__).resolve().parent.parent / "bench" / "outcomes_core.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0  # it parses
    calls = [shlex.split(line)[1:4] for line in script.read_text().splitlines() if line.startswith("run ")]
    assert [kind for kind, _, _ in calls] == ["sft", "opd-pg", "rl"]
    assert all((recipes_dir() / f"{recipe}.yaml").is_file() for _, recipe, _ in calls)
    folders = [cells for _, _, cells in calls]
    assert len(set(folders)) == len(folders) and "bench/results/cells/rl" not in folders  # old RL cells kept apart


def test_the_readme_rewriter_replaces_only_the_marked_block(tmp_path):
    from fisher_select.report.readme_outcomes import BEGIN, END, rewrite_block
    from scripts.readme_outcomes import main as readme_main

    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    assert rewrite_block(readme, "new table") is True
    assert readme.read_text() == f"# title\n\nbefore\n{BEGIN}\nnew table\n{END}\nafter\n"
    assert rewrite_block(readme, "new table") is False  # unchanged: nothing written
    advice = ["--advice", str(tmp_path / "study_advice.json")]
    assert readme_main([str(readme), "--results", str(tmp_path), "--check", *advice]) == 1  # stale against no result
    assert readme_main([str(readme), "--results", str(tmp_path), *advice]) == 0
    assert "No protocol-2 result exists yet" in readme.read_text() and readme.read_text().endswith(f"{END}\nafter\n")
    assert json.loads((tmp_path / "study_advice.json").read_text()) == {}  # no record, no advice
    assert readme_main([str(readme), "--results", str(tmp_path), "--check", *advice]) == 0
    readme.write_text("no markers here\n")
    with pytest.raises(FisherSelectError, match="must hold the markers .* once each"):
        rewrite_block(readme, "x")
    assert readme_main([str(readme), "--results", str(tmp_path), *advice]) == 2 and readme.read_text() == "no markers here\n"


def test_replicates_draw_disjoint_splits_of_their_own():
    records = _records(40)
    protocol = ProtocolV2("sft", train_prompts=20, validation_prompts=8, heldout_prompts=8)
    one, two = draw(records, protocol, 0), draw(records, protocol, 1)
    assert [r.index for r in one["training"]] != [r.index for r in two["training"]]
    assert not {r.index for r in one["training"]} & {r.index for r in one["held-out"]}
    with pytest.raises(FisherSelectError, match="draws 36 prompts per replicate .* has 10"):
        draw(records[:10], protocol, 0)
    twice = records[:30] + [PromptRecord(30 + i, r.prompt.upper(), None, {}) for i, r in enumerate(records[:10])]
    with pytest.raises(FisherSelectError, match="appear in more than one of training, validation, held-out"):
        for r in range(20):  # some draw puts a repeat in two splits
            draw(twice, protocol, r)


def test_a_protocol_1_file_is_refused_with_one_clear_error(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"kind": "sft", "methods": {}, "full": {}}))
    with pytest.raises(FisherSelectError, match="protocol 1 .* cannot be read as protocol 2; rebuild it"):
        read_outcomes(path)
    with pytest.raises(FisherSelectError, match="protocol 3"):
        read_outcomes({"protocol": 3})


@pytest.mark.slow  # about a minute: two real calibrations and the shipped prose scored with a 49k vocabulary
def test_bench_v2_pilot_cells_resume_and_assemble(tmp_path, small_llama_dir, capsys):
    """bench/outcomes.py --v2 on a small Llama: each replicate calibrates its own draw, a rerun computes
    nothing, --assemble writes the protocol 2 record and its tables from the cells alone."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_outcomes", Path(__file__).parents[1] / "bench" / "outcomes.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cells = tmp_path / "cells"
    common = ["--v2", "--kind", "sft", "--cells", str(cells), "--model", str(small_llama_dir)]
    study = [*common, "--recipe", "sft-demonstrations", "--replicates", "2", "--train-prompts", "4",
             "--validation-prompts", "2", "--heldout-prompts", "2", "--arms", "bound", "random", "full",
             "--budgets", "0.01", "--steps", "1", "--grid-cap", "5", "--prompts-per-step", "2",
             "--samples-per-prompt", "1", "--max-new-tokens", "4"]
    assert bench.main(study) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert first["finished"] and first["computed"] > 0
    assert (cells / "runs" / "r0" / "report.json").is_file() and (cells / "runs" / "r1" / "report.json").is_file()
    assert bench.main(study) == 0
    again = json.loads(capsys.readouterr().out.splitlines()[0])
    assert again["computed"] == 0 and again["skipped"] == first["computed"]
    out = tmp_path / "outcomes-sft.json"
    assert bench.main([*common, "--assemble", "--json", str(out), "--plot", str(tmp_path / "gain.png")]) == 0
    printed = capsys.readouterr().out
    record = read_outcomes(out)
    assert record.kind == "sft" and set(record.arms) == {"start", "bound@0.01", "random@0.01", "full"}
    assert "| bound@0.01 |" in printed and "bound@0.01 vs random@0.01" in printed and "- trained:" in printed
    answers = record.arms["full"]["replicates"]["0"]
    assert len(answers["held_out_per_prompt"]) == 2 and "greedy_accuracy" in answers
    assert (tmp_path / "gain.png").stat().st_size > 0
    written = sorted(p.name for p in cells.rglob("*.json"))
    assert bench.main([*study, "--time-cell", "bound", "0.01", "0.01"]) == 0  # replicate 0 is calibrated already
    timed = json.loads(capsys.readouterr().out)
    before, after = timed["before"], timed["after"]
    assert before["seconds"] > 0 and after["seconds"] > 0 and timed["cell"] == ["bound", 0.01, 0.01]
    for key in ("general_text_nll", "general_kl", "held_out"):  # the cached paths give the plain path's numbers
        assert after[key] == pytest.approx(before[key], abs=1e-4), key
    assert after["answer_nll"] == pytest.approx(before["answer_nll"], abs=1e-4)
    assert after["greedy_correct"] == before["greedy_correct"]
    assert sorted(p.name for p in cells.rglob("*.json")) == written  # timing writes no cell


@pytest.mark.parametrize("kind", ["sft", "rl", "opd-pg"])
def test_start_grids_have_four_points_spaced_by_sqrt_10_and_reach_1_for_small_masks(kind):
    protocol = ProtocolV2(kind)
    for arm, budget in protocol.cells():
        grid = protocol.start_grid(arm, budget)
        assert len(grid) >= 4 and all(b / a == pytest.approx(STEP) for a, b in zip(grid, grid[1:]))
        if budget is not None and budget <= 1e-4:
            assert max(grid) == pytest.approx(1.0)
    plan = protocol.minimum_cells()
    assert plan["pilot"] == sum(len(protocol.start_grid(a, b)) for a, b in protocol.cells())
    assert plan["held_out"] == 6 * (len(protocol.cells()) + 1) and plan["calibrations"] == 6


def _brute_greedy(model, ids, steps, eos):
    """Greedy continuation by one full forward per token (fp64 argmax of the last position)."""
    out = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1].double()
        t = int(logits.argmax())
        if t == eos:
            break
        out.append(t)
    return out


def test_answer_nll_and_greedy_correct_against_per_token_loops():
    model, tok = tiny_model("llama-tied"), DemoTokenizer(64)
    records = [PromptRecord(i, f"{3 + i} {7 + 2 * i} {11 + i}", None, {"answer": 20 + i}) for i in range(5)]
    got = measures.answer_nll(model, tok, records, micro=2)  # micro-batches of unequal prompt lengths
    for r, nll in zip(records, got):
        ids = tok(r.prompt)["input_ids"] + [int(r.fields["answer"])]  # the answer is one token here
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0, -1].double(), -1)
        assert nll == pytest.approx(-float(logp[ids[-1]]), rel=1e-5)
    greedy = [_brute_greedy(model, tok(r.prompt)["input_ids"], 4, tok.eos_token_id) for r in records]
    assert sum(len(g) for g in greedy) > 5  # answers of several tokens: the batched loop is really compared
    answers = [PromptRecord(r.index, r.prompt, None, {"answer": float(g[-1]) if g else -1.0})
               for r, g in zip(records, greedy)]  # the greedy answer's last number is "right"
    assert measures.greedy_correct(model, tok, answers, 4, micro=2) == [1.0 if g else 0.0 for g in greedy]
    wrong = [PromptRecord(r.index, r.prompt, None, {"answer": 999}) for r in records]
    assert measures.greedy_correct(model, tok, wrong, 4) == [0.0] * 5


def test_sft_training_logs_the_batch_nll_without_a_second_forward(tmp_path):
    """The per-step outcome of SFT is the loss (mean NLL per demonstration row at the step's parameters):
    the same number a separate no-grad pass gives, at one forward per micro-batch."""
    model, tok = tiny_model("llama-untied"), DemoTokenizer(64)
    records = _records(6)
    demos = tmp_path / "d.jsonl"
    demos.write_text("".join(json.dumps({"prompt": r.prompt, "response": f"{r.fields['answer']} 9"}) + "\n"
                             for r in records))
    task = make_task(SFTDemonstrationsObjective(demos), Context(model, tok, "cpu"), records, 2, 4)
    forwards = []
    handle = model.register_forward_hook(lambda *a: forwards.append(1))
    from fisher_select.studies.loop import Streams

    rows = task.batch(2, Streams.from_seed(0, "cpu")).rows  # the rows step 0 of seed 0 will see
    task.restart()
    from fisher_select.studies.prefix import row_logprobs

    with torch.no_grad():
        brute = -sum(row_logprobs(model, rows, task.pad, "cpu")) / len(rows)
    forwards.clear()
    log = train(model, task, TrainConfig(1, "sgd", 0.1, 0.0, 0, 2, 2, 4, 8), progress=False)
    handle.remove()
    assert log[0]["outcome"] == pytest.approx(brute, rel=1e-6) and log[0]["outcome"] == log[0]["loss"]
    assert len(forwards) == 1  # 4 rows, micro-batch 8: one forward, the backward's


def test_a_tiny_distillation_study_has_a_frozen_teacher_a_noise_floor_and_shares(tmp_path):
    records = _records(10)
    protocol = ProtocolV2("opd-pg", replicates=2, train_prompts=4, validation_prompts=2, heldout_prompts=2,
                          budgets=(0.05,), arms=("bound", "lora_config", "full"), grid_cap=5, steps=1, prompts_per_step=2,
                          samples_per_prompt=2, max_new_tokens=3, bootstrap=100)
    teachers = []

    def load(r):
        splits = draw(records, protocol, r)
        model, tok = tiny_model("llama-tied"), DemoTokenizer(64)
        objective = OPDPGObjective(TeacherConfig(model="self", system_prompt=None, user_template="{prompt} 9"))
        fisher = {n: torch.rand(p.shape, generator=torch.Generator().manual_seed(r)) for n, p in
                  model.named_parameters()}
        run = make_run(fisher, objectives=[{"name": "opd-pg", "signal_scale": 2.0}], fingerprint=fingerprint(model),
                       run_id=f"rep{r}")
        teachers.append(objective)
        return Replicate(r, run, model, tok, objective, splits, general_text="3 4 5 6 7 8 9 10 11 12",
                         general_prompts=["3 4 5", "6 7 8 9"])

    done = run_study(protocol, tmp_path / "cells", load)
    assert done["finished"]
    assert all(isinstance(o.spec.model, torch.nn.Module) and not any(p.requires_grad for p in o.spec.model.parameters())
               for o in teachers)  # every replicate's teacher is a frozen copy
    record = read_outcomes(assemble(tmp_path / "cells", resamples=100))
    assert record.noise_floor is not None and record.noise_floor["n"] == 2
    assert 0.0 <= record.training_rows["signal_share"] <= 1.0 and record.training_rows["finished_share"] is not None
    sums = record.arms["bound@0.05"]["replicates"][0]["mask_sums"]
    assert sums["sqrt_fs"] == pytest.approx(sums["sqrt_f"] * math.sqrt(2.0)) and sums["abs_g_hat"] is None
    lora = record.arms["lora_config@0.05"]["replicates"][0]
    assert lora["trainable"] > 0 and "bound@0.05 vs lora_config@0.05" in record.paired["recovered"]


def test_finished_shares_count_full_fine_tunings_held_out_batches_and_its_first_batch_apart():
    from fisher_select.studies.assemble import _shares

    def cell(arm, stage, log):
        return {"key": {"arm": arm, "stage": stage}, "result": {"log": [
            {"rows": 32, "rows_with_signal": s, "finished": f} for s, f in log]}}

    cells = [cell("full", "held_out", [(32, 30), (16, 0)]), cell("full", "held_out", [(24, 32), (32, 16)]),
             cell("full", "pilot", [(0, 0)]), cell("bound", "held_out", [(0, 0)])]  # neither counts
    shares = _shares(cells)
    assert shares["signal_share"] == (32 + 16 + 24 + 32) / 128
    assert shares["finished_share"] == (30 + 0 + 32 + 16) / 128  # every batch: the policy trains as it samples
    assert shares["finished_share_first_step"] == (30 + 32) / 64  # the first batches: the untrained model's samples


# --- speed work that is exact: the shared prompt prefix computed once ------------------------------------


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-bias", "gpt2"])
def test_scoring_with_the_shared_prefix_once_equals_the_plain_path(name, monkeypatch):
    from fisher_select.calibration.objectives.base import ScoringRow
    from fisher_select.studies import prefix

    torch.manual_seed(0)
    model = tiny_model(name).eval()
    shared = [int(x) for x in torch.randint(2, 60, (12,))]  # the system prompt and solved examples
    rows = []
    for n in (3, 1, 5, 2, 4):  # problems and answers of different lengths: the suffixes are right padded
        tail = [int(x) for x in torch.randint(2, 60, (n + 2,))]
        rows.append(ScoringRow(shared + tail, len(shared) + 2))
    assert prefix.common_prefix(rows) >= prefix.MIN_PREFIX  # the fast path is the one tested
    fast = prefix.row_logprobs(model, rows, 1, "cpu", micro=2)
    monkeypatch.setattr(prefix, "CACHED", False)
    plain = prefix.row_logprobs(model, rows, 1, "cpu", micro=2)
    brute = []
    for r in rows:  # per token, one row at a time, no padding, float64 sums
        logits = model(torch.tensor([r.ids])).logits[0].detach().double()  # (T, V)
        brute.append(sum(float(torch.log_softmax(logits[t - 1], -1)[r.ids[t]]) for t in range(r.start, len(r.ids))))
    assert plain == pytest.approx(brute, abs=1e-4)
    assert fast == pytest.approx(plain, abs=1e-4)  # fp32 rounding only: sums of ~5 log-probs of ~-4 each


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-bias", "gpt2", "lora", "frozen-start"])
def test_training_with_the_shared_prefix_once_gives_the_per_row_gradient(name, monkeypatch):
    """The training step's gradient with the prefix run once (its keys and values cut as leaves) equals a
    per-row, unpadded float64 backward of the same loss, token weights and micro-batches included."""
    from fisher_select.calibration.objectives.base import ScoringRow
    from fisher_select.studies import prefix
    from fisher_select.studies.loop import Batch, backward

    torch.manual_seed(1)
    if name == "lora":  # the study's LoRA arm: a PEFT model, its adapters trained (B made nonzero)
        from fisher_select.studies.arms import lora_rank1

        model = lora_rank1(tiny_model("llama-untied").double()).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
    elif name == "frozen-start":  # module-level arms: the embeddings and first layer frozen, their K/V no graph
        model = tiny_model("llama-untied").double().eval()
        for n, p in model.named_parameters():
            p.requires_grad_(not (n.startswith("model.embed") or n.startswith("model.layers.0.")))
    else:
        model = tiny_model(name).double().eval()
    shared = [int(x) for x in torch.randint(2, 60, (12,))]
    rows, weights = [], []
    for n in (3, 1, 5, 2, 4):
        tail = [int(x) for x in torch.randint(2, 60, (n + 2,))]
        rows.append(ScoringRow(shared + tail, len(shared) + 2))
        weights.append(torch.randn(n, dtype=torch.float64))  # RL's a_n, or distillation's A_t per token
    batch = Batch(rows, weights, -1.0, None)
    assert prefix.common_prefix(rows) >= prefix.MIN_PREFIX

    def grads():
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss = prefix.prefix_backward(model, rows, weights, -1.0, len(rows), 1, 2)  # what backward() calls first
    assert loss is not None  # the fast path ran (the model's cache is a plain DynamicCache)
    fast = grads()
    model.zero_grad(set_to_none=True)
    brute_loss = 0.0
    for r, w in zip(rows, weights):  # per row, no padding, no cache
        logp = torch.log_softmax(model(torch.tensor([r.ids])).logits[0], -1)  # (T, V) float64
        picked = logp[torch.arange(r.start - 1, len(r.ids) - 1), torch.tensor(r.ids[r.start:])]
        row_loss = -(picked * w).sum() / len(rows)
        row_loss.backward()
        brute_loss += float(row_loss.detach())
    brute = grads()
    assert loss == pytest.approx(brute_loss, rel=1e-5)
    assert fast.keys() == brute.keys()
    for n in brute:  # the prefix's own parameters' path included (embeddings, first layers)
        torch.testing.assert_close(fast[n], brute[n], rtol=1e-5, atol=1e-7, msg=n)
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(prefix, "CACHED", False)  # and the plain path agrees too
    assert prefix.prefix_backward(model, rows, weights, -1.0, len(rows), 1, 2) is None
    backward(model, batch, 1, micro=2)
    for n in brute:
        torch.testing.assert_close(model.get_parameter(n).grad, brute[n], rtol=1e-5, atol=1e-7, msg=n)


def test_no_common_prefix_falls_back_to_the_plain_path():
    from fisher_select.calibration.objectives.base import ScoringRow
    from fisher_select.studies.prefix import common_prefix

    rows = [ScoringRow([5, 6, 7, 8], 2), ScoringRow([5, 9, 7, 8], 3)]
    assert common_prefix(rows) == 1
    assert common_prefix([ScoringRow([5, 6, 7, 8], 2), ScoringRow([5, 6, 7, 8, 9], 4)]) == 1  # min(start) - 1


# --- forgetting as the KL on the starting model's own general responses; |theta| and lora_config arms -----


def test_general_kl_against_a_per_token_brute_force_on_common_responses():
    model, tok = tiny_model("llama-tied"), DemoTokenizer(64)
    prompts = ["3 4 5", "6 7 8 9", "10 11"]
    rows, start = measures.general_responses(model, tok, seed=7, prompts=prompts, max_new_tokens=6, samples=3)
    again, _ = measures.general_responses(model, tok, seed=7, prompts=prompts, max_new_tokens=6, samples=3)
    assert [r.ids for r in rows] == [r.ids for r in again] and rows  # the same responses for every arm
    assert measures.general_kl(model, rows, start, 1) == pytest.approx(0.0, abs=1e-6)
    moved = tiny_model("llama-tied", seed=3)  # another model: the KL is not 0
    got = measures.general_kl(moved, rows, start, 1)
    diff, tokens = 0.0, 0
    with torch.no_grad():
        for r in rows:  # one row at a time, no padding, float64
            lp0 = torch.log_softmax(model(torch.tensor([r.ids])).logits[0].double(), -1)  # (T, V)
            lp1 = torch.log_softmax(moved(torch.tensor([r.ids])).logits[0].double(), -1)
            for t in range(r.start, len(r.ids)):
                diff += float(lp0[t - 1, r.ids[t]] - lp1[t - 1, r.ids[t]])
                tokens += 1
    assert abs(diff / tokens) > 1e-3 and got == pytest.approx(diff / tokens, abs=1e-5)


def test_magnitude_masks_take_the_largest_starting_weights():
    model = tiny_model("llama-untied")
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    fisher = {n: torch.rand(t.shape) for n, t in theta0.items()}
    masks = arm_masks("magnitude", 0.1, fisher=fisher, grad_estimate=None, first_batch=None, seed=0, theta0=theta0)
    total = sum(t.numel() for t in theta0.values())
    chosen = torch.cat([theta0[n][m].abs() for n, m in masks.items()])
    left = torch.cat([theta0[n][~m].abs() for n, m in masks.items()])
    assert len(chosen) == round(0.1 * total) and float(chosen.min()) >= float(left.max())


def test_lora_config_at_the_nearest_trainable_count_against_enumeration():
    import copy

    import peft

    from fisher_select.outputs.lora import lora_hints
    from fisher_select.studies.arms import lora_config_at, lora_count

    model = tiny_model("llama-untied")
    fisher = {n: torch.rand(p.shape, generator=torch.Generator().manual_seed(1)) for n, p in model.named_parameters()}
    run = make_run(fisher, fingerprint=fingerprint(model))
    targets = len(lora_hints(run, model=model, rank_step=1, mean_rank=1).ranks)
    counts = {t: lora_count(model, lora_hints(run, model=model, rank_step=1, total_rank=t))
              for t in range(targets, 120)}
    hints = lora_hints(run, model=model, rank_step=1, total_rank=targets + 9)
    adapted = peft.get_peft_model(copy.deepcopy(model), hints.peft_config())
    assert lora_count(model, hints) == sum(p.numel() for p in adapted.parameters() if p.requires_grad)  # PEFT's own count
    for want in (counts[targets + 3] + 1, counts[targets + 10] - 2, counts[40], counts[100] + 7):
        best = min(counts.values(), key=lambda c: (abs(c - want), c))  # nearest; ties: the smaller
        assert lora_config_at(run, model, want)[1] == best
    assert lora_config_at(run, model, 1)[1] == counts[targets]  # below one rank per target: the smallest


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-bias", "gpt2"])
def test_greedy_decoding_with_a_kv_cache_equals_the_plain_path_and_a_per_token_loop(name, monkeypatch):
    from fisher_select.studies import prefix

    model = tiny_model(name)
    prompts = [[3, 9, 14], [5, 22, 7, 30, 41], [8], [17, 2, 60, 33]]  # unequal lengths: left padded
    cached = prefix.greedy(model, prompts, 6, {1}, 1, "cpu")
    monkeypatch.setattr(prefix, "CACHED", False)
    plain = prefix.greedy(model, prompts, 6, {1}, 1, "cpu")
    brute = [_brute_greedy(model, p, 6, 1) for p in prompts]
    assert sum(len(b) for b in brute) > 8  # several tokens each: the cache is really used
    assert cached == plain == brute  # argmax of the same logits up to fp32 rounding (no near-tie in these)


def test_the_readme_outcomes_block_is_generated_from_the_committed_results():
    """README's "Does it work?" verdicts come from bench/results/outcomes-<kind>.json, never by hand."""
    from pathlib import Path

    from fisher_select.report.readme_outcomes import BEGIN, END, readme_block

    root = Path(__file__).resolve().parents[1]
    block = readme_block(str(root / "bench" / "results"))
    assert f"{BEGIN}\n{block}\n{END}" in (root / "README.md").read_text(encoding="utf-8")


def test_on_policy_evaluation_per_prompt_uses_common_random_numbers():
    """Each evaluated sample draws from its own seeded generator: a prompt's value is the same whether it is
    evaluated alone or in a pass with others, and equals the mean reward of its samples drawn one by one."""
    from fisher_select.calibration.objectives import RLObjective
    from fisher_select.calibration.prompts import render_prompt
    from fisher_select.calibration.sampling import sample_responses
    from fisher_select.studies.loop import row_seed

    model, tok = tiny_model("llama-untied").double(), DemoTokenizer(64)
    reward = lambda r, text: float(len(text.split()) % 3) / 2  # noqa: E731  (varies with the response)
    records = _records(5)
    task = make_task(RLObjective(reward), Context(model, tok, "cpu"), records, 3, 4)
    one_by_one = task.evaluate_each(records, 7, rows_per_pass=3)  # one prompt per pass
    together = task.evaluate_each(records, 7, rows_per_pass=15)  # all five in one pass
    assert one_by_one == together and len(set(together)) > 1
    for i, r in enumerate(records):  # brute force: each sample alone, from its own seed
        texts = [tok.decode(sample_responses(model, [render_prompt(tok, r)], eos_ids={tok.eos_token_id},
                                             pad_id=tok.pad_token_id, max_new_tokens=4,
                                             generator=[torch.Generator().manual_seed(row_seed(7, i, k))])[0]
                            .response_ids, skip_special_tokens=True) for k in range(3)]
        assert together[i] == pytest.approx(sum(reward(r, t) for t in texts) / 3)
    assert task.evaluate_each(records, 8, 15) != together  # another seed, other samples


def test_sft_evaluation_per_prompt_in_one_call_equals_one_prompt_at_a_time(tmp_path):
    model, tok = tiny_model("llama-untied"), DemoTokenizer(64)
    records = _records(6)
    demos = tmp_path / "d.jsonl"
    lines = [{"prompt": r.prompt, "response": f"{r.fields['answer']} 9"} for r in records]
    lines.append({"prompt": records[2].prompt, "response": "7"})  # a prompt with two demonstrations
    demos.write_text("".join(json.dumps(x) + "\n" for x in lines))
    task = make_task(SFTDemonstrationsObjective(demos), Context(model, tok, "cpu"), records[:2], 2, 4)
    each = task.evaluate_each(records, 0, 4)
    alone = [task.evaluate([r], 0, 4) for r in records]
    assert each == pytest.approx(alone, rel=1e-5) and len(set(each)) > 1
    everything = task.evaluate(records, 0, 4)  # the mean over the 7 demonstrations
    assert everything == pytest.approx((sum(each) + each[2]) / 7, rel=1e-5)


def test_an_arm_that_fell_below_the_start_in_some_replicates_says_so():
    """A mean over replicates hides a collapse at the tuned lr: the README cell and the arm table count them."""
    from fisher_select.report.outcome_tables import worse_than_start
    from fisher_select.report.readme_outcomes import _cell

    arm = {"replicates": {0: {"recovered": 1.5, "gain": 0.09}, 1: {"recovered": -3.0, "gain": -0.2},
                          2: {"recovered": 1.0, "gain": 0.06}}, "forgetting_kl": {"mean": 4.0}}
    assert worse_than_start(arm) == (1, 3)
    assert _cell(arm).endswith("; KL 4; worse than start in 1/3")
    arm["replicates"][1]["gain"] = 0.01
    assert worse_than_start(arm) == (0, 3) and "worse than start" not in _cell(arm)  # said only when it happened
