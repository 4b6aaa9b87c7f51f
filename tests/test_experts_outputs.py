"""Per-expert outputs on tiny MoE runs: select --per-module per expert, LoRA target_parameters, axolotl export."""

from __future__ import annotations

import copy
import re

import peft
import pytest
import torch
import yaml

from fisher_select.models import fingerprint
from fisher_select.outputs.axolotl import EXPERT_COVER, EXPERT_NOTE, match_patterns, unfrozen_parameters
from fisher_select.outputs.lora import EXPERT_LIMITS, LoraHints, lora_export, lora_hints, trainable_lora_parameters
from fisher_select.outputs.masks import select_masks
from fisher_select.stats.experts import expert_masses, fused_experts_of
from fisher_select.stats.ranking import top_count
from tests import runs
from tests.test_select import assert_masks_equal, first_k_by_value, smallest_mass_set
from tests.tiny import run_command
from tests.tiny_moe_experts import EXPERTS, MOE_FAMILIES, tiny_moe


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


def _param_wrappers(peft_model) -> dict[str, object]:
    """Full parameter name -> PEFT's ParamWrapper adapting it (nested wrappers unwrapped from their names)."""
    out = {}
    for name, module in peft_model.named_modules():
        if type(module).__name__ == "ParamWrapper":
            owner = re.sub(r"(\.base_layer)+", "", name).removeprefix("base_model.model.")
            out[f"{owner}.{module.parameter_name}"] = module
    return out


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_lora_targets_fused_experts_through_target_parameters(family, tmp_path, capsys):
    model, run = moe_run(family)
    export = lora_export(run, coverage=1.0, model=model)  # every eligible target
    hints = export.hints
    fused = sorted(n for n, f in fused_experts_of(model).items() if len(f.shape) == 3)  # biases are not targets
    assert sorted(hints.target_parameters) == fused
    assert not any(".experts" in n for n in hints.target_modules)
    assert hints.provenance["peft_limits"] == list(EXPERT_LIMITS)
    rows = {t["name"]: t for t in hints.targets}
    assert all(rows[n]["experts"] == EXPERTS and "experts" not in rows[m] for n in fused for m in hints.target_modules)
    out = hints.save_pretrained(tmp_path / "hint")
    assert LoraHints.from_pretrained(out, model).target_parameters == hints.target_parameters
    config = peft.LoraConfig.from_pretrained(out)  # plain PEFT reads it ...
    peft_model = peft.get_peft_model(copy.deepcopy(model), config)  # ... and builds it
    wrappers = _param_wrappers(peft_model)
    assert sorted(wrappers) == fused
    for name, wrapper in wrappers.items():  # the hinted rank, per expert: one rank-r adapter for each expert
        assert wrapper.num_experts == EXPERTS and wrapper.r["default"] == hints.ranks[name]
        assert wrapper.lora_A["default"].weight.shape[0] == hints.ranks[name] * EXPERTS
    assert trainable_lora_parameters(peft_model) == export.trainable
    from fisher_select.studies.arms import lora_count

    assert lora_count(model, hints) == export.trainable  # the outcome study's lora_config arm counts the same
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():  # B starts at zero: the adapted model computes what the base computes
        torch.testing.assert_close(peft_model(input_ids=ids).logits, model(input_ids=ids).logits)
    with torch.no_grad():  # trained adapters (B != 0) merge into the fused weights: same logits after merging
        for wrapper in wrappers.values():
            wrapper.lora_B["default"].weight.normal_(0, 0.5)
        adapted = peft_model(input_ids=ids).logits
        assert not torch.allclose(adapted, model(input_ids=ids).logits)
        merged = peft_model.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-5)
    bad = copy.deepcopy(config)
    bad.lora_dropout = 0.1  # one of the stated limits, as PEFT enforces it
    with pytest.raises(ValueError, match="lora_dropout"):
        peft.get_peft_model(copy.deepcopy(model), bad)
    run_dir = runs.write_run_dir(run, tmp_path / "run")
    assert run_command(["lora", str(run_dir), "--coverage", "1", "--out", str(tmp_path / "cli")]) == 0
    printed = capsys.readouterr().out
    assert "target_parameters" in printed and EXPERT_LIMITS[0] in printed


