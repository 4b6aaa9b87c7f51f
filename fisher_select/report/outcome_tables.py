"""Markdown tables of a protocol v2 outcome record: every number from the record, edge lrs flagged."""

from __future__ import annotations

from fisher_select.run.outcomes import OutcomesRecord


def _ms(summary: dict | None, digits: int = 3) -> str:
    if not summary:
        return "-"
    se = summary.get("se")
    return f"{summary['mean']:.{digits}f}" + (f" ± {se:.{digits}f}" if se is not None else "")


def worse_than_start(arm: dict) -> tuple[int, int]:
    """(k, n): in k of the arm's n held-out replicates its mean outcome fell below the untrained model's on the same
    prompts. A mean over replicates hides a run that collapsed at the tuned lr; this count shows it."""
    gains = [m["gain"] for m in arm["replicates"].values() if m.get("gain") is not None]
    return sum(g < 0 for g in gains), len(gains)


def arm_table(record: OutcomesRecord) -> list[str]:
    """One row per arm: lr (``*``: still on its grid's edge), recovered share, content share, forgetting, accuracy."""
    lines = ["| arm | lr | recovered | content recovered | forgetting (general-text NLL/token) | "
             "forgetting (KL/token on general responses) | greedy accuracy | worse than start | replicates |",
             "|---|---|---|---|---|---|---|---:|---:|"]
    for name, arm in record.arms.items():
        if name == "start":
            continue
        lr = "-" if arm.get("lr") is None else f"{arm['lr']:.3g}" + (" *" if arm.get("lr_on_edge") else "")
        lines.append(f"| {name} | {lr} | {_ms(arm.get('recovered'))} | {_ms(arm.get('content_recovered'))} | "
                     f"{_ms(arm.get('forgetting'))} | {_ms(arm.get('forgetting_kl'))} | {_ms(arm.get('greedy_accuracy'))} | "
                     f"{worse_than_start(arm)[0]} | {len(arm['replicates'])} |")
    return lines


def paired_table(record: OutcomesRecord, measure: str = "recovered") -> list[str]:
    """The bound against each peer at each budget: mean difference, 95% bootstrap interval, p-values."""
    lines = [f"| {measure}: pair | mean difference | 95% interval | paired t p | Wilcoxon p | n |",
             "|---|---|---|---|---|---:|"]
    for pair, s in record.paired.get(measure, {}).items():
        interval = "-" if s["interval"] is None else f"[{s['interval'][0]:.3f}, {s['interval'][1]:.3f}]"
        p = [("-" if s[k] is None else f"{s[k]:.3g}") for k in ("t_p", "wilcoxon_p")]
        lines.append(f"| {pair} | {s['mean_difference']:.3f} | {interval} | {p[0]} | {p[1]} | {s['n']} |")
    return lines


def verdict_lines(record: OutcomesRecord) -> list[str]:
    """Trained, discriminating, noise floor and edge flags, in words."""
    t, d = record.trained, record.discriminates
    if t.get("se") is None:  # fewer than 2 replicates of full fine-tuning held out: nothing to judge yet
        told = f"- trained: not judged yet ({t.get('n', 0)} held-out replicates of full fine-tuning; rule: {t['rule']})"
    else:
        told = (f"- trained: {t['trained']} (full fine-tuning's improvement {t['mean']:.4g}, SE {t['se']:.3g}; "
                f"rule: {t['rule']})")
    share = d.get("random_content_recovered")
    measured = "" if share is None else f"random at 0.01% recovers {share:.3f} of full's content gain; "
    out = [told, f"- discriminates: {d.get('discriminates')} ({measured}{d.get('rule') or d.get('why')})"]
    if record.noise_floor:
        out.append(f"- evaluation noise floor: {record.noise_floor['mean_abs_difference']:.4g} (the untrained model "
                   "evaluated with two sampling seeds, mean |difference| over replicates)")
    for budget, v in record.verdicts.items():
        out.append(f"- at {float(budget):.4%} the bound {v['verdict']} against the best peer, {v['best_peer']} "
                   f"(mean difference {v['mean_difference']:+.3f}, 95% interval [{v['interval'][0]:.3f}, "
                   f"{v['interval'][1]:.3f}], {v['n']} replicates)" + _forgetting_words(v))
    rows = record.training_rows
    if rows.get("signal_share") is not None:
        finished, first = rows.get("finished_share"), rows.get("finished_share_first_step")
        out.append(f"- training rows with signal: {rows['signal_share']:.0%}"
                   + ("" if finished is None else f"; responses finished: {finished:.0%}")
                   + ("" if first is None else f" ({first:.0%} of the first batch, the untrained model's samples)"))
    edge = record.on_edge()
    out.append("- lr on a grid edge (*): " + (", ".join(edge) if edge else "none"))
    return out


