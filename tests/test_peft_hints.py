"""LoRA hints and SHiRA configs: built by PEFT exactly as hinted, on the embedded model and a tiny Llama."""

from __future__ import annotations

import copy
import json
import re
import warnings

import peft
import pytest

import torch
from peft.utils.other import get_pattern_key
from transformers import LlamaConfig, LlamaForCausalLM

import fisher_select.outputs.lora as fs_lora
from fisher_select.errors import FisherSelectError
from fisher_select.models import fingerprint
from fisher_select.outputs.lora import LoraHints, load_lora_config, lora_config, lora_hints, pattern_key
from fisher_select.outputs.shira import shira_config
from fisher_select.run.load import Run
from tests import runs
from tests.runs import write_run_dir
from tests.tiny import run_command




def make_run(model, fisher: dict[str, torch.Tensor], run_id: str = "run-x") -> Run:
    """A run over ``model`` with the given Fisher; the report records no module types."""
    return runs.make_run(fisher, objectives=[{"name": "rl", "signal_scale": 0.5}], fingerprint=fingerprint(model),
                         model_name="test", run_id=run_id)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(config)


def tiny_run(model, seed: int = 0) -> Run:
    gen = torch.Generator().manual_seed(seed)
    # Per-parameter factors make module masses differ by orders of magnitude.
    fisher = {n: torch.rand(p.shape, generator=gen) * 10 ** (4 * torch.rand(1, generator=gen).item())
              for n, p in model.named_parameters()}
    return make_run(model, fisher)


@pytest.fixture(scope="module")
def smol(embedded):
    """The embedded SmolLM2-135M (shared, never modified) and a run over it (one F level per parameter)."""
    model = embedded[0]
    gen = torch.Generator().manual_seed(0)
    # LoRA hints read only masses and shapes: constant expanded tensors cost no memory.
    fisher = {n: torch.rand((), generator=gen).expand(p.shape) for n, p in model.named_parameters()}
    return model, make_run(model, fisher, run_id="run-smol")


def adapted(peft_model, attr: str) -> dict[str, torch.nn.Module]:
    base = peft_model.get_base_model()
    return {name: m for name, m in base.named_modules() if hasattr(m, attr) and getattr(m, attr)}


def peft_warnings(caught) -> list[str]:
    messages = [str(w.message) for w in caught]
    return [m for m in messages if "did not match" in m or "no module" in m]


# ---------------------------------------------------------------------------
# Embedded model


