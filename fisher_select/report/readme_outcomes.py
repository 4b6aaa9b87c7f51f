"""The README's "Does it work?" block, generated from the outcome study's protocol 2 records.

``readme_block(results)`` reads every ``outcomes-<kind>.json`` of protocol 2 under ``results``
(``bench/results``; protocol 1 files are skipped: their results are withdrawn) and writes one table
per kind: per arm and budget the recovered share of full fine-tuning's gain with its 95% bootstrap
interval over replicates and the forgetting (KL per token on general responses), then the paired
verdict of the bound against the best peer at each budget. With no protocol 2 record it says so.
``rewrite_block(path, block)`` replaces what lies between ``BEGIN`` and ``END`` in a file.
"""

from __future__ import annotations

import math

import json
from pathlib import Path

from fisher_select.atomic import write_file
from fisher_select.errors import FisherSelectError
from fisher_select.report.outcome_tables import worse_than_start
from fisher_select.run.outcomes import OutcomesRecord, read_outcomes
from fisher_select.stats.bootstrap import bootstrap_interval

BEGIN = "<!-- outcomes:begin -->"
END = "<!-- outcomes:end -->"
NO_RESULT = ("**No protocol-2 result exists yet.** The outcome study (docs/OUTCOMES.md) is under way, its finished "
             "cells committed in `bench/results/cells/`, and no kind is complete, so nothing here says whether the bound's mask beats the cheap rules at any budget. The protocol-1 table was withdrawn: "
             "its splits shared prompts and its lr grids stopped at their edges.")
OWN_COUNT = "own count"