def _forgetting_words(verdict: dict) -> str:
    """"; it forgets less than it (KL ...)" for a verdict that holds the forgetting comparison, else ""."""
    kl = verdict.get("forgetting_kl")
    if kl is None:
        return ""
    return (f"; it forgets {kl['verdict']}{'' if kl['verdict'] == 'the same' else ' than it'} (KL per token "
            f"{kl['mean_difference']:+.3f}, 95% interval [{kl['interval'][0]:.3f}, {kl['interval'][1]:.3f}])")


SUMS = {"abs_g_hat": "|g_hat_i|", "sqrt_fs": "sqrt(F_i S)"}


def lr_table(record: OutcomesRecord) -> list[str]:
    """Per arm, the pilot's lr grid as finally swept, the chosen lr (``*``: on the grid's edge) and its score."""
    lines = ["| arm | lr grid (pilot) | points | chosen lr | validation there |", "|---|---|---:|---|---|"]
    for name, c in sorted(record.lr_choices.items()):
        i = c["grid"].index(c["chosen"])
        lines.append(f"| {name} | {c['grid'][0]:.3g} .. {c['grid'][-1]:.3g} | {len(c['grid'])} | "
                     f"{c['chosen']:.3g}{' *' if c['on_edge'] else ''} | {c['validation'][i]:.4g} |")
    return lines


def lr_advice_lines(record: OutcomesRecord) -> list[str]:
    """The lr-advice test in words, whatever it found."""
    out = []
    for which, a in record.lr_advice.items():
        head = f"- lr advice from the sum of {SUMS.get(which, which)} over the mask: "
        if a.get("slope") is None:
            out.append(head + f"not testable here ({a['n']} masks off their grid's edge; {a['meaning']})")
        else:
            out.append(head + f"log lr = {a['intercept']:.2f} + {a['slope']:.2f} log(sum), r = {a['r']:.2f} over "
                       f"{a['n']} masks; a suggestion from it is off by a factor of {a['loo_error_factor']:.2f} "
                       "(leave-one-out RMS; one grid step is 3.16)" + _versus_tuned(a.get("suggested_vs_tuned")))
    return out


def _versus_tuned(v: dict | None) -> str:
    """Training at the (leave-one-out) suggestion instead of the tuned lr, on the pilot's validation."""
    if not v:
        return ""
    regret = "" if v["regret_mean"] is None else (f"; validation there is worse by {v['regret_mean']:.3g} on average "
                                                  f"(at most {v['regret_max']:.3g}; the tuned lrs score "
                                                  f"{v['tuned_validation_mean']:.3g})")
    return (f". At the swept lr nearest the suggestion: the tuned lr for {v['same_point']} of {v['n']} masks, one grid "
            f"step off for {v['one_step_off']}, diverged for {v['diverged']}" + regret)


def record_markdown(record: OutcomesRecord) -> list[str]:
    return [*verdict_lines(record), *lr_advice_lines(record), "", *arm_table(record), "", *lr_table(record), "",
            *paired_table(record, "recovered"), "", *paired_table(record, "forgetting"), "",
            *paired_table(record, "forgetting_kl")]
