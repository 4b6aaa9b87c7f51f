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
from fisher_select.recipe import build_objectives, load_recipe, recipes_dir
from fisher_select.errors import FisherSelectError
from fisher_select.models import EMBEDDED_DEFAULT
from fisher_select.calibration.prompts import load_prompts

MINE = sorted(p for pattern in ("sft-*.yaml", "opd-pg-*.yaml", "opd-full-*.yaml", "rl-arithmetic-graded*.yaml")
              for p in recipes_dir().glob(pattern))


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


def test_chat_prompts_are_made_from_the_problems_and_their_examples_give_no_answer_away():
    """recipes/data/arithmetic_chat.jsonl is made from arithmetic.jsonl: regenerate it when that changes
    (python recipes/data/make_arithmetic_chat.py)."""
    import importlib.util
    import json

    data = recipes_dir() / "data"
    spec = importlib.util.spec_from_file_location("make_arithmetic_chat", data / "make_arithmetic_chat.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    problems = [json.loads(line) for line in (data / "arithmetic.jsonl").read_text().splitlines() if line.strip()]
    chats = [json.loads(line) for line in (data / "arithmetic_chat.jsonl").read_text().splitlines() if line.strip()]
    assert chats == [maker.chat(p) for p in problems]
    asked = {p["prompt"] for p in problems}
    assert all(q + maker.SUFFIX not in asked for q, _ in maker.EXAMPLES)
    assert {float(a) for _, a in maker.EXAMPLES}.isdisjoint(float(p["answer"]) for p in problems)


# --- one source of config: errors, generated docs, defaults ------------------------------------------------

def _refused(tmp_path, text, overrides=None) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(FisherSelectError) as err:
        load_recipe(path, overrides)
    message = str(err.value)
    assert "\n" not in message
    return message


GOOD = "prompts: p.jsonl\nobjective: {type: rl, reward: {type: numeric_match}}\n"


def test_error_prefix_names_the_source_once(tmp_path):
    message = _refused(tmp_path, GOOD, {"dtype": "float8", "seed": None})
    path = str(tmp_path / "r.yaml")
    assert message.startswith(f"invalid recipe {path} with --dtype: dtype: expected one of float32, bfloat16")
    assert message.count(path) == 1 and "command line" not in message and "--seed" not in message


def test_every_problem_is_listed_in_one_error(tmp_path):
    text = GOOD + "samples_per_prompt: 0\nquantization: int4\nsampling: {top_k: 5}\nbogus: 1\n"
    message = _refused(tmp_path, text, {"dtype": "float8"})
    for needle in ("samples_per_prompt: must be at least 1, got 0", "quantization: expected one of nf4, fp4, int8",
                   "sampling.top_k=5 is not plain sampling", "unknown key 'bogus'", "dtype: expected one of"):
        assert needle in message, needle
    assert message.count("invalid recipe") == 1


def test_unfinished_reward_takes_a_finite_number_and_reaches_the_objective(tmp_path):
    for bad in (".inf", "zero", "true"):  # the type check refuses a string or a bool; problems() a non-finite
        message = _refused(tmp_path, GOOD.replace("type: rl,", f"type: rl, unfinished_reward: {bad},"))
        assert "unfinished_reward: expected" in message and "objectives[0]" in message, (bad, message)
        assert bad != ".inf" or "a finite number (e.g. 0) or no value" in message, (bad, message)
    recipe = load_recipe(recipes_dir() / "rl-arithmetic-graded-ended.yaml")
    (objective,) = build_objectives(recipe)
    assert objective.unfinished_reward == 0.0 and objective.describe()["unfinished_reward"] == 0.0
    plain = build_objectives(load_recipe(recipes_dir() / "rl-arithmetic-graded.yaml"))[0]
    assert plain.unfinished_reward is None and "unfinished_reward" not in plain.describe()


def test_allowed_keys_include_objective(tmp_path):
    message = _refused(tmp_path, GOOD + "temprature: 0.7\n")
    allowed = message.split("(allowed: ")[1].split(")")[0].split(", ")
    assert "objective" in allowed and "objectives" in allowed and "samples_per_prompt" in allowed


def test_broken_yaml_names_line_and_column(tmp_path):
    message = _refused(tmp_path, "prompts: p.jsonl\nobjective:\n  type: rl\n   reward: x\n")
    assert "not valid YAML: line 4, column 10: mapping values are not allowed here" in message
    message = _refused(tmp_path, "prompts: p.jsonl\nseed: [1, 2\nmodel: x\n")
    assert "line 3, column 6" in message and "flow sequence that starts at line 2, column 7" in message


def test_overrides_replace_the_file_and_flag_paths_are_relative_to_the_working_directory(tmp_path, monkeypatch):
    path = tmp_path / "r.yaml"
    path.write_text(GOOD + "seed: 3\n")
    monkeypatch.chdir(tmp_path.parent)
    assert load_recipe(path).prompts == str(tmp_path / "p.jsonl")  # the file's path: beside the file
    recipe = load_recipe(path, {"prompts": "q.jsonl", "samples_per_prompt": 2, "seed": None})
    assert recipe.prompts == str(tmp_path.parent / "q.jsonl")
    assert (recipe.samples_per_prompt, recipe.seed) == (2, 3)


def test_recipe_defaults_are_the_calibration_settings():
    import dataclasses
    import inspect

    from fisher_select.calibration.config import CalibrationConfig
    from fisher_select.recipe import RecipeConfig

    recipe = {f.name: f for f in dataclasses.fields(RecipeConfig)}
    assert issubclass(RecipeConfig, CalibrationConfig)  # declared once: the recipe inherits the fields
    assert "config" in inspect.signature(calibrate).parameters  # and calibrate takes them whole
    for f in dataclasses.fields(CalibrationConfig):
        assert recipe[f.name].default == f.default, f.name
        assert recipe[f.name].metadata == f.metadata and f.metadata["help"]


def test_every_recipe_field_has_help():
    import dataclasses

    from fisher_select.calibration.sampling import SamplingConfig
    from fisher_select.calibration.teachers import TeacherConfig
    from fisher_select.recipe import RecipeConfig
    from fisher_select.fields import field_help

    for cls in (RecipeConfig, SamplingConfig, TeacherConfig):
        for f in dataclasses.fields(cls):
            assert field_help(f).strip(), f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("path", sorted(recipes_dir().glob("*.yaml")), ids=lambda p: p.stem)
def test_recipes_show_yaml_is_the_resolved_configuration_with_help(path):
    import yaml

    from fisher_select.recipe import commented_yaml, recipe_to_dict

    recipe = load_recipe(path)
    text = commented_yaml(recipe)
    assert yaml.safe_load(text) == recipe_to_dict(recipe)
    assert "# responses K sampled per prompt" in text and "one of float32, bfloat16, float16, auto" in text


def test_recipes_fields_prints_the_committed_reference(capsys):
    from fisher_select.recipe import REGENERATE, recipe_reference

    args = _cli("recipes", "fields")
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert printed == recipe_reference() + "\n"
    committed = (Path(__file__).resolve().parent.parent / "docs" / "RECIPES.md").read_text(encoding="utf-8")
    assert committed == printed, f"docs/RECIPES.md is out of date; regenerate it: {REGENERATE}"
    for needle in ("| `samples_per_prompt` | `int` | `4` |", "`sampling.top_k`", "### `type: rl`",
                   "### `type: opd-full`", "## Teacher and demonstrator keys", "one of nf4, fp4, int8"):
        assert needle in committed, needle