def test_lora_config_on_embedded_model_builds_trains_with_allocated_ranks(smol):
    model, run = smol
    kwargs = dict(top_n=14, total_rank=120, rank_step=4, alpha_ratio=2.0)
    hints = lora_hints(run, **kwargs)
    # Module classes read from the model give the same hints as the name/shape rule.
    assert lora_hints(run, model=model, **kwargs).rank_pattern == hints.rank_pattern
    targets = hints.target_modules
    ranks = hints.ranks
    assert len(targets) == 14 and sum(ranks.values()) == 120 and all(r % 4 == 0 for r in ranks.values())
    assert not any("embed" in t or "lm_head" in t for t in targets)

    work = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = peft.get_peft_model(work, lora_config(run, **kwargs))
    assert peft_warnings(caught) == []
    layers = adapted(peft_model, "lora_A")
    assert set(layers) == set(targets)
    for name, layer in layers.items():
        assert layer.lora_A["default"].weight.shape[0] == ranks[name]
        assert layer.lora_B["default"].weight.shape[1] == ranks[name]
        assert layer.scaling["default"] == pytest.approx(2.0)

    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(0))
    peft_model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    for name, layer in layers.items():
        assert layer.lora_B["default"].weight.abs().sum() > 0, f"{name} adapter did not train"
    assert torch.equal(work.model.embed_tokens.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("ranking", ["bound_mass", "fisher_mass"])
def test_coverage_picks_fewest_modules_by_the_ranking_mass(smol, ranking):
    model, run = smol
    hints = lora_hints(run, coverage=0.5, ranking=ranking)
    eligible = [m for m in run.report.modules
                if run.fisher[m.parameters[0]].dim() == 2 and "embed" not in m.name]
    masses = sorted((getattr(m, ranking) for m in eligible), reverse=True)
    total = sum(masses)
    n = next(i + 1 for i in range(len(masses)) if sum(masses[: i + 1]) >= 0.5 * total)
    assert len(hints.target_modules) == n
    chosen = {m.name: getattr(m, ranking) for m in eligible if m.name in hints.target_modules}
    assert min(chosen.values()) >= masses[n - 1]
    assert hints.provenance["selection"]["covered"] >= 0.5
    assert hints.provenance["selection"]["ranking"] == ranking


def test_the_two_rankings_choose_differently_where_the_masses_disagree():
    model = tiny_llama()
    # q_proj (16 x 16): F = 1 everywhere, Fisher mass 256, bound mass 256; k_proj (8 x 16): F = 3,
    # Fisher mass 384, bound mass 128 sqrt(3) = 222. The Fisher mass picks k_proj, the bound mass q_proj.
    fisher = {n: torch.full(p.shape, 3.0 if "k_proj" in n else 1.0) for n, p in model.named_parameters()}
    run = make_run(model, fisher)
    only = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    pick = {r: lora_hints(run, top_n=1, ranking=r, modules=only, rank_step=1, mean_rank=4).target_modules
            for r in ("bound_mass", "fisher_mass")}
    assert pick == {"bound_mass": [only[0]], "fisher_mass": [only[1]]}
    rows = lora_hints(run, top_n=2, modules=only).targets
    assert rows[0]["bound_mass"] == pytest.approx(256) and rows[1]["fisher_mass"] == pytest.approx(384)
    assert rows[0]["bound_share"] + rows[1]["bound_share"] == pytest.approx(1)


# ---------------------------------------------------------------------------
# Allocation and errors (tiny model)


def test_rank_allocation_proportional_clamped_and_exact():
    model = tiny_llama()
    run = tiny_run(model)
    hints = lora_hints(run, coverage=1.0, total_rank=120, rank_step=4, min_rank=4, max_rank=16)
    targets = hints.targets
    ranks = [t["rank"] for t in targets]
    assert sum(ranks) == 120
    assert all(r % 4 == 0 and 4 <= r <= 16 for r in ranks)
    # k_proj / v_proj are (8, 16): a rank above min(out, in) = 8 is pointless, so they are capped.
    for t in targets:
        if t["name"].endswith(("k_proj", "v_proj")):
            assert t["rank"] <= 8
    # More mass never gets less rank, unless the heavier module hit its cap.
    for a in targets:
        for b in targets:
            cap_a = 8 if a["name"].endswith(("k_proj", "v_proj")) else 16
            if a["bound_mass"] > b["bound_mass"] and a["rank"] < cap_a:
                assert a["rank"] >= b["rank"], (a, b)
    for t in targets:
        assert t["alpha"] == 2 * t["rank"]


def water_fill_reference(masses, caps, lo, budget):
    """Proportional shares with clamping, by repeated redistribution (independent of the bisection)."""
    fixed: dict[int, float] = {}
    while True:
        free = [i for i in range(len(masses)) if i not in fixed]
        left = budget - sum(fixed.values())
        share = {i: left * masses[i] / sum(masses[j] for j in free) for i in free}
        over = {i: caps[i] for i in free if share[i] > caps[i]}
        under = {i: lo for i in free if share[i] < lo}
        if not over and not under:
            return [fixed.get(i, share.get(i)) for i in range(len(masses))]
        fixed.update(over or under)


def test_ranks_are_within_one_step_of_clamped_proportional_shares():
    model = tiny_llama()
    run = tiny_run(model, seed=3)
    hints = lora_hints(run, top_n=6, total_rank=64, rank_step=2, min_rank=2, max_rank=64,
                       modules=["gate_proj", "up_proj", "down_proj", "o_proj"])
    targets = hints.targets
    caps = [16] * len(targets)  # min(out, in) of these (16, 32) / (32, 16) / (16, 16) weights
    ideal = water_fill_reference([t["bound_mass"] for t in targets], caps, 2, 64)
    assert any(r == 16 for r in (t["rank"] for t in targets))  # some cap binds: redistribution matters
    assert sum(t["rank"] for t in targets) == 64
    for t, share in zip(targets, ideal):
        assert abs(t["rank"] - share) < 2, (t, share)


def test_rank_budget_smaller_than_module_count_is_an_error():
    run = tiny_run(tiny_llama())
    with pytest.raises(FisherSelectError, match="cannot give 12 modules rank >= 4"):
        lora_hints(run, top_n=12, total_rank=40, rank_step=4)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"modules": ["not_a_proj"]}, "no eligible module"),
        ({"coverage": 0.5, "top_n": 3}, "not both"),
        ({"coverage": 1.5}, "outside"),
        ({"top_n": 99}, "top-n 99"),
        ({"layers_to_transform": [7]}, "no eligible Linear-like module"),
        ({"rank_step": 0}, "rank_step: must be at least 1"),
        ({"ranking": "sum"}, "ranking: expected one of bound_mass, fisher_mass"),
    ],
)
def test_bad_lora_arguments(kwargs, words):
    with pytest.raises(FisherSelectError, match=words):
        lora_hints(tiny_run(tiny_llama()), **kwargs)


def test_hints_for_another_model_are_refused():
    run = tiny_run(tiny_llama(seed=0))
    with pytest.raises(FisherSelectError, match="different weights"):
        lora_hints(run, model=tiny_llama(seed=1))


def test_layers_to_transform_restricts_targets():
    run = tiny_run(tiny_llama())
    hints = lora_hints(run, coverage=1.0, layers_to_transform=[1], total_rank=28)
    assert hints.target_modules and all(".layers.1." in t for t in hints.target_modules)
    assert hints.layers_to_transform == [1]


