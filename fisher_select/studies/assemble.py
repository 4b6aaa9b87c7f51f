"""``--assemble``: the outcome study's tables and statistics (protocol v2) from its cells alone.

Per replicate and arm, from the held-out cells: the mean held-out outcome, its gain over the
untrained model (sign: > 0 is better), the share of full fine-tuning's gain recovered, the content
gain (answer-token NLL) and its share, greedy accuracy, and forgetting (general-text NLL change).
Then: the lr each arm was trained at and whether it sits on its grid's edge (from the pilot cells),
the paired statistics of the bound against each peer at each budget, the trained criterion, the
evaluation's noise floor, whether the task discriminates, and the lr-advice test.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np

from fisher_select.atomic import write_file
from fisher_select.report.build import regenerate
from fisher_select.run.io import write_json
from fisher_select.run.names import OUTCOMES_FILE, outcomes_dir
from fisher_select.run.outcomes import OUTCOMES_PROTOCOL
from fisher_select.studies.arms import BUDGETED_ARMS, arm_name
from fisher_select.studies.cell_run import START
from fisher_select.errors import FisherSelectError
from fisher_select.studies.cells import canonical, read_cells
from fisher_select.studies.grid import pick
from fisher_select.studies.paired import paired, trained

DISCRIMINATES_BELOW = 0.8  # random at 0.01% must recover less than this share of full's content gain
DISCRIMINATING_BUDGET = 1e-4


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def _lr_choices(cells: list[dict], higher_is_better: bool) -> dict:
    """Each arm's lr as the pilot chose it, rebuilt from the pilot cells (on_edge: smallest or largest)."""
    grids: dict[str, dict[float, float]] = {}
    sums: dict[str, dict] = {}  # a mask's sums do not depend on the lr: any pilot cell of the arm gives them
    for c in cells:
        k = c["key"]
        if k["stage"] == "pilot":
            name = arm_name(k["arm"], k["budget"])
            grids.setdefault(name, {})[k["lr"]] = c["result"]["validation"]
            sums[name] = c["result"].get("mask_sums")
    out = {}
    for name, by_lr in grids.items():
        grid = sorted(by_lr)
        scores = [by_lr[lr] for lr in grid]
        i, edge = pick(grid, scores, higher_is_better)
        out[name] = {"grid": grid, "validation": scores, "chosen": grid[i], "on_edge": edge, "mask_sums": sums[name]}
    return out


def _per_replicate(cells: list[dict], sign: float) -> dict:
    """name -> replicate -> the measures of that held-out cell, gains taken against the replicate's start."""
    held = {}
    for c in cells:
        k = c["key"]
        if k["stage"] == "held_out":
            held.setdefault(k["replicate"], {})[arm_name(k["arm"], k["budget"])] = c["result"]
    out: dict[str, dict[int, dict]] = {}
    for r, arms in sorted(held.items()):
        start = arms.get(START)
        if start is None:
            continue
        full = arms.get("full")
        for name, res in arms.items():
            out.setdefault(name, {})[r] = _measures(res, start, full, sign)
    return out


def _measures(res: dict, start: dict, full: dict | None, sign: float) -> dict:
    after, before = _mean(res["held_out"]), _mean(start["held_out"])
    m = {"lr": res["lr"], "held_out": after, "held_out_per_prompt": res["held_out"], "gain": sign * (after - before),
         "forgetting": res["general_text_nll"] - start["general_text_nll"], "trainable": res["trainable"],
         "forgetting_kl": res.get("general_kl"),  # KL from the starting model on its own general responses
         "mask_sums": res.get("mask_sums"), "training_seconds": res["training_seconds"]}
    if "answer_nll" in res:
        m["content_gain"] = _mean(start["answer_nll"]) - _mean(res["answer_nll"])  # > 0: the answers got likelier
        m["greedy_accuracy"] = _mean(res["greedy_correct"])
    if full is not None:
        full_gain = sign * (_mean(full["held_out"]) - before)
        m["recovered"] = m["gain"] / full_gain if full_gain else None
        if "answer_nll" in res:
            full_content = _mean(start["answer_nll"]) - _mean(full["answer_nll"])
            m["content_recovered"] = m["content_gain"] / full_content if full_content else None
    return m


