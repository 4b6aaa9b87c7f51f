"""The report's "Validation" section: what `fisher-select validate` measured for this run.

Read from ``RUN/validation-*/validation.json`` (one per validation, written by
``fisher_select.studies.validate``); report.md and report.html show one table row per
validation and say plainly where the ranking did not predict realized movement.
"""

from __future__ import annotations

import html

from fisher_select.rundir import VALIDATION_GLOB, read_json_files

NO_PREDICTION = 0.6  # an AUROC below this: the ranking says (almost) nothing about which coordinates moved
BASELINES = (("random", "random"), ("magnitude", "abs(theta)"), ("single_batch_gradient", "1-batch abs(grad)"),
             ("second_seed", "other seed"), ("spectrum_snr", "Spectrum SNR"), ("kappa", "KappaTune"))
HEADER = (["validation", "training", "F AUROC"] + [label for _, label in BASELINES]
          + ["Adam-aware (beyond the bound)", "F precision@1%", "module rho sum sqrt(F)", "module rho sum F",
             "first-step violations (noise alone)"])


def load_validations(run_dir) -> list[tuple[str, dict]]:
    """(directory name, validation.json) of every validation inside ``run_dir`` (none: [])."""
    return read_json_files(run_dir, VALIDATION_GLOB, "delete it or rerun validate with --overwrite")


def _num(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _auroc(entry: dict) -> str:  # "(tied)": every score equal (e.g. a zero gradient), chance by construction
    return _num((entry.get("auroc") or {}).get("q0.99")) + (" (tied)" if entry.get("degenerate") else "")


def _training(v: dict) -> str:
    s = v.get("settings", {})
    return (f"{v.get('objective', {}).get('type', '?')}, {s.get('optimizer', '?')} lr {s.get('lr')} "
            f"wd {s.get('weight_decay')}, {s.get('steps')} steps of {s.get('prompts_per_step')} x "
            f"{s.get('samples_per_prompt')}")


def _first_step(v: dict) -> str:
    fs = v.get("first_step", {})
    if fs.get("violation_rate") is None:
        return "n/a (no S for the trained objective)"
    return f"{fs['violation_rate']:.1e} ({fs.get('noise_violation_rate', 0):.1e})"


def rows(validations: list[tuple[str, dict]]) -> list[list[str]]:
    """One table row per validation: AUROC for "moved" = the realized top 1%, beside every baseline."""
    out = []
    for name, v in validations:
        base, sm = v.get("baselines", {}), v.get("spearman_modules", {})
        out.append([name, _training(v), _auroc(v)] + [_auroc(base.get(k, {})) for k, _ in BASELINES]
                   + [_auroc(v.get("adam_aware", {})), _num((v.get("precision_at_k") or {}).get("0.01")),
                      _num(sm.get("sum_sqrt_fisher")), _num(sm.get("sum_fisher")), _first_step(v)])
    return out


def findings(validations: list[tuple[str, dict]]) -> list[str]:
    """Plain sentences: where the ranking did not predict movement, and each validation's caveats."""
    out = []
    for name, v in validations:
        auc = (v.get("auroc") or {}).get("q0.99")
        if auc is not None and auc < NO_PREDICTION:
            out.append(f"{name}: the F ranking does NOT predict which coordinates moved (AUROC {auc:.2f}; "
                       f"0.5 is chance) under {_training(v)}; do not trust a mask from it for this training.")
        masked = (v.get("training_outcome") or {}).get("masked_fine_tuning")
        if masked:
            shares = "; ".join(f"{r['mask']} at density {r['density']:.3g}: {_num(r['recovered'])}"
                               for r in masked["runs"])
            out.append(f"{name}: masked fine-tuning, same steps and seed, share of full fine-tuning's held-out "
                       f"improvement recovered: {shares}.")
        out += [f"{name}: {c}" for c in v.get("caveats", [])]
    return out


INTRO = ("AUROC of each ranking for \"moved\" = the realized top 1% of |delta theta| after a short real "
         "fine-tuning from the calibration point (fp32 movement, seeded coordinate subsample); 0.5 is chance, "
         "\"other seed\" is the ceiling (how well one training run predicts another). Module rho: Spearman "
         "correlation of a module aggregate with the module's summed movement. Details and plots: each "
         "validation's directory.")


def markdown_lines(validations: list[tuple[str, dict]]) -> list[str]:
    if not validations:
        return []
    table = [" | ".join(HEADER), "|".join(["---"] * len(HEADER))]
    table += [" | ".join(c.replace("|", "\\|") for c in r) for r in rows(validations)]
    out = ["", "## Validation against training", "", INTRO, ""] + [f"| {t} |" for t in table]
    notes = findings(validations)
    return out + ([""] + [f"- {n}" for n in notes] if notes else [])


def html_section(validations: list[tuple[str, dict]]) -> str:
    if not validations:
        return ""
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in HEADER)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows(validations))
    notes = "".join(f"<li>{e(n)}</li>" for n in findings(validations))
    return (f"<h2>Validation against training</h2><p>{e(INTRO)}</p><table><tr>{head}</tr>{body}</table>"
            + (f"<ul>{notes}</ul>" if notes else ""))
