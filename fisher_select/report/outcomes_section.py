"""The report's "Outcomes at matched budgets" section: what the outcome study measured from this run.

Read from ``RUN/outcomes-<kind>/outcomes.json``. A protocol 2 record (``run.outcomes``, written by
``bench/outcomes.py --v2 --assemble --keep-in RUN``) shows the study's tables with their intervals
(``report.outcome_tables``): per arm the recovered share and forgetting over replicates, the paired
statistics of the bound against each peer, and the verdict per budget. A protocol 1 study
(withdrawn, kept for one release) shows its old table: for each method at its budget, the share of
full fine-tuning's held-out improvement it recovered, and where a simpler rule matched the bound.
"""

from __future__ import annotations

import base64
import html
import math
import statistics
from pathlib import Path

from fisher_select.report.outcome_tables import record_markdown
from fisher_select.report.tables import html_table
from fisher_select.run.io import read_json_files
from fisher_select.run.names import OUTCOMES_GLOB, OUTCOMES_PLOT
from fisher_select.run.outcomes import read_outcomes

# The fisher_select choice each peer is held against: masks at the same density, LoRA and SHiRA
# at the same trainable count.
OURS = {"mask": "bound", "lora": "lora_config", "shira": "shira_fisher"}


def load_outcomes(run_dir) -> list[tuple[str, dict]]:
    """(directory name, outcomes.json) of every outcome study inside ``run_dir`` (none: [])."""
    return read_json_files(run_dir, OUTCOMES_GLOB, "delete it or rerun bench/outcomes.py")


