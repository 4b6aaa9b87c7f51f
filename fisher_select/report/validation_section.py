"""What `fisher-select validate` measured, rendered: the CLI's table (``summary_lines``) and the
report's "Validation" section (report.md and report.html: one table row per validation, and plain
sentences where the ranking did not predict realized movement).

The records are ``run.validation.ValidationRecord`` (``RUN/validation-*/validation.json``); a JSON
dict is read as one (of either format).
"""

from __future__ import annotations

import html

from fisher_select.run.validation import ValidationRecord

TOP_PERCENT = "0.01"  # precision_at_k's key for the realized top 1% (training.metrics.TOP_K)
NO_PREDICTION = 0.6  # an AUROC below this: the ranking says (almost) nothing about which coordinates moved
BASELINES = (("random", "random"), ("magnitude", "abs(theta)"), ("single_batch_gradient", "1-batch abs(grad)"),
             ("second_seed", "other seed"), ("spectrum_snr", "Spectrum SNR"), ("kappa", "KappaTune"))
HEADER = (["validation", "training", "F AUROC"] + [label for _, label in BASELINES]
          + ["Adam-aware (beyond the bound)", "F precision@1%", "module rho bound mass (sum sqrt(F))",
             "module rho Fisher mass (sum F)", "first-step violations (noise alone)"])


def _record(v: "ValidationRecord | dict") -> ValidationRecord:
    return v if isinstance(v, ValidationRecord) else ValidationRecord.from_json(v)


def _num(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _auroc(entry: dict) -> str:  # "(tied)": every score equal (e.g. a zero gradient), chance by construction
    return _num((entry.get("auroc") or {}).get("q0.99")) + (" (tied)" if entry.get("degenerate") else "")


def _training(v: ValidationRecord) -> str:
    s = v.settings
    return (f"{v.objective.get('type', '?')}, {s.get('optimizer', '?')} lr {s.get('lr')} "
            f"wd {s.get('weight_decay')}, {s.get('steps')} steps of {s.get('prompts_per_step')} x "
            f"{s.get('samples_per_prompt')}")


def _first_step(v: ValidationRecord) -> str:
    fs = v.first_step
    if fs.get("violation_rate") is None:
        return "n/a (no S for the trained objective)"
    return f"{fs['violation_rate']:.1e} ({fs.get('noise_violation_rate', 0):.1e})"


def rows(validations: list[tuple[str, "ValidationRecord | dict"]]) -> list[list[str]]:
    """One table row per validation: AUROC for "moved" = the realized top 1%, beside every baseline."""
    out = []
    for name, v in validations:
        v = _record(v)
        sm = v.spearman_modules
        out.append([name, _training(v), _auroc(v.metrics)] + [_auroc(v.baselines.get(k, {})) for k, _ in BASELINES]
                   + [_auroc(v.adam_aware), _num((v.metrics.get("precision_at_k") or {}).get(TOP_PERCENT)),
                      _num(sm.get("bound_mass")), _num(sm.get("fisher_mass")), _first_step(v)])
    return out


def findings(validations: list[tuple[str, "ValidationRecord | dict"]]) -> list[str]:
    """Plain sentences: where the ranking did not predict movement, and each validation's caveats."""
    out = []
    for name, v in validations:
        v = _record(v)
        auc = (v.metrics.get("auroc") or {}).get("q0.99")
        if auc is not None and auc < NO_PREDICTION:
            out.append(f"{name}: the F ranking does NOT predict which coordinates moved (AUROC {auc:.2f}; "
                       f"0.5 is chance) under {_training(v)}; do not trust a mask from it for this training.")
        masked = v.training_outcome.get("masked_fine_tuning")
        if masked:
            shares = "; ".join(f"{r['mask']} at density {r['density']:.3g}: {_num(r['recovered'])}"
                               for r in masked["runs"])
            out.append(f"{name}: masked fine-tuning, same steps and seed, share of full fine-tuning's held-out "
                       f"improvement recovered: {shares}.")
        out += [f"{name}: {c}" for c in v.caveats]
    return out


INTRO = ("AUROC of each ranking for \"moved\" = the realized top 1% of |delta theta| after a short real "
         "fine-tuning from the calibration point (fp32 movement, seeded coordinate subsample); 0.5 is chance, "
         "\"other seed\" is the ceiling (how well one training run predicts another). Module rho: Spearman "
         "correlation of a module aggregate with the module's summed movement. Details and plots: each "
         "validation's directory.")


def markdown_lines(validations: list[tuple[str, "ValidationRecord | dict"]]) -> list[str]:
    if not validations:
        return []
    table = [" | ".join(HEADER), "|".join(["---"] * len(HEADER))]
    table += [" | ".join(c.replace("|", "\\|") for c in r) for r in rows(validations)]
    out = ["", "## Validation against training", "", INTRO, ""] + [f"| {t} |" for t in table]
    notes = findings(validations)
    return out + ([""] + [f"- {n}" for n in notes] if notes else [])


def html_section(validations: list[tuple[str, "ValidationRecord | dict"]]) -> str:
    if not validations:
        return ""
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in HEADER)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows(validations))
    notes = "".join(f"<li>{e(n)}</li>" for n in findings(validations))
    return (f"<h2>Validation against training</h2><p>{e(INTRO)}</p><table><tr>{head}</tr>{body}</table>"
            + (f"<ul>{notes}</ul>" if notes else ""))


