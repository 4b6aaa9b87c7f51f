"""``export``: axolotl unfrozen_parameters applied as axolotl applies them; PEFT directories PEFT loads cleanly."""

from __future__ import annotations

import copy
import json
import math
import re
import warnings

import peft
import pytest
import torch
import yaml

from fisher_select.errors import FisherSelectError
from fisher_select.models import fingerprint
from fisher_select.outputs.axolotl import (
    axolotl_pattern,
    check_patterns,
    load_unfrozen_parameters,
    save_unfrozen_parameters,
    unfrozen_parameters,
)
from fisher_select.outputs.lora import check_lora_targets, load_lora_config, lora_export
from fisher_select.run.names import LORA_CONFIG_FILE as ADAPTER_CONFIG
from fisher_select.run.names import LORA_PROVENANCE_FILE as PROVENANCE_FILE
from tests import runs
from tests.runs import write_run_dir
from tests.tiny import run_command, tiny_model


def run_over(model, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # Per-parameter factors spread module masses over orders of magnitude.
    fisher = {n: torch.rand(p.shape, generator=gen) * 10 ** (3 * torch.rand(1, generator=gen).item())
              for n, p in model.named_parameters()}
    return runs.make_run(fisher, fingerprint=fingerprint(model), model_name="tiny", run_id=f"run-{seed}")


# axolotl's freeze_layers_except (src/axolotl/utils/freeze.py), written out here independently of
# fisher_select's copy: freeze every named parameter, unfreeze those a pattern re.match-es after
# escaping every "." not followed by "+"; a trailing [start:end] range only zeroes gradients.
def axolotl_freeze(model, patterns: list[str]) -> dict[str, int]:
    hits = {p: 0 for p in patterns}
    for name, param in model.named_parameters():
        param.requires_grad = False
        for pattern in patterns:
            ranged = re.match(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$", pattern)
            base = ranged.group(1) if ranged else pattern
            if re.compile(re.sub(r"\.(?!\+)", "\\.", base)).match(name) is not None:
                param.requires_grad = True
                hits[pattern] += 1
    return hits


def bound_mass_by_module(run) -> dict[str, float]:
    masses: dict[str, float] = {}
    for name, f in run.fisher.items():
        module = name.rsplit(".", 1)[0]
        masses[module] = masses.get(module, 0.0) + float(f.double().sqrt().sum())
    return masses


# ---------------------------------------------------------------------------
# axolotl


@pytest.mark.parametrize("name", ["qwen2-bias", "llama-tied"])
def test_axolotl_patterns_applied_as_axolotl_applies_them_unfreeze_exactly_the_chosen_modules(name, tmp_path):
    model = tiny_model(name)
    run = run_over(model)
    result = unfrozen_parameters(run, bound_mass=0.6, model=model)
    path = save_unfrozen_parameters(result, tmp_path / "axolotl.yaml")
    patterns = load_unfrozen_parameters(path)
    assert patterns == yaml.safe_load(path.read_text())["unfrozen_parameters"] == result.patterns

    hits = axolotl_freeze(model, patterns)
    assert all(count == 1 for count in hits.values()), hits  # each pattern: exactly one parameter
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    masses = bound_mass_by_module(run)
    chosen = {m["name"] for m in result.modules}
    assert trainable == {n for n in run.fisher if n.rsplit(".", 1)[0] in chosen}
    assert result.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert result.numel == sum(p.numel() for p in model.parameters())
    # The fewest modules by bound mass: they reach 0.6 of the total, one fewer would not.
    ranked = sorted(masses.values(), reverse=True)
    total = sum(ranked)
    assert min(masses[m] for m in chosen) == pytest.approx(ranked[len(chosen) - 1])
    assert sum(ranked[: len(chosen)]) >= 0.6 * total > sum(ranked[: len(chosen) - 1])
    assert result.covered == pytest.approx(sum(masses[m] for m in chosen) / total)
    if name == "llama-tied":  # one parameter, listed once by named_parameters: no lm_head pattern
        assert not any("lm_head" in p for p in patterns)


def test_top_modules_takes_the_modules_of_largest_bound_mass():
    model = tiny_model("qwen2-bias")
    run = run_over(model, seed=1)
    result = unfrozen_parameters(run, top_modules=3)
    masses = bound_mass_by_module(run)
    want = sorted(masses, key=lambda m: -masses[m])[:3]
    assert [m["name"] for m in result.modules] == want
    assert len(result.patterns) == sum(len(e.parameters) for e in run.report.modules if e.name in want)


def test_exact_patterns_do_not_reach_names_sharing_a_prefix():
    names = ["model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight_scale",
             "model.layers.10.mlp.up_proj.weight", "odd.a+b.weight", "odd.aab.weight"]
    for name in names:
        assert check_patterns([axolotl_pattern(name)], names, "test") == {axolotl_pattern(name): [name]}
    # Spectrum's module prefixes, for contrast, match every longer name with the same start.
    assert len(check_patterns(["model.layers.1.mlp.up_proj"], names, "test")["model.layers.1.mlp.up_proj"]) == 2


def test_patterns_matching_nothing_are_refused_with_their_names():
    two_layers = run_over(tiny_model("llama-untied"))
    one_layer = [n for n in two_layers.fisher if ".layers.1." not in n]
    patterns = [axolotl_pattern(n) for n in two_layers.fisher]
    missing = [p for p in patterns if ".layers.1." in p]
    with pytest.raises(FisherSelectError, match=rf"{len(missing)} pattern\(s\) match nothing in the small model: "
                                                + re.escape(", ".join(missing[:5])) + r" \.\.\. and 4 more"):
        check_patterns(patterns, one_layer, "the small model")


def test_axolotl_export_refuses_another_model_and_bad_rules():
    model = tiny_model("llama-untied")
    run = run_over(model)
    with pytest.raises(FisherSelectError, match="different weights"):
        unfrozen_parameters(run, bound_mass=0.5, model=tiny_model("llama-untied", seed=1))
    with pytest.raises(FisherSelectError, match="not both"):
        unfrozen_parameters(run, bound_mass=0.5, top_modules=2)
    with pytest.raises(FisherSelectError, match="outside"):
        unfrozen_parameters(run, bound_mass=1.5)
    with pytest.raises(FisherSelectError, match="top-modules 99"):
        unfrozen_parameters(run, top_modules=99)
    full = unfrozen_parameters(run, bound_mass=1.0)
    assert full.trainable == full.numel and len(full.patterns) == len(run.fisher)


# ---------------------------------------------------------------------------
# PEFT


def test_peft_directory_loads_in_peft_without_warnings_and_trains_the_counted_parameters(tmp_path):
    model = tiny_model("llama-untied")
    run = run_over(model)
    export = lora_export(run, model=model, top_n=5, total_rank=24, rank_step=2, min_rank=2)
    out = export.hints.save_pretrained(tmp_path / "hint")
    assert sorted(p.name for p in out.iterdir()) == sorted([ADAPTER_CONFIG, PROVENANCE_FILE])
    assert "fisher_select" not in json.loads((out / ADAPTER_CONFIG).read_text())
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    assert provenance["run_id"] == run.run_id and provenance["model"]["fingerprint"] == fingerprint(model)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = peft.LoraConfig.from_pretrained(str(out))
    assert [str(w.message) for w in caught] == []
    assert config.target_modules == set(export.hints.target_modules)
    assert config.rank_pattern == export.hints.rank_pattern
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = peft.get_peft_model(copy.deepcopy(model), config)
    assert not [w for w in caught if "match" in str(w.message) or "no module" in str(w.message)]
    trainable, _ = peft_model.get_nb_trainable_parameters()
    assert trainable == export.trainable and export.numel == sum(p.numel() for p in model.parameters())
    adapted = {n for n, m in peft_model.get_base_model().named_modules() if getattr(m, "lora_A", None)}
    assert adapted == set(export.hints.target_modules)
    assert {t: hits for t, hits in export.matched.items()} == {t: [t] for t in export.hints.target_modules}

    assert load_lora_config(out, model).rank_pattern == config.rank_pattern
    assert load_lora_config(out / ADAPTER_CONFIG, model).target_modules == config.target_modules
    with pytest.raises(FisherSelectError, match="different weights"):
        load_lora_config(out, tiny_model("llama-untied", seed=1))


def test_sidecar_of_other_targets_and_missing_sidecar_are_refused(tmp_path):
    model = tiny_model("llama-untied")
    export = lora_export(run_over(model), top_n=3)
    out = export.hints.save_pretrained(tmp_path / "hint")
    fields = json.loads((out / ADAPTER_CONFIG).read_text())
    fields["target_modules"] = fields["target_modules"][:1]
    (out / ADAPTER_CONFIG).write_text(json.dumps(fields))
    with pytest.raises(FisherSelectError, match="other targets"):
        load_lora_config(out, model)
    (out / PROVENANCE_FILE).unlink()
    with pytest.raises(FisherSelectError, match=f"no {PROVENANCE_FILE} beside it"):
        load_lora_config(out, model)


def test_single_file_of_release_0_1_is_still_read(tmp_path):
    model = tiny_model("llama-untied")
    export = lora_export(run_over(model), top_n=3)
    out = export.hints.save_pretrained(tmp_path / "hint")
    old = json.loads((out / ADAPTER_CONFIG).read_text())
    old["fisher_select"] = json.loads((out / PROVENANCE_FILE).read_text())
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_lora_config(tmp_path / "old.json", model).target_modules == set(export.hints.target_modules)


def test_lora_targets_matching_no_module_are_refused():
    model = tiny_model("llama-untied")
    export = lora_export(run_over(model), top_n=4)
    config = export.hints.peft_config()
    names = [n for n, _ in model.named_modules() if ".layers.1." not in n]
    missing = [t for t in export.hints.target_modules if ".layers.1." in t]
    assert missing, "the test needs a target in layer 1"
    with pytest.raises(FisherSelectError, match=rf"{len(missing)} LoRA target\(s\) match nothing in one layer: "
                                                 + re.escape(missing[0])):
        check_lora_targets(config, names, "one layer")


# ---------------------------------------------------------------------------
# CLI


def test_cli_export_both_formats_and_refusals(tmp_path, capsys):
    model = tiny_model("qwen2-bias")
    run = run_over(model)
    run_dir = write_run_dir(run, tmp_path / "run")
    yaml_out, peft_out = tmp_path / "axolotl.yaml", tmp_path / "adapter"
    assert run_command(["export", str(run_dir), "--format", "axolotl", "--top-modules", "4", "--out", str(yaml_out)]) == 0
    text = capsys.readouterr().out
    expected = unfrozen_parameters(run, top_modules=4)
    assert load_unfrozen_parameters(yaml_out) == expected.patterns
    assert f"trainable {expected.trainable:,} of {expected.numel:,}" in text and "Caveat:" in text

    assert run_command(["export", str(run_dir), "--format", "peft", "--top-n", "3", "--out", str(peft_out)]) == 0
    text = capsys.readouterr().out
    assert "LoraConfig.from_pretrained(" in text and "trainable parameters" in text
    config = peft.LoraConfig.from_pretrained(str(peft_out))
    assert sorted(config.target_modules) == sorted(lora_export(run, top_n=3).hints.target_modules)

    with pytest.raises(FisherSelectError, match="takes no --top-n"):
        run_command(["export", str(run_dir), "--format", "axolotl", "--top-n", "3", "--out", str(tmp_path / "a.yaml")])
    with pytest.raises(FisherSelectError, match="takes no --bound-mass"):
        run_command(["export", str(run_dir), "--format", "peft", "--bound-mass", "0.5", "--out", str(tmp_path / "p")])
    with pytest.raises(FisherSelectError, match="already exists"):
        run_command(["export", str(run_dir), "--format", "axolotl", "--out", str(yaml_out)])
    with pytest.raises(FisherSelectError, match="already holds files"):
        run_command(["export", str(run_dir), "--format", "peft", "--out", str(peft_out)])
    with pytest.raises(FisherSelectError, match="names a .json file"):
        run_command(["lora", str(run_dir), "--out", str(tmp_path / "hint.json")])
    assert not (tmp_path / "a.yaml").exists() and not (tmp_path / "p").exists()
    assert math.isclose(sum(m["bound_share"] for m in unfrozen_parameters(run, bound_mass=1.0).modules), 1.0)


def test_cli_export_sparse_delta_is_what_load_sparse_delta_trains(tmp_path, capsys):
    from fisher_select.outputs.masks import save_masks, select_masks
    from fisher_select.training.sparse import load_sparse_delta

    model = tiny_model("llama-tied")
    run = run_over(model)
    run_dir = write_run_dir(run, tmp_path / "run")
    maskset = select_masks(run, top=0.05)
    mask_path = save_masks(maskset, tmp_path / "m.safetensors")
    out = tmp_path / "delta"
    assert run_command(["export", str(run_dir), "--format", "sparse-delta", "--mask", str(mask_path),
                        "--out", str(out)]) == 0
    assert "load_sparse_delta" in capsys.readouterr().out
    handle = load_sparse_delta(model, out)
    assert handle.selected == maskset.selected
    for e in handle.entries:  # exactly the mask's coordinates, deltas at 0
        assert torch.equal(e.indices.long(), maskset.masks[e.name].reshape(-1).nonzero().squeeze(1))
        assert not e.delta().any()
    handle.merge()
    top = tmp_path / "top"
    assert run_command(["export", str(run_dir), "--format", "sparse-delta", "--top", "0.05", "--out", str(top)]) == 0
    assert (top / "sparse_delta.safetensors").read_bytes() == (out / "sparse_delta.safetensors").read_bytes()
    with pytest.raises(FisherSelectError, match="exactly one of --mask"):
        run_command(["export", str(run_dir), "--format", "sparse-delta", "--out", str(tmp_path / "x")])
    with pytest.raises(FisherSelectError, match="takes no --top-n"):
        run_command(["export", str(run_dir), "--format", "sparse-delta", "--top-n", "3", "--out", str(tmp_path / "x")])
    with pytest.raises(FisherSelectError, match="takes no --mask"):
        run_command(["export", str(run_dir), "--format", "peft", "--mask", str(mask_path), "--out", str(tmp_path / "x")])
    other = write_run_dir(run_over(model, seed=1), tmp_path / "other")
    with pytest.raises(FisherSelectError, match="not from"):
        run_command(["export", str(other), "--format", "sparse-delta", "--mask", str(mask_path), "--out", str(tmp_path / "y")])