def _paired_table(per: dict, budgets: list, measure: str, resamples: int) -> dict:
    out = {}
    for b in budgets:
        bound = per.get(arm_name("bound", b), {})
        for arm in BUDGETED_ARMS[1:] + ("lora_all_linear_r1",):
            at = b if arm in BUDGETED_ARMS else None  # lora_all_linear_r1 has its own count
            peer = per.get(arm_name(arm, at), {})
            reps = sorted(set(bound) & set(peer))
            pairs = [(bound[r].get(measure), peer[r].get(measure)) for r in reps]
            pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
            if pairs:
                out[f"bound@{b:g} vs {arm_name(arm, at)}"] = paired(
                    [x for x, _ in pairs], [y for _, y in pairs], resamples=resamples)
    return out


def _lr_advice(choices: dict, higher_is_better: bool = False) -> dict:
    """Does a mask's sum of |g_hat_i| (or of sqrt(F_i S)) predict its chosen lr? A log-log fit over the masks
    of the pilot replicate (``choices``: ``_lr_choices``), and its accuracy as a suggestion would have it:
    the leave-one-out error factor (exp of the RMS of log(chosen / predicted), each mask predicted by a fit
    without it; 1 is exact, sqrt(10) is one grid step off), and what training at the suggestion would have
    cost on validation (``_suggested_vs_tuned``). A choice on its grid's edge is left out (its lr is a
    bound, not an optimum)."""
    out = {}
    for which in ("abs_g_hat", "sqrt_fs"):
        names, xs, ys = [], [], []
        for name, choice in sorted(choices.items()):
            sums = choice.get("mask_sums")
            if sums and sums.get(which) and not choice["on_edge"]:
                names.append(name)
                xs.append(math.log(sums[which]))
                ys.append(math.log(choice["chosen"]))
        if len(xs) >= 4 and np.ptp(xs) > 0 and np.ptp(ys) > 0:
            slope, intercept = np.polyfit(xs, ys, 1)
            predicted = _loo_predictions(xs, ys)
            out[which] = {"n": len(xs), "slope": float(slope), "intercept": float(intercept),
                          "r": float(np.corrcoef(xs, ys)[0, 1]), "loo_error_factor": _error_factor(ys, predicted),
                          "suggested_vs_tuned": _suggested_vs_tuned(
                              [choices[n] for n in names], [math.exp(p) for p in predicted], higher_is_better),
                          "meaning": "log(chosen lr) = intercept + slope * log(sum over the mask), pilot replicate"}
        else:
            out[which] = {"n": len(xs), "slope": None, "r": None, "loo_error_factor": None,
                          "meaning": "fewer than 4 masks with this sum, or one lr for all of them: nothing to fit"}
    return out


def _loo_predictions(xs: list[float], ys: list[float]) -> list[float]:
    """Each point's y as predicted by a line fitted to the other points."""
    out = []
    for i in range(len(xs)):
        rest = [j for j in range(len(xs)) if j != i]
        slope, intercept = np.polyfit([xs[j] for j in rest], [ys[j] for j in rest], 1)
        out.append(intercept + slope * xs[i])
    return out


def _error_factor(ys: list[float], predicted: list[float]) -> float:
    """exp(RMS of the log residuals)."""
    return float(math.exp(math.sqrt(statistics.fmean((y - p) ** 2 for y, p in zip(ys, predicted)))))


def _suggested_vs_tuned(choices: list[dict], suggested: list[float], higher_is_better: bool) -> dict | None:
    """Training at the suggestion instead of the tuned lr, on the pilot's validation: each mask's suggestion
    (leave-one-out) snaps to the nearest point of its swept grid, whose validation score is then compared with
    the chosen lr's. ``regret`` is how much worse the suggestion's point is (>= 0, the metric's units)."""
    rows = []
    for choice, lr in zip(choices, suggested):
        grid, scores = choice.get("grid"), choice.get("validation")
        if not grid or not scores:
            return None
        i = min(range(len(grid)), key=lambda j: abs(math.log(grid[j] / lr)))
        best = scores[grid.index(choice["chosen"])]
        steps = abs(round(math.log10(grid[i] / choice["chosen"]) * 2))  # grid points are sqrt(10) apart
        rows.append((steps, (best - scores[i]) if higher_is_better else (scores[i] - best), best))
    regrets = [r for _, r, _ in rows if not math.isnan(r)]  # NaN: training at the suggestion diverged
    return {"n": len(rows), "same_point": sum(s == 0 for s, _, _ in rows), "one_step_off": sum(s == 1 for s, _, _ in rows),
            "diverged": len(rows) - len(regrets), "regret_mean": _mean(regrets),
            "regret_max": max(regrets) if regrets else None,
            "tuned_validation_mean": statistics.fmean(b for _, _, b in rows),
            "meaning": "leave-one-out suggestion snapped to the nearest swept lr; regret: its validation score minus "
                       "the tuned lr's (worse is > 0), pilot replicate"}