def _fmt(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _spread(m: dict) -> str:
    known = [s for s in m["recovered"] if s is not None]
    return f"{_fmt(min(known))}..{_fmt(max(known))}" if known else "n/a"


HEADER = ("method", "kind", "density", "trainable", "lr chosen", "recovered (mean)", "min..max over seeds")


def _headline(report: dict) -> str:
    full = report["full"]
    return (f"{report['kind']}: {report['task']['metric']}; held-out before {full['held_out_before']:.4f}, "
            f"full fine-tuning after {statistics.fmean(full['held_out_after']):.4f} "
            f"(lr {full['lr_chosen']:.3g}, gain z over seeds = {_fmt(full['improvement_z'])})")


def _rows(report: dict) -> list[list[str]]:
    """One row per method, in HEADER's columns."""
    rows = []
    for key, m in report["methods"].items():
        if "unavailable" in m:
            rows.append([key, m["kind"], "", "", "", "unavailable", m["unavailable"]])
            continue
        rows.append([key, m["kind"], f"{m['density']:.2e}", f"{m['trainable']:,}", f"{m['lr_chosen']:.3g}",
                     _fmt(m["recovered_mean"]), _spread(m)])
    return rows


def outcome_table(report: dict) -> list[str]:
    """Markdown: each method's budget, lr and held-out share of full fine-tuning's gain (mean, min..max)."""
    kind = report["kind"]
    lines = [_headline(report).replace(kind, f"**{kind}**", 1), "", "| " + " | ".join(HEADER) + " |",
             "|---|---|---:|---:|---:|---:|---|"]
    return lines + ["| " + " | ".join(r) + " |" for r in _rows(report)]


def _peers(methods: dict) -> list[tuple[str, str, dict, dict]]:
    """(our key, peer key, ours, peer) for every peer at our budget: same kind, same requested density."""
    out = []
    for key, m in methods.items():
        ours_name = OURS.get(m.get("kind"))
        if ours_name is None or key.split("@")[0] == ours_name or "unavailable" in m:
            continue
        ours_key = ours_name + ("@" + key.split("@")[1] if "@" in key else "")
        ours = methods.get(ours_key)
        if ours is not None and "unavailable" not in ours and ours.get("recovered_mean") is not None:
            out.append((ours_key, key, ours, m))
    return out


def findings(report: dict) -> list[str]:
    """Plain sentences: each peer that matched or beat fisher_select's choice at the same budget."""
    out = []
    for ours_key, key, ours, peer in _peers(report["methods"]):
        if peer.get("recovered_mean") is None or peer["recovered_mean"] < ours["recovered_mean"]:
            continue
        ours_seeds = [s for s in ours["recovered"] if s is not None]
        clear = ours_seeds and min(s for s in peer["recovered"] if s is not None) > max(ours_seeds)
        out.append(f"{key} recovered {_fmt(peer['recovered_mean'])} ({_spread(peer)}) against {ours_key}'s "
                   f"{_fmt(ours['recovered_mean'])} ({_spread(ours)}): "
                   + ("it beats fisher_select's choice on every seed." if clear else
                      "at least as good as fisher_select's choice on the mean, within the spread over seeds."))
    return out


def _intro(report: dict) -> str:
    s = report.get("settings", {})
    return (f"Share of full fine-tuning's held-out improvement each method recovers at its budget "
            f"({s.get('optimizer', '?')}, {s.get('steps', '?')} steps, {s.get('seeds', '?')} seeds; every method at "
            f"its own learning rate chosen on validation prompts, reported on held-out prompts).")


def is_protocol2(report: dict) -> bool:
    return "protocol" in report  # protocol 1 files have no "protocol" key


def _v2_intro(settings: dict) -> str:
    return (f"Protocol 2: {settings.get('replicates', '?')} replicates, each with its own calibration and draw of "
            f"training, validation and held-out prompts; {settings.get('optimizer', '?')}, {settings.get('steps', '?')} "
            "steps; every arm at the lr the pilot replicate chose on validation (`*`: still on its grid's edge). "
            "Means ± standard error over replicates; paired differences of the bound against each peer with 95% "
            "bootstrap intervals, paired t and Wilcoxon p-values.")


def _v2_lines(name: str, report: dict) -> list[str]:
    record = read_outcomes(report)
    return ["", f"### {name} (protocol 2)", "", _v2_intro(record.settings), "", *record_markdown(record)]


def markdown_lines(outcomes: list[tuple[str, dict]]) -> list[str]:
    if not outcomes:
        return []
    out = ["", "## Outcomes at matched budgets"]
    for name, report in outcomes:
        if is_protocol2(report):
            out += _v2_lines(name, report)
            continue
        out += ["", f"### {name}", "", _intro(report), ""] + outcome_table(report)
        notes = findings(report)
        out += ([""] + [f"- {n}" for n in notes]) if notes else ["", "- No peer matched fisher_select's choice."]
        out += ["", f"Plot: `{name}/{OUTCOMES_PLOT}`."]
    return out


def _image(run_dir, name: str) -> str:
    path = Path(run_dir) / name / OUTCOMES_PLOT if run_dir is not None else None
    if path is None or not path.is_file():
        return ""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="recovery against density, {html.escape(name)}" src="data:image/png;base64,{data}">'


def html_section(outcomes: list[tuple[str, dict]], run_dir=None) -> str:
    if not outcomes:
        return ""
    e = html.escape
    parts = ["<h2>Outcomes at matched budgets</h2>"]
    for name, report in outcomes:
        if is_protocol2(report):
            parts.append(markdown_html(_v2_lines(name, report)))
            continue
        notes = findings(report) or ["No peer matched fisher_select's choice."]
        parts.append(f"<h3>{e(name)}</h3><p>{e(_intro(report))}</p><p>{e(_headline(report))}</p>"
                     + html_table(HEADER, _rows(report)) +
                     f"<ul>{''.join(f'<li>{e(n)}</li>' for n in notes)}</ul>{_image(run_dir, name)}")
    return "".join(parts)


def markdown_html(lines: list[str]) -> str:
    """The few markdown forms the protocol 2 section uses, as HTML: ### headings, tables, bullets, paragraphs."""
    e, parts, i = html.escape, [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                if not set(lines[i]) <= set("|-: "):  # the separator row
                    rows.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            parts.append(html_table(rows[0], rows[1:]))
            continue
        if line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{e(lines[i][2:])}</li>")
                i += 1
            parts.append(f"<ul>{''.join(items)}</ul>")
            continue
        if line.startswith("### "):
            parts.append(f"<h3>{e(line[4:])}</h3>")
        elif line:
            parts.append(f"<p>{e(line)}</p>")
        i += 1
    return "".join(parts)
