"""The report's "Experts" section: per MoE layer, how many sampled tokens each expert received and its bound mass.

Inputs (``expert_section``):

- ``fisher``: the run's F, parameter name -> tensor (``Run.fisher_for(objective)``);
- ``signal_scale``: the objective's S (None when unknown: the sum of bounds column is then n/a);
- ``token_counts``: per MoE layer, the number of routed tokens each expert received over the scored
  responses, ``{layer prefix: [count of expert 0, count of expert 1, ...]}``. The prefix is the MoE
  block's module name (``model.layers.0.mlp``, the module holding router and experts) or the experts
  module itself (``model.layers.0.mlp.experts``); both are accepted. A token routed to its top-k
  experts counts once for each, so a layer's counts sum to top-k times its routed tokens. ``None``, or
  a layer absent from it: counts unknown.
- ``position_counts`` (optional, keyed the same way): the same over every real position, prompts
  included (``Calibration.expert_positions``). A prompt token routed to an expert reaches the
  responses' log-probabilities through attention, so F > 0 is possible with no response token; with
  these counts an expert is unreached when no position at all reached it (then F = 0 exactly).

Experts are the slices along dim 0 of the layer's fused expert tensors (``stats.experts``); an
expert's **bound mass** is its sum of sqrt(F) over every fused tensor of the layer (the sum of its
bounds sqrt(F S) up to sqrt(S)). An expert that no sampled token reached has F = 0 because it was
never used in calibration, not because training cannot move it: it is flagged **unreached** (its
F says nothing; calibrate with prompts that reach it before trusting a selection that leaves it out).

``section.to_json()`` is the report.json entry, ``ExpertSection.from_json`` reads it back;
``markdown_lines(section)`` / ``html_section(section)`` render it like the other report sections.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from fisher_select.errors import FisherSelectError
from fisher_select.report.tables import html_table, markdown_table
from fisher_select.report.text import fmt, pct
from fisher_select.stats.experts import expert_masses, experts_by_module, fused_experts

UNREACHED = "unreached"  # no sampled token was routed to the expert: F = 0 says nothing
UNMOVED = "F = 0"  # tokens were routed to the expert, yet its F is 0 (its gradient vanished on them)
NO_TOKENS_BUT_F = "F > 0 without tokens"  # counts that cannot belong to this F
MARKDOWN_ROWS = 512  # above this many experts in all, report.md lists only the flagged ones (report.json has all)
UNREACHED_TEXT = ("F is zero because no sampled token was routed to it, not because training cannot move it; "
                  "calibrate with prompts that reach it before trusting a selection that leaves it out")


@dataclass
class ExpertLayer:
    """One MoE layer: per expert (index = position), tokens routed, masses and flag."""

    layer: str  # the MoE block (model.layers.0.mlp)
    module: str  # its experts module (model.layers.0.mlp.experts)
    tensors: list[str]  # the fused tensors the masses sum over
    tokens: list[int] | None  # routed tokens per expert; None: not recorded
    bound_mass: list[float]  # sum of sqrt(F) per expert
    fisher_mass: list[float]  # sum of F per expert
    flags: list[str]  # "" or one of UNREACHED, UNMOVED, NO_TOKENS_BUT_F
    positions: list[int] | None = None  # routed positions per expert, prompts included; None: not recorded

    @property
    def unreached(self) -> list[int]:
        return [e for e, f in enumerate(self.flags) if f == UNREACHED]


@dataclass
class ExpertSection:
    """Every MoE layer of a run, in name order."""

    signal_scale: float | None
    layers: list[ExpertLayer]

    def to_json(self) -> dict:
        return {"signal_scale": self.signal_scale, "layers": [asdict(layer) for layer in self.layers]}

    @classmethod
    def from_json(cls, data: dict) -> "ExpertSection":
        return cls(data.get("signal_scale"), [ExpertLayer(**layer) for layer in data.get("layers", [])])


def expert_section(fisher: Mapping[str, torch.Tensor], signal_scale: float | None,
                   token_counts: Mapping[str, Sequence[int]] | None = None,
                   position_counts: Mapping[str, Sequence[int]] | None = None) -> ExpertSection | None:
    """The section for a run's F (module docstring); None for a model without fused experts."""
    modules = experts_by_module(fused_experts({name: tuple(f.shape) for name, f in fisher.items()}))
    if not modules:
        return None
    counts = _counts_by_module(token_counts or {}, modules)
    positions = _counts_by_module(position_counts or {}, modules)
    layers = []
    for module, tensors in modules.items():
        bound, mass = expert_masses(fisher, tensors)
        tokens, reach = counts.get(module), positions.get(module)
        for what, given in (("token", tokens), ("position", reach)):
            if given is not None and len(given) != len(bound):
                raise FisherSelectError(f"{what} counts of {module} list {len(given)} experts but its fused tensors "
                                        f"hold {len(bound)}; pass one count per expert, in expert order")
        reached = reach if reach is not None else tokens  # any position reaching an expert can make its F > 0
        flags = [_flag(None if reached is None else reached[e], bound[e]) for e in range(len(bound))]
        layers.append(ExpertLayer(module.rpartition(".")[0], module, [t.param for t in tensors], tokens, bound,
                                  mass, flags, reach))
    return ExpertSection(signal_scale, layers)