def protocol2_records(results) -> list[OutcomesRecord]:
    """Every protocol 2 ``outcomes-*.json`` under ``results``, by kind (protocol 1 files are skipped)."""
    out = []
    for path in sorted(Path(results).glob("outcomes-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise FisherSelectError(f"{path} is unreadable ({err}); rebuild it with bench/outcomes.py --assemble") from None
        if isinstance(data, dict) and "protocol" in data:
            out.append(read_outcomes(data))
    return sorted(out, key=lambda r: r.kind)


def _cell(arm: dict) -> str:
    shares = [m["recovered"] for m in arm["replicates"].values() if m.get("recovered") is not None]
    if not shares:
        return "-"
    mean = sum(shares) / len(shares)
    lo_hi = bootstrap_interval(shares)
    text = f"{mean:.2f}" + ("" if lo_hi is None else f" [{lo_hi[0]:.2f}, {lo_hi[1]:.2f}]")
    kl = arm.get("forgetting_kl")
    text += "" if not kl else f"; KL {kl['mean']:.3g}"
    worse, n = worse_than_start(arm)
    text += f"; worse than start in {worse}/{n}" if worse else ""
    return text + (" *" if arm.get("lr_on_edge") else "")


def _split(name: str) -> tuple[str, str]:
    arm, _, budget = name.partition("@")
    return arm, budget or OWN_COUNT


def kind_table(record: OutcomesRecord) -> list[str]:
    """One kind's table: arms by budget (recovered [95% interval]; KL), then the bound's verdict per budget."""
    budgets = [f"{b:g}" for b in record.settings["budgets"]]
    columns = budgets + [OWN_COUNT]
    arms: dict[str, dict[str, str]] = {}
    for name, arm in record.arms.items():
        if name in ("start", "full"):
            continue
        base, budget = _split(name)
        arms.setdefault(base, {})[budget] = _cell(arm)
    order = sorted(arms, key=lambda a: (a != "bound", a))  # the bound first
    t, d = record.trained, record.discriminates
    told = ("trained: not judged yet (fewer than 2 held-out replicates of full fine-tuning)" if t.get("se") is None
            else f"trained {'yes' if t['trained'] else 'NO'} (full fine-tuning's held-out improvement "
                 f"{t['mean']:.3g} ± {t['se']:.2g} SE over {t['n']} replicates)")
    lines = [f"**{record.kind}**: {told}; the task "
             + {True: "discriminates", False: "does NOT discriminate", None: "was not tested for discrimination"}[
                 d.get("discriminates")] + " (random at 0.01% against 80% of full fine-tuning's content gain).",
             "", "| arm | " + " | ".join(f"{float(b):.3%}" for b in budgets) + f" | {OWN_COUNT} |",
             "|---|" + "---|" * len(columns)]
    lines += [f"| {a} | " + " | ".join(arms[a].get(c, "") for c in columns) + " |" for a in order]
    verdicts = []
    for b in budgets:
        v = record.verdicts.get(b)
        verdicts.append("-" if v is None else f"**{v['verdict']}** vs {v['best_peer']} ({_difference(v)})")
    lines.append("| the bound vs the best peer | " + " | ".join(verdicts) + " | |")
    forgets = [_forgets(record.verdicts.get(b)) for b in budgets]
    if any(f != "-" for f in forgets):
        lines.append("| its forgetting (KL) vs that peer | " + " | ".join(forgets) + " | |")
    return lines


def _forgets(verdict: dict | None) -> str:
    kl = (verdict or {}).get("forgetting_kl")
    if kl is None:
        return "-"
    return f"**{kl['verdict']}** ({_difference(kl)})"


def _difference(v: dict) -> str:
    """'+m [lo, hi]' with two decimals, or two significant digits of the largest when all three are under 0.1
    (distillation's KL differences are thousandths: two decimals would print them as 0.00)."""
    values = (v["mean_difference"], *v["interval"])
    top = max(abs(x) for x in values)
    places = 2 if top >= 0.1 or top == 0 else 1 - math.floor(math.log10(top))
    lo, hi = v["interval"]
    return f"{values[0]:+.{places}f} [{lo:.{places}f}, {hi:.{places}f}]"


def readme_block(results) -> str:
    """The block between the README's markers: a table per protocol 2 kind, or the plain statement that none exists."""
    records = protocol2_records(results)
    if not records:
        return NO_RESULT
    lines = ["Share of full fine-tuning's held-out gain each arm recovers (mean over replicates [95% bootstrap "
             "interval]; KL: forgetting, per token, on the starting model's own responses to general prompts; "
             "`*`: lr still on its grid's edge; \"worse than start in k/n\": in k of n replicates the arm's held-out outcome "
             "fell below the untrained model's). Verdict: the paired difference of the bound's share against the best "
             "peer's, wins or loses when its 95% bootstrap interval excludes 0 and the paired t-test gives p < 0.05, "
             "else ties; and its KL forgetting against that peer's, less or more by the same rule. Generated from "
             "`bench/results/outcomes-<kind>.json` by `scripts/readme_outcomes.py`."]
    for record in records:
        lines += ["", *kind_table(record)]
    missing = _missing_kinds({r.kind for r in records})
    if missing:
        lines += ["", f"**No result yet for {' or '.join(missing)}.** The study's cells for "
                      f"{'them' if len(missing) > 1 else 'it'} are under way (docs/OUTCOMES.md), and nothing above "
                      f"speaks for {'those objectives' if len(missing) > 1 else 'that objective'}."]
    return "\n".join(lines)


def _missing_kinds(kinds: set[str]) -> list[str]:
    """The core's objectives with no record: RL, and distillation (any ``opd-*`` kind)."""
    return [name for name, found in (("RL", "rl" in kinds), ("distillation", any(k.startswith("opd") for k in kinds)))
            if not found]


def rewrite_block(path, block: str) -> bool:
    """Replace the text between ``BEGIN`` and ``END`` in ``path`` by ``block`` (atomically); True if it changed."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise FisherSelectError(f"{path} must hold the markers {BEGIN} and {END} once each, in that order (found "
                                f"{text.count(BEGIN)} and {text.count(END)}); add them around the outcomes block")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    new = f"{head}{BEGIN}\n{block}\n{END}{tail}"
    if new == text:
        return False
    write_file(path, lambda tmp: tmp.write_text(new, encoding="utf-8"), overwrite=True)
    return True
