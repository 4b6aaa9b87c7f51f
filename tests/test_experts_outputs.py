"""Per-expert outputs on tiny MoE runs: select --per-module per expert, LoRA target_parameters, axolotl export."""

from __future__ import annotations

import pytest
import torch

from fisher_select.models import fingerprint
from fisher_select.outputs.masks import select_masks
from fisher_select.stats.experts import fused_experts_of
from fisher_select.stats.ranking import top_count
from tests import runs
from tests.test_select import assert_masks_equal, first_k_by_value, smallest_mass_set
from tests.tiny_moe import EXPERTS, tiny_moe


def moe_run(family: str, seed: int = 0, dead: int | None = None):
    """(model, run) with a random F spanning orders of magnitude per parameter; expert ``dead`` has F = 0."""
    model = tiny_moe(family)
    gen = torch.Generator().manual_seed(seed)
    fisher = {n: torch.rand(p.shape, generator=gen, dtype=torch.float64).float()
              * 10 ** (3 * torch.rand(1, generator=gen).item()) for n, p in model.named_parameters()}
    if dead is not None:
        for name in fused_experts_of(model):
            fisher[name][dead] = 0.0
    run = runs.make_run(fisher, objectives=[{"name": "rl", "signal_scale": 0.5}], fingerprint=fingerprint(model),
                        model_name=family, run_id=f"run-{family}")
    return model, run


def _reference(values: torch.Tensor, rule: str, q: float) -> torch.Tensor:
    if rule == "top":
        return first_k_by_value(values, top_count(q, values.numel()))
    if float(values.sum()) == 0.0:
        return torch.zeros(values.numel(), dtype=torch.bool)
    return smallest_mass_set(values, q)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("rule", ["top", "fisher_mass", "bound_mass"])
def test_per_module_budget_applies_per_expert_slice(family, rule):
    model, run = moe_run(family, dead=1)
    q = 0.3
    got = select_masks(run, per_module=True, **{rule: q})
    fused = fused_experts_of(model)
    want = {}
    for name, f in run.fisher.items():  # brute force: one budget per parameter, per expert slice when fused
        values = f.double().reshape(-1)
        values = values.sqrt() if rule == "bound_mass" else values
        if name in fused:
            parts = values.view(EXPERTS, -1)
            want[name] = torch.cat([_reference(parts[e], rule, q) for e in range(EXPERTS)]).reshape(f.shape)
        else:
            want[name] = _reference(values, rule, q).reshape(f.shape)
    assert_masks_equal(got.masks, want)
    assert got.meta["rule"]["per_expert"] == sorted(fused)
    for name in fused:  # every expert gets its share; a mass budget gives the expert without F nothing
        assert all(got.masks[name][e].any() for e in range(EXPERTS) if e != 1)
        assert bool(got.masks[name][1].any()) == (rule == "top")  # top: exactly k per slice, even of zeros
    whole = select_masks(run, **{rule: q})  # the global budget is unchanged by experts
    assert "per_expert" not in whole.meta["rule"]


def test_structured_rows_split_biases_by_expert_columns_do_not():
    model, run = moe_run("gpt_oss")
    rows = select_masks(run, per_module=True, top=0.3, structured="rows")
    bias = "model.layers.0.mlp.experts.down_proj_bias"  # (E, d): a row is one expert's bias
    assert rows.masks[bias].all()  # one unit per expert: top keeps at least one unit, so every expert's row
    assert bias in rows.meta["rule"]["per_expert"]
    cols = select_masks(run, per_module=True, top=0.3, structured="columns")
    assert bias not in cols.meta["rule"]["per_expert"]  # a column crosses every expert: the tensor stays whole
    f = run.fisher[bias].double().sum(0)
    assert torch.equal(cols.masks[bias][0], first_k_by_value(f, top_count(0.3, f.numel())))
