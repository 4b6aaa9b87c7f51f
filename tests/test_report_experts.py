"""The report's Experts section on a tiny MoE: F from a brute-force per-sample loop, token counts from the routers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fisher_select.errors import FisherSelectError
from fisher_select.report import experts as rx
from tests.test_experts import _routed
from tests.tiny_moe_experts import EXPERTS, tiny_moe

PROMPTS = ([5], [9])  # one token each: each reaches top-2 of 4 experts per layer, so some experts stay unreached


def brute_force(family: str):
    """(model, F, token counts): F = sum over samples of the squared gradient of the sample's log-likelihood,
    one backward per sample; counts = per MoE block, tokens its router sent to each expert."""
    model = tiny_moe(family).double()
    fisher = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    counts: dict[str, list[int]] = {}
    for ids in PROMPTS:
        model.zero_grad()
        picked, logits = _routed(model, torch.tensor([ids]))
        logp = torch.log_softmax(logits.double(), -1)[0, -1]  # (V,)
        logp[3].backward()  # the score of one sampled next token
        for n, p in model.named_parameters():
            fisher[n] += p.grad.detach() ** 2
        for block, experts in picked.items():
            row = counts.setdefault(block, [0] * EXPERTS)
            for e in experts:
                row[e] += 1
    return model, fisher, counts


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_section_masses_tokens_and_flags(family):
    model, fisher, counts = brute_force(family)
    section = rx.expert_section(fisher, 4.0, counts)
    assert [layer.layer for layer in section.layers] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    unreached_total = 0
    for layer in section.layers:
        assert layer.tokens == counts[layer.layer]
        assert sum(layer.tokens) == 2 * len(PROMPTS)  # top-2: each token counted for both of its experts
        for e in range(EXPERTS):  # brute force: coordinate by coordinate over the experts module's parameters
            coords = [v for n, f in fisher.items() if n.startswith(layer.module + ".") for v in f[e].reshape(-1).tolist()]
            assert layer.bound_mass[e] == pytest.approx(math.fsum(math.sqrt(v) for v in coords), rel=1e-12)
            assert layer.fisher_mass[e] == pytest.approx(math.fsum(coords), rel=1e-12)
            assert (layer.flags[e] == rx.UNREACHED) == (layer.tokens[e] == 0)
            assert (layer.bound_mass[e] == 0.0) == (layer.tokens[e] == 0)  # unreached <=> F = 0 here
        unreached_total += len(layer.unreached)
    assert unreached_total > 0  # the case the section exists for
    again = rx.ExpertSection.from_json(json.loads(json.dumps(section.to_json())))
    assert again == section
    md = "\n".join(rx.markdown_lines(section))
    assert "## Experts (MoE layers)" in md and rx.UNREACHED_TEXT in md and "### model.layers.1.mlp" in md
    row = rx.detail_rows(section, section.layers[0])[0]
    assert row[5] == rx.fmt(section.layers[0].bound_mass[0] * 2.0)  # sum of bounds = sqrt(S) * bound mass
    page = rx.html_section(section)
    assert page.startswith("<h2>Experts (MoE layers)</h2>") and page.count("<details>") == 2
    assert rx.UNREACHED_TEXT in page


def test_keys_unknown_counts_and_bad_input(monkeypatch):
    _, fisher, counts = brute_force("mixtral")
    by_module = {f"{k}.experts": v for k, v in counts.items()}  # the experts module's name works too
    assert rx.expert_section(fisher, None, by_module) == rx.expert_section(fisher, None, counts)
    unknown = rx.expert_section(fisher, None, None)
    assert all(layer.tokens is None and rx.UNREACHED not in layer.flags for layer in unknown.layers)
    assert any(rx.UNMOVED in layer.flags for layer in unknown.layers)  # F = 0, reason unknown
    assert "were not recorded" in rx.findings(unknown)[-1]
    assert rx.detail_rows(unknown, unknown.layers[0])[0][5] == "n/a"  # S unknown: no sum of bounds
    with pytest.raises(FisherSelectError, match="no fused experts"):
        rx.expert_section(fisher, None, {"model.layers.7.mlp": [1] * EXPERTS})
    with pytest.raises(FisherSelectError, match="list 3 experts"):
        rx.expert_section(fisher, None, {"model.layers.0.mlp": [1, 1, 1]})
    for bad in ([1, -1, 0, 0], [1, 0.5, 0, 0], ["a", 0, 0, 0]):
        with pytest.raises(FisherSelectError, match="whole numbers"):
            rx.expert_section(fisher, None, {"model.layers.0.mlp": bad})
    assert rx.expert_section(fisher, None, {"model.layers.0.mlp": torch.tensor([1, 0, 2, 1])}).layers[0].tokens == [1, 0, 2, 1]
    odd = {"model.layers.0.mlp": [0 if f else 1 for f in rx.expert_section(fisher, None, counts).layers[0].tokens]}
    flipped = rx.expert_section(fisher, None, odd)  # zero counts where F > 0: refused as a bug in the findings
    assert rx.NO_TOKENS_BUT_F in flipped.layers[0].flags and "do not belong" in " ".join(rx.findings(flipped))
    monkeypatch.setattr(rx, "MARKDOWN_ROWS", 1)
    short = "\n".join(rx.markdown_lines(rx.expert_section(fisher, None, counts)))
    assert "flagged experts only" in short and short.count("\n| 0 |") + short.count("\n| 1 |") <= 4


def test_dense_model_has_no_section():
    assert rx.expert_section({"model.layers.0.mlp.up_proj.weight": torch.ones(2, 2)}, 1.0, None) is None
    assert rx.markdown_lines(None) == [] and rx.html_section(None) == ""
