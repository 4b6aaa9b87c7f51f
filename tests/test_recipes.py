"""The shipped SFT / distillation recipes: validated, commented, runnable on the embedded default;
the `recipes` command lists and explains them; bad recipe keys are refused with one clear error."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from fisher_select.calibration.calibrator import calibrate
from fisher_select.commands import recipes as recipes_command
from fisher_select.config import build_objectives, load_recipe, recipes_dir
from fisher_select.errors import FisherSelectError
from fisher_select.models import EMBEDDED_DEFAULT
from fisher_select.calibration.prompts import load_prompts

MINE = sorted(p for pattern in ("sft-*.yaml", "opd-pg-*.yaml", "opd-full-*.yaml") for p in recipes_dir().glob(pattern))


def test_the_recipes_exist():
    names = {p.stem for p in MINE}
    assert {"sft-context-distill", "sft-demonstrations", "opd-pg-arithmetic", "opd-full-arithmetic",
            "sft-plus-rl-arithmetic"} <= names


@pytest.mark.parametrize("path", MINE, ids=lambda p: p.stem)
def test_recipe_is_valid_and_commented(path: Path):
    recipe = load_recipe(path)
    assert recipe.model == EMBEDDED_DEFAULT and Path(recipe.prompts).is_file()
    objectives = build_objectives(recipe, path.parent)
    assert objectives and all(o.signal_formula and o.scale_formula and o.caveats for o in objectives)
    header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    for word in ("Signal", "Scale", "Data", "Loose"):
        assert f"# {word}" in header or f"{word}:" in header, word


@pytest.mark.parametrize("path", MINE, ids=lambda p: p.stem)
def test_recipe_runs_end_to_end_on_the_embedded_default(path: Path, embedded):
    """Small settings (2 prompts, K = 2, 6 new tokens) through calibrate(); every objective reports
    a scale (None only for demonstrations without a density) and finite gradient estimates."""
    model, tokenizer, _ = embedded
    recipe = load_recipe(path)
    objectives = build_objectives(recipe, path.parent)
    prompts = load_prompts(recipe.prompts, limit=2)
    cal = calibrate(model, tokenizer, prompts, objectives, samples_per_prompt=2, max_new_tokens=6,
                    seed=recipe.seed, batch_size=4, progress=False, verify=False)
    assert cal.num_samples == 4
    for result in cal.objectives:
        scale = result.signal_scale
        if result.summary.get("demonstrations"):
            assert scale is None and result.summary["chi_square_lower_bound"]["value"] > 0
        else:
            assert scale is not None and math.isfinite(scale) and scale >= 0
        assert set(result.grad_estimate) == set(cal.fisher)
        assert all(torch.isfinite(t).all() for t in result.grad_estimate.values())
        assert isinstance(result.summary.get("warnings", []), list)
    if any(o.token_level for o in objectives):
        assert cal.token_fisher is not None and set(cal.token_fisher) == set(cal.fisher)
    if recipe.mix:
        bound = cal.mixed_bound(recipe.mix)
        assert all(torch.isfinite(b).all() for b in bound.values())


def _cli(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fisher-select")
    recipes_command.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


def test_recipes_command_lists_shipped_recipes(capsys):
    args = _cli("recipes")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for path in MINE:
        assert path.stem in out
    assert "sft, rl" in out and "opd-full" in out and "description" in out


def test_recipes_show_explains_one(capsys):
    args = _cli("recipes", "show", "sft-demonstrations")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for needle in ("objective 1: sft (type sft)", "signal:", "scale:", "chi-square", "data:", "caveats:",
                   "notes (from the recipe file):", "resolved configuration:",
                   str(recipes_dir() / "data" / "arithmetic_demos.jsonl")):
        assert needle in out, needle
    args = _cli("recipes", "show", str(recipes_dir() / "opd-full-arithmetic.yaml"))  # a path works too
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "token-level F^tok (Rademacher sign draws: 2)" in out and "samples_per_prompt" in out
    with pytest.raises(FisherSelectError, match="neither a file nor a shipped recipe"):
        args = _cli("recipes", "show", "no-such-recipe")
        args.func(args)


@pytest.mark.parametrize("text,needle", [
    ("prompts: p.jsonl\nobjective: {type: sft, demonstrator: {system_prompt: x}}\ntemperature: 0.7\n",
     "unknown key 'temperature'"),
    ("prompts: p.jsonl\nobjective: {type: sft, demonstrator: {system_prompt: x}, teacher: {}}\n",
     "objectives[0]: unknown key 'teacher'"),
    ("prompts: p.jsonl\nobjective: {type: opd-full, teacher: {model: self, sytem_prompt: x}}\n",
     "teacher: unknown key 'sytem_prompt'"),
    ("prompts: p.jsonl\nobjective: {type: opd-pg, teacher: {model: self}}\n", "signal is zero"),
    ("prompts: p.jsonl\nobjective: {type: sft, demonstrations: d.jsonl, demonstrator: {system_prompt: x}}\n",
     "give exactly one of"),
])
def test_bad_recipe_is_refused_with_one_clear_error(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(FisherSelectError, match="invalid recipe") as err:
        load_recipe(path)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_demonstrations_path_is_relative_to_the_recipe(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "data" / "d.jsonl").write_text('{"prompt": "hi", "response": "hello"}\n')
    path = tmp_path / "r.yaml"
    path.write_text("prompts: data/p.jsonl\nobjective: {type: sft, demonstrations: data/d.jsonl}\n")
    monkeypatch.chdir(tmp_path.parent)  # not the recipe's folder
    recipe = load_recipe(path)
    assert recipe.objectives[0].demonstrations == str(tmp_path / "data" / "d.jsonl")
    assert build_objectives(recipe)[0].demos[0].fields["response"] == "hello"


def test_demonstrations_file_covers_every_prompt_of_the_prompts_file():
    """recipes/data/arithmetic_demos.jsonl is made from arithmetic.jsonl: regenerate it when that changes
    (python recipes/data/make_arithmetic_demos.py)."""
    path = recipes_dir() / "sft-demonstrations.yaml"
    recipe = load_recipe(path)
    objective = build_objectives(recipe)[0]
    prompts = load_prompts(recipe.prompts)
    objective.prepare(None, prompts)  # raises naming the first prompt without a demonstration
    assert len(objective.pairs) == len(prompts) and objective.unused == 0