def section_of(data: dict | None) -> ExpertSection | None:
    """The section stored in report.json (``RunReport.experts``); None for a run without one."""
    return None if not data else ExpertSection.from_json(data)


def _counts_by_module(token_counts: Mapping[str, Sequence[int]], modules) -> dict[str, list[int]]:
    """Experts module -> counts, the keys being MoE block or experts module names; refuses bad counts."""
    out = {}
    for key, counts in token_counts.items():
        module = key if key in modules else f"{key}.experts"
        if module not in modules:
            raise FisherSelectError(f"token counts name layer {key!r}, which has no fused experts in this run; "
                                    "key them by the MoE block (model.layers.0.mlp) or its experts module")
        out[module] = _whole_counts(key, counts)
    return out


def _whole_counts(key: str, counts: Sequence[int]) -> list[int]:
    try:
        values = [int(c) for c in counts]
        whole = all(v == c for v, c in zip(values, counts))
    except (TypeError, ValueError):
        whole = False
    if not whole or any(v < 0 for v in values):
        raise FisherSelectError(f"token counts of {key!r} must be whole numbers >= 0, one per expert; got "
                                f"{list(counts)[:8]}")
    return values


def _flag(tokens: int | None, bound: float) -> str:
    if tokens == 0:
        return UNREACHED if bound == 0.0 else NO_TOKENS_BUT_F
    return UNMOVED if bound == 0.0 else ""


# ---------------------------------------------------------------------------
# Rendering (report.md, report.html)

INTRO = ("Per MoE layer: routed tokens each expert received over the scored responses (a token counts once for "
         "each of its top-k experts), its bound mass (sum of sqrt(F) over its slices of the fused expert tensors) "
         "and share of the layer's. An expert that no sampled token reached has F = 0 because it was never used, "
         "not because training cannot move it.")
SUMMARY_HEADER = ("layer", "experts", "tokens routed", "unreached", "largest bound share", "smallest bound share")
DETAIL_HEADER = ("expert", "tokens", "token share", "bound mass sum sqrt(F)", "bound share", "sum of bounds sqrt(F S)",
                 "Fisher mass sum F", "flag")


def _shares(values: Sequence[float]) -> list[float]:
    total = math.fsum(values)
    return [v / total if total > 0 else 0.0 for v in values]