def test_pattern_keys_match_exactly_their_module_under_peft_rules():
    run = tiny_run(tiny_llama())
    hints = lora_hints(run, coverage=1.0, total_rank=56)
    keys = list(hints.rank_pattern)
    targets = hints.target_modules
    assert keys == [re.escape(t) for t in targets] == [pattern_key(t) for t in targets]
    for target in hints.target_modules:
        assert get_pattern_key(keys, target) == re.escape(target)
        assert get_pattern_key(keys, "wrapper." + target) == re.escape(target)  # as target_modules does
    # Unescaped, "." would match any character: "model.layers.0.mlp.up_proj" would claim this name.
    odd = "model.layers.0.mlp-up_proj"
    assert get_pattern_key(keys, odd) == odd


# ---------------------------------------------------------------------------
# JSON file and CLI






def test_cli_lora_writes_adapter_directory_that_loads_only_for_its_model(tmp_path, capsys):
    model = tiny_llama()
    run = tiny_run(model)
    run_dir = write_run_dir(run, tmp_path / "run")
    out = tmp_path / "lora"
    assert run_command(["lora", str(run_dir), "--top-n", "5", "--total-rank", "40", "--rank-step", "4",
                "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "LoraConfig.from_pretrained(" in text and "load_lora_config(" in text and "Caveat:" in text
    assert "trainable parameters" in text
    data = json.loads((out / "adapter_config.json").read_text())
    hints = lora_hints(run, top_n=5, total_rank=40, rank_step=4)
    assert data["peft_type"] == "LORA"
    for key in ("task_type", "target_modules", "r", "lora_alpha", "rank_pattern", "alpha_pattern",
                "layers_to_transform"):
        assert data[key] == getattr(hints, key), key
    assert "fisher_select" not in data  # PEFT would warn about an unknown key: provenance is beside it
    provenance = json.loads((out / "fisher_select_provenance.json").read_text())
    assert provenance["run_id"] == run.run_id
    assert provenance["model"]["fingerprint"] == fingerprint(model)
    assert provenance["targets"] == hints.targets
    assert LoraHints.from_pretrained(out, model) == hints  # the typed hint round-trips through the directory

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = peft.LoraConfig.from_pretrained(str(out))
    assert [str(w.message) for w in caught] == []
    config = load_lora_config(out, model)
    assert isinstance(config, peft.LoraConfig) and config.rank_pattern == hints.rank_pattern == plain.rank_pattern
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = peft.get_peft_model(copy.deepcopy(model), config)
    assert peft_warnings(caught) == []
    assert set(adapted(peft_model, "lora_A")) == set(hints.target_modules)
    with pytest.raises(FisherSelectError, match="different weights"):
        load_lora_config(out, tiny_llama(seed=1))
    with pytest.raises(FisherSelectError, match="already holds files"):
        run_command(["lora", str(run_dir), "--out", str(out)])
    with pytest.raises(FisherSelectError, match="cannot give"):
        run_command(["lora", str(run_dir), "--top-n", "5", "--total-rank", "8", "--out", str(tmp_path / "b")])
    assert not (tmp_path / "b").exists()


def test_real_peft_is_imported_inside_fisher_select_lora():
    assert fs_lora.peft is peft and hasattr(fs_lora.peft, "LoraConfig")


# ---------------------------------------------------------------------------
# SHiRA


def test_shira_trainable_coordinates_are_the_top_bound_coordinates():
    model = tiny_llama()
    run = tiny_run(model)
    config = shira_config(run, model, r=2, top_n=5)
    assert config.mask_fn.provenance["run_id"] == run.run_id
    peft_model = peft.get_peft_model(model, config)
    layers = adapted(peft_model, "shira_indices")
    assert set(layers) == set(config.target_modules) and len(layers) == 5
    for name, layer in layers.items():
        f = run.fisher[f"{name}.weight"]  # (out, in); the bound is sqrt(S * F), the same order
        k = 2 * sum(f.shape)
        want = torch.sort(f.reshape(-1), descending=True, stable=True).indices[:k]
        rows, cols = layer.shira_indices["default"].long()
        got = rows * f.shape[1] + cols
        assert got.numel() == k
        assert set(got.tolist()) == set(want.tolist()), name


def test_shira_refuses_other_models_and_oversized_r():
    model = tiny_llama()
    run = tiny_run(model)
    config = shira_config(run, model, r=2, top_n=3)
    with pytest.raises(FisherSelectError, match="another model object"):
        peft.get_peft_model(copy.deepcopy(model), config)
    with pytest.raises(FisherSelectError, match="different weights"):
        shira_config(run, tiny_llama(seed=1), r=2, top_n=3)
    with pytest.raises(FisherSelectError, match="lower r"):
        shira_config(run, model, r=8, modules=["k_proj"])  # (8, 16): 8 * 24 > 128