def test_lora_rank_of_a_fused_weight_follows_its_mass_per_expert():
    model, run = moe_run("mixtral")
    name = "model.layers.0.mlp.experts.down_proj"  # (E, d, I): cap min(d, I) = 8 per expert
    linear = "model.layers.0.self_attn.q_proj"
    f = run.fisher[name]
    run.fisher[f"{linear}.weight"] = torch.full_like(run.fisher[f"{linear}.weight"], 1.0)
    run.fisher[name] = torch.full_like(f, 1.0)
    run = runs.make_run(run.fisher, objectives=[{"name": "rl", "signal_scale": 0.5}],
                        fingerprint=fingerprint(model), run_id="run-equal")
    hints = lora_hints(run, modules=[name, linear], total_rank=16, rank_step=1, min_rank=1)
    q_mass, e_mass = (t["bound_mass"] for t in sorted(hints.targets, key=lambda t: t["name"] != linear))
    assert e_mass == pytest.approx(q_mass * EXPERTS * 16 * 8 / (16 * 16))  # sum of sqrt(1) over the coordinates
    # ranks in proportion to the mass per expert: q_proj (256 coordinates) vs one expert's 128 -> 2:1 of 16
    assert hints.ranks == {linear: 11, name: 5}  # 10.67 and 5.33: the missing unit to the larger remainder


def test_axolotl_unfreezes_fused_tensors_whole_and_names_experts_by_index(tmp_path):
    model, run = moe_run("gpt_oss", dead=2)
    experts_module = "model.layers.1.mlp.experts"
    boost = {n: f * (1e6 if n.startswith(experts_module + ".") else 1.0) for n, f in run.fisher.items()}
    boost[f"{experts_module}.gate_up_proj"][0] *= 100.0  # expert 0 carries most of the module's bound mass
    run = runs.make_run(boost, objectives=[{"name": "rl", "signal_scale": 0.5}], fingerprint=fingerprint(model))
    result = unfrozen_parameters(run, top_modules=1, model=model)
    (module,) = result.modules
    assert module["name"] == experts_module
    tensors = sorted(n for n in run.fisher if n.startswith(experts_module + "."))
    assert sorted(module["parameters"]) == tensors  # every fused tensor, whole: all experts train
    assert result.trainable == sum(run.fisher[n].numel() for n in tensors)
    bound, _ = expert_masses(run.fisher, [fused_experts_of(model)[n] for n in tensors])
    by_mass = module["experts"]["by_mass"]
    assert [e["expert"] for e in by_mass] == sorted(range(EXPERTS), key=lambda e: -bound[e])
    assert [e["bound_share"] for e in by_mass] == pytest.approx(sorted((b / sum(bound) for b in bound), reverse=True))
    shares = sorted(bound, reverse=True)
    need = next(k for k in range(1, EXPERTS + 1) if sum(shares[:k]) >= EXPERT_COVER * sum(bound))
    assert module["experts"]["carrying"] == [e["expert"] for e in by_mass[:need]] and by_mass[0]["expert"] == 0
    assert module["experts"]["zero"] == [2]
    text = result.yaml_text()
    assert EXPERT_NOTE.split()[0] in text and "F = 0: 2" in text
    assert yaml.safe_load(text) == {"unfrozen_parameters": result.patterns}
    matched = match_patterns(result.patterns, [n for n, _ in model.named_parameters()])
    assert sorted(n for hits in matched.values() for n in hits) == tensors


def test_per_expert_masks_hold_in_training():
    """The per-expert selection that axolotl cannot express: enforced with apply_masks, the experts' unselected
    slices stay bit-identical through AdamW steps with weight decay, and selected slices move."""
    from fisher_select import apply_masks

    model, run = moe_run("mixtral", dead=3)
    masks = select_masks(run, per_module=True, bound_mass=0.5).masks
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    handle = apply_masks(model, masks)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    ids = torch.randint(2, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        opt.zero_grad()
        torch.log_softmax(model(input_ids=ids).logits.float(), -1)[..., 7].sum().backward()
        opt.step()
    handle.remove()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach()[~masks[name]], before[name][~masks[name]]), name
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert not masks[gate_up][3].any()  # the expert without F: nothing selected, nothing moved
    moved = (model.get_parameter(gate_up).detach() != before[gate_up]).flatten(1).any(1)  # (E,)
    assert moved[:3].all() and not moved[3]