def summary_rows(section: ExpertSection) -> list[list[str]]:
    """One row per layer (SUMMARY_HEADER)."""
    rows = []
    for layer in section.layers:
        shares = _shares(layer.bound_mass)
        tokens = "n/a" if layer.tokens is None else f"{sum(layer.tokens):,}"
        unreached = ", ".join(str(e) for e in layer.unreached) or ("none" if layer.tokens is not None else "n/a")
        big, small = max(range(len(shares)), key=shares.__getitem__), min(range(len(shares)), key=shares.__getitem__)
        rows.append([layer.layer, str(len(shares)), tokens, unreached, f"{pct(shares[big])} (expert {big})",
                     f"{pct(shares[small])} (expert {small})"])
    return rows


def detail_rows(section: ExpertSection, layer: ExpertLayer, flagged_only: bool = False) -> list[list[str]]:
    """One row per expert of ``layer`` (DETAIL_HEADER); ``flagged_only``: the flagged experts only."""
    root = None if section.signal_scale is None else math.sqrt(section.signal_scale)
    token_shares = None if layer.tokens is None else _shares(layer.tokens)
    rows = []
    for e, (bound, share) in enumerate(zip(layer.bound_mass, _shares(layer.bound_mass))):
        if flagged_only and not layer.flags[e]:
            continue
        rows.append([str(e), "n/a" if layer.tokens is None else f"{layer.tokens[e]:,}",
                     pct(None if token_shares is None else token_shares[e]), fmt(bound), pct(share),
                     fmt(None if root is None else bound * root), fmt(layer.fisher_mass[e]), layer.flags[e]])
    return rows


def findings(section: ExpertSection) -> list[str]:
    """Plain sentences: the unreached experts of each layer, and counts that cannot belong to this F."""
    out = []
    for layer in section.layers:
        if layer.unreached:
            out.append(f"{layer.layer}: experts {', '.join(map(str, layer.unreached))} received no sampled token "
                       f"({len(layer.unreached)} of {len(layer.flags)}): {UNREACHED_TEXT}.")
        odd = [e for e, f in enumerate(layer.flags) if f == NO_TOKENS_BUT_F]
        if odd:
            out.append(f"{layer.layer}: experts {', '.join(map(str, odd))} have F > 0 but no routed token: the token "
                       "counts do not belong to this F (a bug; please report it).")
    if section.layers and all(layer.tokens is None for layer in section.layers):
        out.append("Routed token counts were not recorded for this run, so experts with F = 0 cannot be told apart "
                   "from experts no token reached.")
    return out


def markdown_lines(section: ExpertSection | None) -> list[str]:
    """The section for report.md ([] without MoE layers); past MARKDOWN_ROWS experts, flagged experts only."""
    if section is None or not section.layers:
        return []
    out = ["", "## Experts (MoE layers)", "", INTRO, ""] + markdown_table(SUMMARY_HEADER, summary_rows(section))
    flagged_only = sum(len(layer.flags) for layer in section.layers) > MARKDOWN_ROWS
    for layer in section.layers:
        rows = detail_rows(section, layer, flagged_only)
        if rows:
            out += ["", f"### {layer.layer}" + (" (flagged experts only; report.json has all)" if flagged_only else ""),
                    ""] + markdown_table(DETAIL_HEADER, rows)
    notes = findings(section)
    return out + ([""] + [f"- {n}" for n in notes] if notes else [])


def html_section(section: ExpertSection | None) -> str:
    """The section for report.html ("" without MoE layers); each layer's experts in a <details>."""
    if section is None or not section.layers:
        return ""
    e = html.escape
    out = f"<h2>Experts (MoE layers)</h2><p>{e(INTRO)}</p>" + html_table(SUMMARY_HEADER, summary_rows(section))
    notes = findings(section)
    if notes:
        out += '<div class="warn"><ul>' + "".join(f"<li>{e(n)}</li>" for n in notes) + "</ul></div>"
    for layer in section.layers:
        out += (f"<details><summary>{e(layer.layer)}: {len(layer.flags)} experts</summary>"
                + html_table(DETAIL_HEADER, detail_rows(section, layer)) + "</details>")
    return out
