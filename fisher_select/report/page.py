"""A self-contained HTML report (inline SVG plots, no JavaScript, no network)."""

from __future__ import annotations

import html
import math
import re
from pathlib import Path

import torch

from fisher_select.caveats import CAVEATS

_STYLE = """body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:left}
.caveat{background:#fff4e5;border-left:4px solid #f0a020;padding:.5em 1em}"""


def _bars(labels: list[str], values: list[float], title: str, width: int = 900) -> str:
    """A horizontal bar chart as inline SVG."""
    top = max(values) if values and max(values) > 0 else 1.0
    row, left = 16, 330
    parts = [f'<svg width="{width}" height="{row * len(values) + 30}" role="img"><title>{html.escape(title)}</title>',
             f'<text x="0" y="12" font-size="13" font-weight="bold">{html.escape(title)}</text>']
    for i, (label, v) in enumerate(zip(labels, values)):
        y = 20 + i * row
        w = (width - left - 80) * v / top
        parts.append(f'<text x="{left - 6}" y="{y + 11}" font-size="11" text-anchor="end">{html.escape(label)}</text>'
                     f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{row - 3}" fill="#4a7bd0"/>'
                     f'<text x="{left + w + 4:.1f}" y="{y + 11}" font-size="11">{v:.3g}</text>')
    return "".join(parts) + "</svg>"


def _log_histogram(fisher: dict[str, torch.Tensor], bins: int = 40) -> tuple[list[str], list[float]]:
    """Histogram of log10 F over all coordinates with F > 0 (and the count of exact zeros)."""
    logs, zeros = [], 0
    for f in fisher.values():
        flat = f.reshape(-1).double()
        zeros += int((flat <= 0).sum())
        logs.append(flat[flat > 0].log10())
    values = torch.cat(logs) if logs else torch.zeros(0)
    if values.numel() == 0:
        return ["F = 0"], [float(zeros)]
    lo, hi = math.floor(float(values.min())), math.ceil(float(values.max()))
    counts = torch.histc(values, bins=bins, min=lo, max=hi if hi > lo else lo + 1)
    step = (hi - lo) / bins if hi > lo else 1 / bins
    labels = [f"1e{lo + i * step:.1f}" for i in range(bins)]
    return ["F = 0"] + labels, [float(zeros)] + counts.tolist()


def _by_kind(modules: list[dict]) -> tuple[list[str], list[float]]:
    """Fisher mass summed over layers by module kind (q_proj, mlp.up_proj, ...)."""
    kinds: dict[str, float] = {}
    for m in modules:
        kind = re.sub(r"\.\d+\.", ".*.", m["name"])
        kinds[kind] = kinds.get(kind, 0.0) + m["fisher_mass"]
    items = sorted(kinds.items(), key=lambda kv: -kv[1])
    return [k for k, _ in items], [v for _, v in items]


def write_html(path: Path, report: dict, cal) -> None:
    mods = report["modules"]
    top = mods[:30]
    kinds, kind_mass = _by_kind(mods)
    hist_labels, hist_counts = _log_histogram(cal.fisher)
    rows = "".join(
        f"<tr><td>{html.escape(o['name'])}</td><td>{html.escape(o['type'])}</td><td>{html.escape(str(o['signal']))}</td>"
        f"<td>{o['signal_scale']}</td></tr>" for o in report["objectives"])
    caveats = "".join(f"<li>{html.escape(c)}</li>" for c in CAVEATS)
    body = f"""<!doctype html><html><head><meta charset="utf-8"><title>fisher_select run {report['run_id']}</title>
<style>{_STYLE}</style></head><body>
<h1>fisher_select run {html.escape(report['run_id'])}</h1>
<div class="caveat"><b>What these numbers do not promise</b><ul>{caveats}</ul></div>
<p>Model <b>{html.escape(report['model']['name'])}</b> ({report['model']['fingerprint']['num_parameters']:,} parameters),
{report['num_prompts']} prompts &times; {report['samples_per_prompt']} samples = {report['num_samples']} responses
drawn by plain ancestral sampling; truncated at max_new_tokens: {report['truncation_rate']:.1%}.
Score-mean check (RMS z, about 1 expected): {report['checks'].get('score_mean', {}).get('rms_z', float('nan')):.2f}.</p>
<h2>Objectives</h2><table><tr><th>name</th><th>type</th><th>signal</th><th>scale S</th></tr>{rows}</table>
<h2>Fisher mass</h2>
{_bars([m['name'] for m in top], [m['fisher_mass'] for m in top], 'Top 30 modules by Fisher mass')}
{_bars(kinds[:25], kind_mass[:25], 'Fisher mass by module kind, summed over layers')}
{_bars(hist_labels, hist_counts, 'Coordinates by log10 Fisher')}
</body></html>
"""
    path.write_text(body)