def study_cells(folder, kind: str | None = None) -> list[dict]:
    """The sound cells of one kind under ``folder``, all of one protocol (else one error: cells of an older
    protocol stay on disk after a change and must not be mixed into the new tables)."""
    cells = [c for c in read_cells(folder) if kind is None or c["key"]["kind"] == kind]
    if not cells:
        raise FisherSelectError(f"no finished cell{'' if kind is None else ' of kind ' + kind} under {folder}; "
                                "run the study first (docs/OUTCOMES.md)")
    kinds = {c["key"]["kind"] for c in cells}
    if len(kinds) > 1:
        raise FisherSelectError(f"{folder} holds cells of several kinds ({', '.join(sorted(kinds))}); pass --kind")
    groups: dict[str, int] = {}
    for c in cells:
        digest = canonical(c["context"]["protocol"])
        groups[digest] = groups.get(digest, 0) + 1
    if len(groups) > 1:
        raise FisherSelectError(f"{folder} holds cells of {len(groups)} different protocol settings "
                                f"({', '.join(str(n) for n in groups.values())} cells); move the cells of the old "
                                "settings to another folder, then assemble again")
    return cells


def assemble(folder, kind: str | None = None, resamples: int = 10_000) -> dict:
    """The study's record (``run.outcomes``, protocol v2) from the cells under ``folder``."""
    cells = study_cells(folder, kind)
    protocol = cells[0]["context"]["protocol"]
    higher = bool(cells[0]["result"]["higher_is_better"])
    sign = 1.0 if higher else -1.0
    per = _per_replicate(cells, sign)
    choices = _lr_choices(cells, higher)
    arms = {name: {"lr": choices.get(name, {}).get("chosen"), "lr_on_edge": choices.get(name, {}).get("on_edge"),
                   "replicates": reps, **_summary(reps)} for name, reps in per.items()}
    full = [m["gain"] for m in per.get("full", {}).values()]
    # the study's extent comes from its cells (it is not in their hash: a budget or replicate added later
    # keeps the finished cells)
    budgets = sorted({c["key"]["budget"] for c in cells if c["key"]["budget"] is not None})
    replicates = sorted({c["key"]["replicate"] for c in cells if c["key"]["stage"] == "held_out"})
    calibration = cells[0]["context"].get("calibration")
    model = calibration["recipe"].get("model") if isinstance(calibration, dict) else None  # the recipe's model
    protocol = {**protocol, "budgets": budgets, "replicates": len(replicates), "model": model}
    tables = {m: _paired_table(per, protocol["budgets"], m, resamples)
              for m in ("recovered", "forgetting", "forgetting_kl")}
    return {"protocol": OUTCOMES_PROTOCOL, "kind": protocol["kind"], "settings": protocol, "cells": len(cells),
            "higher_is_better": higher, "lr_choices": choices, "arms": arms, "trained": trained(full),
            "noise_floor": _noise_floor(cells), "discriminates": _discriminates(per),
            "paired": tables,
            "lr_advice": _lr_advice(choices, higher), "verdicts": _verdicts(per, protocol["budgets"], tables),
            "training_rows": _shares(cells)}


def keep_record_in_run(record, run_dir) -> Path:
    """Write a protocol 2 record (``OutcomesRecord``) into ``RUN/outcomes-<kind>/`` and redraw the run's
    report, which then shows the study's tables with their intervals."""
    folder = outcomes_dir(run_dir, record.kind)
    folder.mkdir(exist_ok=True)
    write_file(folder / OUTCOMES_FILE, lambda tmp: write_json(tmp, record.as_dict()), overwrite=True)
    regenerate(run_dir)
    return folder


