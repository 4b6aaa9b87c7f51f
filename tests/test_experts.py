"""Expert units: fused expert tensors of the four transformers 5 MoE families, split per expert along dim 0."""

import pytest
import torch

from fisher_select.stats.experts import (expert_masses, experts_by_module, fused_experts, fused_experts_of,
                                         num_experts_of)
from tests.tiny_moe_experts import EXPERTS, MOE_FAMILIES, TOP_K, tiny_moe

FUSED_LEAVES = {"mixtral": {"gate_up_proj", "down_proj"}, "qwen3_moe": {"gate_up_proj", "down_proj"},
                "olmoe": {"gate_up_proj", "down_proj"},
                "gpt_oss": {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}}


def _routed(model, ids):
    """Router module name -> the set of experts its top-k picked for the tokens of ``ids``."""
    picked, hooks = {}, []
    for name, module in model.named_modules():
        if name.endswith((".mlp.gate", ".mlp.router")):
            hooks.append(module.register_forward_hook(
                lambda m, args, out, name=name: picked.__setitem__(name.rsplit(".", 1)[0], set(out[2].flatten().tolist()))))
    try:
        logits = model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    return picked, logits


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_fused_tensors_are_recognised_with_the_config(family):
    model = tiny_moe(family)
    fused = fused_experts_of(model)
    assert num_experts_of(model.config) == EXPERTS
    assert {f.leaf for f in fused.values()} == FUSED_LEAVES[family]
    assert set(experts_by_module(fused)) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert all(f.num_experts == EXPERTS for f in fused.values())
    assert not any(".gate." in n or ".router." in n for n in fused)  # routers stay whole
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert fused_experts(shapes) == fused  # names and shapes alone find the same tensors
    assert fused_experts(shapes, num_experts=EXPERTS + 1) == {}  # a config that disagrees: nothing is split


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_slice_e_is_what_expert_e_computes_with(family):
    """One token, top-2 of 4: exactly the routed experts' slices get a gradient; the others' are exactly 0."""
    model = tiny_moe(family)
    picked, logits = _routed(model, torch.tensor([[5]]))
    (logits.double() * torch.randn_like(logits.double())).sum().backward()
    params = dict(model.named_parameters())
    for name, f in fused_experts_of(model).items():
        routed = picked[f.module.rsplit(".", 1)[0]]
        assert len(routed) == TOP_K
        for e, g in enumerate(f.split(params[name].grad)):
            assert bool((g != 0).any()) == (e in routed), (name, e, routed)
        flat = f.split(params[name].grad.reshape(-1))  # the row-major flattening splits the same way
        assert all(torch.equal(a.reshape(-1), b) for a, b in zip(f.split(params[name].grad), flat))


def test_names_and_masses():
    shapes = {"m.layers.0.mlp.experts.w": (3, 2, 2), "m.layers.0.mlp.experts.b": (3, 2),
              "m.layers.0.mlp.gate.weight": (3, 4), "m.experts.0.w1.weight": (2, 2),  # a ModuleList expert: not fused
              "m.layers.1.mlp.experts.w": (3, 2), "m.layers.1.mlp.experts.odd": (2, 2)}  # dim 0 disagrees
    fused = fused_experts(shapes)
    assert sorted(fused) == ["m.layers.0.mlp.experts.b", "m.layers.0.mlp.experts.w"]
    w = fused["m.layers.0.mlp.experts.w"]
    assert (w.unit(2), w.slice_name(2), w.slice_numel) == ("m.layers.0.mlp.experts.2", "m.layers.0.mlp.experts.2.w", 4)
    fisher = {"m.layers.0.mlp.experts.w": torch.arange(12.0).reshape(3, 2, 2),
              "m.layers.0.mlp.experts.b": torch.tensor([[1.0, -1e-9], [0.0, 0.0], [4.0, 9.0]])}
    bound, mass = expert_masses(fisher, list(fused.values()))
    brute = [[0.0, 0.0] for _ in range(3)]
    for name, f in fisher.items():  # per coordinate, by hand
        for e in range(3):
            for v in f[e].reshape(-1).tolist():
                brute[e][0] += max(v, 0.0) ** 0.5
                brute[e][1] += max(v, 0.0)
    assert bound == pytest.approx([b for b, _ in brute], rel=1e-12)
    assert mass == pytest.approx([m for _, m in brute], rel=1e-12)