# ---------------------------------------------------------------------------
# The CLI's table (`fisher-select validate`)


def summary_lines(v: "ValidationRecord | dict") -> list[str]:
    """Each ranking's AUROC (q = 0.99 and 0.9), precision@1% and module Spearman, then the first-step
    check, the AUROC after each step, the bf16 share and the masked fine-tuning table."""
    v = _record(v)
    rows_ = [("fisher (F / bound)", {**v.metrics, "spearman_modules": v.spearman_modules.get("bound_mass")})]
    rows_ += list(v.baselines.items())
    if "auroc" in v.adam_aware:
        rows_.append(("adam-aware SNR (beyond the bound)", v.adam_aware))
    lines = [f"{'ranking':<34} {'AUROC@q0.99':>11} {'AUROC@q0.9':>10} {'prec@1%':>8} {'module rho':>10}"]
    for label, e in rows_:
        if "auroc" not in e:
            lines.append(f"{label:<34} unavailable: {e.get('unavailable', '')}")
            continue
        lines.append(f"{label:<34} {_fmt(e['auroc']['q0.99']):>11} {_fmt(e['auroc']['q0.9']):>10} "
                     f"{_fmt(e['precision_at_k'][TOP_PERCENT]):>8} {_fmt(e['spearman_modules']):>10}")
    sm = v.spearman_modules
    lines.append(f"module aggregates vs module movement: bound mass (sum sqrt(F)) rho = {_fmt(sm.get('bound_mass'))}, "
                 f"Fisher mass (sum F) rho = {_fmt(sm.get('fisher_mass'))} (chosen: {sm.get('chosen')})")
    fs = v.first_step
    if fs.get("violation_rate") is None:
        lines.append(f"first-step check: not applicable ({fs.get('reason')})")
    else:
        lines.append(f"first-step check: {fs['violation_rate']:.2e} of coordinates above the bound "
                     f"({fs['violation_rate_beyond_rounding']:.2e} beyond fp32 rounding); noise alone: "
                     f"{fs['noise_violation_rate']:.2e}")
    steps = v.auroc_by_step.get("q0.99")
    if steps:
        lines.append("F AUROC@q0.99 after each step: " + ", ".join(_fmt(x) for x in steps))
    lost = (v.movement_summary.get("main") or {}).get("bf16_lost_share")
    if lost is not None:
        lines.append(f"bf16: {lost:.1%} of the moved coordinates' updates would round away in bf16 weights "
                     "(fp32 master weights keep them)")
    return lines + masked_lines(v)


def masked_lines(v: "ValidationRecord | dict") -> list[str]:
    """The masked fine-tuning table: each mask's density, trainable count, held-out objective and share recovered."""
    v = _record(v)
    masked = v.training_outcome.get("masked_fine_tuning")
    if not masked:
        return []
    lines = [f"masked fine-tuning (held-out {v.training_outcome['held_out_metric'].split(',')[0]}: "
             f"before {masked['before']:.4f}, full fine-tuning {masked['full_fine_tuning']:.4f}; "
             f"recovered = {masked['recovered']})",
             f"{'mask':<10} {'density':>8} {'trainable':>11} {'held-out after':>14} {'recovered':>9} "
             f"{'over seeds (min..max)':>22}"]
    for r in masked["runs"]:
        spread = r.get("recovered_spread")
        spread = f"{_fmt(spread['min'])}..{_fmt(spread['max'])}" if spread else "one seed"
        lines.append(f"{r['mask']:<10} {r['density']:>8.4f} {r['trainable']:>11,} {r['after']:>14.4f} "
                     f"{_fmt(r['recovered']):>9} {spread:>22}")
    return lines


def _fmt(x) -> str:
    return _num(x, 3)