def _verdicts(per: dict, budgets: list, tables: dict) -> dict:
    """Per budget: the bound against the peer mask with the best mean recovered share, in one word:
    wins / loses when the paired difference is decisive (``_word``), else ties; and against the same peer
    on forgetting (KL on general responses): forgets less / more when decisive, else the same
    (``tables``: the paired tables by measure, ``_paired_table``)."""
    out = {}
    for b in budgets:
        peers = {arm: _summary(per.get(arm_name(arm, b), {})).get("recovered") for arm in BUDGETED_ARMS[1:]}
        peers = {a: s for a, s in peers.items() if s}
        if not peers or arm_name("bound", b) not in per:
            continue
        best_peer = max(peers, key=lambda a: peers[a]["mean"])
        pair = f"bound@{b:g} vs {arm_name(best_peer, b)}"
        stats = tables["recovered"].get(pair)
        if stats is None or stats["interval"] is None:
            continue
        out[f"{b:g}"] = {"best_peer": best_peer, "verdict": _word(stats, "wins", "loses", "ties"),
                         **{k: stats[k] for k in ("mean_difference", "interval", "n")}}
        kl = tables.get("forgetting_kl", {}).get(pair)
        if kl is not None and kl["interval"] is not None:  # lower forgetting is better: "less" when below 0
            out[f"{b:g}"]["forgetting_kl"] = {"verdict": _word(kl, "more", "less", "the same"),
                                              **{k: kl[k] for k in ("mean_difference", "interval", "n")}}
    return out


VERDICT_P = 0.05  # a verdict also needs the paired t-test: with 6 replicates a percentile bootstrap is too narrow


def _word(stats: dict, above: str, below: str, between: str) -> str:
    """``above`` when the paired difference's 95% interval lies above 0 and the paired t-test gives p < 0.05,
    ``below`` likewise below 0, else ``between``. Differences that are all equal have no t-test (p None):
    the interval alone decides."""
    lo, hi = stats["interval"]
    p = stats.get("t_p")
    if p is not None and p >= VERDICT_P:
        return between
    return above if lo > 0 else below if hi < 0 else between


def _shares(cells: list[dict]) -> dict:
    """Over full fine-tuning's held-out training runs: rows with a training signal, responses that finished;
    and responses that finished in each run's first batch, which the untrained model sampled (training can
    teach a policy to run to the token limit, so the two differ)."""
    runs = [c["result"]["log"] for c in cells if c["key"]["arm"] == "full" and c["key"]["stage"] == "held_out"]
    return {**_row_shares([e for log in runs for e in log]),
            "finished_share_first_step": _row_shares([log[0] for log in runs if log])["finished_share"],
            "meaning": "rows with a nonzero training signal and sampled responses that ended before max_new_tokens, "
                       "over full fine-tuning's training batches (finished: None for SFT, nothing sampled); "
                       "finished_share_first_step: over each run's first batch only, the starting model's samples"}


def _row_shares(logs: list[dict]) -> dict:
    rows = sum(e["rows"] for e in logs)
    finished = [e["finished"] for e in logs if e.get("finished") is not None]
    return {"signal_share": sum(e["rows_with_signal"] for e in logs) / rows if rows else None,
            "finished_share": sum(finished) / rows if finished and rows else None}


def _summary(reps: dict) -> dict:
    out = {}
    for measure in ("recovered", "content_recovered", "forgetting", "forgetting_kl", "greedy_accuracy", "gain"):
        values = [m[measure] for m in reps.values() if m.get(measure) is not None]
        if values:
            se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
            out[measure] = {"mean": statistics.fmean(values), "se": se, "n": len(values)}
    return out


def _noise_floor(cells: list[dict]) -> dict | None:
    """The untrained model evaluated twice with different sampling seeds: |mean difference| per replicate."""
    diffs = [abs(_mean(c["result"]["held_out"]) - _mean(c["result"]["held_out_again"])) for c in cells
             if c["key"]["arm"] == START and "held_out_again" in c["result"]]
    return {"mean_abs_difference": _mean(diffs), "n": len(diffs)} if diffs else None


def _discriminates(per: dict) -> dict:
    reps = per.get(arm_name("random", DISCRIMINATING_BUDGET), {})
    shares = [m["content_recovered"] for m in reps.values() if m.get("content_recovered") is not None]
    if not shares:
        return {"discriminates": None, "why": "no random@0.0001 cell with a content gain"}
    share = statistics.fmean(shares)
    return {"discriminates": share < DISCRIMINATES_BELOW, "random_content_recovered": share,
            "rule": f"a task discriminates when random at {DISCRIMINATING_BUDGET:g} recovers less than "
                    f"{DISCRIMINATES_BELOW:g} of it"}
