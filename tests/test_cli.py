"""The CLI end to end on the embedded default, and one clear error for each kind of bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fisher_select import load_run
from fisher_select.cli import main
from fisher_select.commands import HELP

SMALL = ["--num-prompts", "2", "--samples-per-prompt", "2", "--max-new-tokens", "8", "--no-progress"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "demo"
    assert main(["calibrate", "--recipe", "rl-arithmetic", "--out", str(out), *SMALL]) == 0
    return out


def test_run_directory_is_complete(demo_run):
    names = {p.name for p in demo_run.iterdir()}
    assert {"fisher.safetensors", "grad_estimate.safetensors", "samples.jsonl", "report.json", "report.html"} <= names
    report = json.loads((demo_run / "report.json").read_text())
    for key in ("model", "objective", "signal_scale", "num_prompts", "num_samples", "truncation_rate", "sampling",
                "caveats", "modules"):
        assert key in report, key
    assert report["num_prompts"] == 2 and report["num_samples"] == 4
    assert report["sampling"]["temperature"] == 1.0 and report["sampling"]["top_k"] is None
    assert Path(report["model"]["path"], "config.json").is_file()
    assert any("single step" in c.lower() for c in report["caveats"])
    masses = [m["bound_mass"] for m in report["modules"]]  # modules rank by bound mass (sum of sqrt(F))
    assert masses == sorted(masses, reverse=True) and report["format_version"] == 4
    samples = [json.loads(line) for line in (demo_run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and {"prompt_ids", "response_ids", "response", "logprob", "truncated"} <= set(samples[0])
    assert report["checks"]["autograd"]["max_relative_error"] < 1e-3
    page = (demo_run / "report.html").read_text()
    # matplotlib figures as inline PNG data URIs (issue 10), replacing the three hand-drawn SVG bar charts
    assert "do not promise" in page and page.count('src="data:image/png;base64,') >= 6 and report["run_id"] in page
    assert 'id="heatmap"' in page


def test_report_numbers_agree_with_tensors(demo_run):
    run = load_run(demo_run)
    fisher = run.fisher
    report = run.report.to_json()
    by_module = {m["name"]: m for m in report["modules"]}
    emb = by_module["model.embed_tokens"]
    assert math.isclose(emb["fisher_mass"], float(fisher["model.embed_tokens.weight"].double().sum()), rel_tol=1e-6)
    assert emb["numel"] == fisher["model.embed_tokens.weight"].numel()
    assert len(fisher) == 272  # every parameter of SmolLM2-135M, the tied embedding once
    if report["signal_scale"]:
        bounds = load_file(str(demo_run / "bounds.safetensors"))
        name = "model.layers.0.mlp.up_proj.weight"
        assert torch.allclose(bounds[name], (fisher[name] * report["signal_scale"]).sqrt())


def test_select_top_fraction(demo_run, capsys):
    out = demo_run.parent / "mask.safetensors"
    assert main(["select", str(demo_run), "--top", "0.01", "--out", str(out)]) == 0
    masks = load_file(str(out))
    total = sum(m.numel() for m in masks.values())
    chosen = sum(int(m.sum()) for m in masks.values())
    assert abs(chosen - round(0.01 * total)) <= 1
    assert "model.layers" in capsys.readouterr().out


def test_select_and_lora_print_the_studys_lr_advice_for_the_runs_kind(demo_run, tmp_path, capsys, monkeypatch):
    """With a fit for the run's kind, select prints exp(intercept + slope log sum|g_hat| over its mask) (checked by
    hand from the written mask and the run's g_hat); lora prints the study's LoRA lr; with none, each says so."""
    import shutil

    from safetensors.torch import save_file

    from fisher_select.report import study_advice

    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    grad = {n: torch.randn(g.shape, generator=torch.Generator().manual_seed(0))  # a g_hat that is nowhere 0
            for n, g in load_file(str(run / "grad_estimate.safetensors")).items()}
    save_file(grad, str(run / "grad_estimate.safetensors"))
    kind = load_run(run).objectives[0].type
    monkeypatch.setattr(study_advice, "ADVICE_FILE", tmp_path / "none.json")
    out = tmp_path / "m.safetensors"
    assert main(["select", str(run), "--top", "0.001", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"no suggested lr: the outcome study has no {kind} result yet" in printed
    assert f"Outcome study: no {kind} result yet" in printed  # and what it measured: nothing, said
    fit = {"intercept": 2.0, "slope": -0.9, "r": -0.9, "n": 20, "loo_error_factor": 2.5, "covered": 19}
    (tmp_path / "advice.json").write_text(json.dumps({kind: {"model": "m", "steps": 8, "optimizer": "adamw",
                                                             "source": "s", "mask": fit, "lora_all_linear_r1": 0.01,
                                                             "replicates": 6, "discriminates": True, "verdicts": {
        "0.001": {"peer": "random", "gain": "ties", "gain_difference": 0.01, "forgetting": "more",
                  "forgetting_difference": 2.0, "worse_than_start": [3, 6]}}}}))
    monkeypatch.setattr(study_advice, "ADVICE_FILE", tmp_path / "advice.json")
    assert main(["select", str(run), "--top", "0.001", "--out", str(out), "--overwrite"]) == 0
    printed = capsys.readouterr().out
    masks = load_file(str(out))
    total = sum(float(grad[n].double()[m].abs().sum()) for n, m in masks.items())
    assert f"suggested AdamW lr for this mask: {math.exp(2.0 - 0.9 * math.log(total)):.2g} " in printed
    assert "covered the tuned lr for 19 of 20 masks" in printed
    assert ("the bound's mask, against the best other mask rule, at 0.100% it ties against random on gain (+0.010), "
            "forgets more (KL per token +2) and fell below the untrained model in 3 of 6 replicates") in printed
    save_file({n: torch.zeros_like(g) for n, g in grad.items()}, str(run / "grad_estimate.safetensors"))
    assert main(["select", str(run), "--top", "0.001", "--out", str(out), "--overwrite"]) == 0
    assert "no suggested lr: g_hat is zero over this mask" in capsys.readouterr().out
    assert main(["lora", str(run), "--out", str(tmp_path / "lora")]) == 0
    assert f"tuned all-linear LoRA at rank 1 to lr 0.01 for {kind}" in capsys.readouterr().out


def test_existing_run_is_not_overwritten_without_flag(demo_run, capsys):
    before = (demo_run / "report.json").read_text()
    assert main(["calibrate", "--out", str(demo_run), *SMALL]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert (demo_run / "report.json").read_text() == before


PHASES = ("model loaded: ", "first batch: ", "sampling done: ", "read rollouts: ", "scoring done: ", "checks: ")


def _fails(args, capsys, *needles):
    code = main(args)
    *phases, err = capsys.readouterr().err.strip().splitlines()  # --no-progress: phase lines, then the error
    assert code == 2, err
    assert err.startswith("fisher-select: error: ") and all(line.startswith(PHASES) for line in phases), phases
    for needle in needles:
        assert needle in err, err
    return err


def test_missing_model(tmp_path, capsys):
    _fails(["calibrate", "--out", str(tmp_path / "o"), "--model", "nobody/no-such-model", *SMALL], capsys,
           "nobody/no-such-model")
    assert not (tmp_path / "o").exists()


def test_malformed_and_empty_prompt_files(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok", "answer": 1}\n{"prompt": 3}\n')
    _fails(["calibrate", "--out", str(tmp_path / "o"), "--prompts", str(bad), *SMALL], capsys, "bad.jsonl:2:")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _fails(["calibrate", "--out", str(tmp_path / "o"), "--prompts", str(empty), *SMALL], capsys, "empty")
    assert not (tmp_path / "o").exists()


def test_rl_needs_two_samples_per_prompt(tmp_path, capsys):
    args = ["calibrate", "--out", str(tmp_path / "o"), "--num-prompts", "2", "--samples-per-prompt", "1"]
    _fails(args, capsys, "samples_per_prompt >= 2")


@pytest.mark.parametrize("body,needle", [("raise ValueError('boom')", "boom"), ("return float('nan')", "nan"),
                                         ("return 'yes'", "yes")])
def test_bad_reward_names_the_prompt(tmp_path, monkeypatch, capsys, body, needle):
    (tmp_path / "myreward.py").write_text(f"def fn(record, text):\n    {body}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("myreward", None)
    recipe = tmp_path / "r.yaml"
    data = Path(__file__).resolve().parent.parent / "recipes" / "data" / "arithmetic.jsonl"
    recipe.write_text(f"prompts: {data}\nobjective:\n  type: rl\n  reward:\n    type: callable\n"
                      "    function: myreward:fn\n")
    err = _fails(["calibrate", "--recipe", str(recipe), "--out", str(tmp_path / "o"), *SMALL], capsys, "prompt 0")
    assert needle in err.lower()
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o.tmp")]


def test_recipe_with_unknown_key(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("prompts: x.jsonl\nbogus: 1\nobjective:\n  type: rl\n  reward: {type: numeric_match}\n")
    _fails(["calibrate", "--recipe", str(recipe), "--out", str(tmp_path / "o")], capsys, "bogus", str(recipe))


@pytest.mark.slow
def test_failure_while_writing_leaves_nothing(tmp_path, monkeypatch, capsys):
    import fisher_select.report.page as html

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(html, "write_html", explode)
    with pytest.raises(OSError):  # --debug: the traceback
        main(["--debug", "calibrate", "--out", str(tmp_path / "o"), *SMALL])
    assert list(tmp_path.iterdir()) == []
    assert main(["calibrate", "--out", str(tmp_path / "o"), *SMALL]) == 1  # else one line, exit 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fisher-select: error: disk full") and "Traceback" not in "".join(err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "fisher_select", "--help"], capture_output=True, text=True, check=True)
    assert "calibrate" in out.stdout and "select" in out.stdout


def test_version_flag(capsys):
    import fisher_select

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"fisher-select {fisher_select.__version__}"


ANSWERS = [["--version"], ["--help"], ["recipes"], ["recipes", "show", "rl-arithmetic-graded"],
           ["recipes", "show", "sft-demonstrations"], ["recipes", "show", "opd-full-arithmetic"], ["recipes", "fields"],
           *([name, "--help"] for name in sorted(HELP))]
ARGUMENT_ERRORS = [["no-such-command"], ["calibrate", "--no-such-flag"], ["select"], ["export"], ["lora"]]


@pytest.mark.parametrize("argv,code", [(a, 0) for a in ANSWERS] + [(a, 2) for a in ARGUMENT_ERRORS],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_light_answers_import_no_heavy_library(argv, code):
    """--version, --help, the recipes commands and argument errors load no torch, transformers or PEFT
    (an answer in a fraction of a second): a command imports them only when it runs."""
    script = ("import sys\nfrom fisher_select.cli import main\ntry:\n    rc = main(%r)\nexcept SystemExit as exc:\n"
              "    rc = exc.code\nprint(rc, sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
              % (argv,))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == f"{code} []", done.stdout + done.stderr


def test_public_api_is_importable_from_the_top_level():
    import fisher_select

    for name in ("calibrate", "score_sums", "load_run", "select_masks", "lora_config", "shira_config",
                 "apply_masks", "FisherMaskCallback"):
        assert callable(getattr(fisher_select, name)), name


def test_same_seed_reproduces_the_run_bit_for_bit_and_verify_says_so(demo_run, tmp_path, capsys):
    again, other = tmp_path / "again", tmp_path / "other"
    assert main(["calibrate", "--recipe", "rl-arithmetic", "--out", str(again), *SMALL]) == 0
    assert main(["calibrate", "--recipe", "rl-arithmetic", "--out", str(other), *SMALL, "--seed", "1"]) == 0
    capsys.readouterr()
    assert (demo_run / "fisher.safetensors").read_bytes() != (again / "fisher.safetensors").read_bytes()  # run ids
    assert main(["verify", str(demo_run), str(again)]) == 0
    out = capsys.readouterr().out
    assert "identical results" in out and "warning" not in out
    assert main(["verify", str(demo_run), str(other)]) == 1
    out = capsys.readouterr().out
    assert "fisher.safetensors: model.embed_tokens.weight differs" in out and "samples.jsonl differs" in out
    # Another environment with the same results: exit 0, and a warning naming each package and both versions.
    report = json.loads((again / "report.json").read_text())
    report["environment"]["libraries"]["bitsandbytes"] = "9.9.9"
    (again / "report.json").write_text(json.dumps(report))
    assert main(["verify", str(demo_run), str(again)]) == 0
    out = capsys.readouterr().out
    mine = json.loads((demo_run / "report.json").read_text())["environment"]["libraries"]["bitsandbytes"]
    assert "identical results" in out and f"bitsandbytes {mine or 'not installed'} vs 9.9.9" in out
    assert "the results agree regardless" in out


def _subparser(name: str):
    from fisher_select.cli import build_parser

    sub = next(a for a in build_parser([name])._actions if a.dest == "command")
    return sub.choices[name]


def test_calibrate_flags_are_generated_from_the_recipe_fields():
    """Every scalar RecipeConfig field is a flag of its type whose help is the field's help."""
    import dataclasses
    import typing

    from fisher_select.recipe import RecipeConfig
    from fisher_select.fields import field_help, scalar_type

    actions = {a.dest: a for a in _subparser("calibrate")._actions}
    hints = typing.get_type_hints(RecipeConfig)
    scalars = [f for f in dataclasses.fields(RecipeConfig) if scalar_type(hints[f.name]) is not None]
    assert {"samples_per_prompt", "num_prompts", "quantization", "dtype", "model"} <= {f.name for f in scalars}
    for f in scalars:
        action, flag = actions[f.name], "--" + f.name.replace("_", "-")
        if scalar_type(hints[f.name]) is bool:  # --x / --no-x, so a command line can undo a recipe's true
            assert action.option_strings == [flag, "--no-" + flag[2:]] and action.default is None
        else:
            assert action.option_strings == [flag]
            assert action.type is scalar_type(hints[f.name]) and action.default is None
        assert field_help(f) and field_help(f) in action.help.replace("%%", "%"), f.name
    assert "objectives" not in actions and "sampling" not in actions  # mappings and lists stay in the file
    args = _subparser("calibrate").parse_args(["--out", "o", "--num-prompts", "3", "--quantization", "nf4"])
    assert (args.num_prompts, args.quantization, args.samples_per_prompt) == (3, "nf4", None)


def test_lora_flags_left_out_keep_the_hint_config_defaults():
    from fisher_select.commands.lora import hint_kwargs
    from fisher_select.outputs.lora import LoraHintConfig

    args = _subparser("lora").parse_args(["run", "--out", "hint"])
    assert args.rank_step is None and args.coverage is None and args.top_n is None and args.total_rank is None
    assert hint_kwargs(args) == {"layers_to_transform": None, "modules": None}  # LoraHintConfig's defaults apply
    given = hint_kwargs(_subparser("lora").parse_args(["run", "--out", "h", "--rank-step", "2", "--ranking",
                                                       "fisher_mass"]))
    assert LoraHintConfig.with_fields(None, {k: v for k, v in given.items() if k in ("rank_step", "ranking")}) == \
        LoraHintConfig(rank_step=2, ranking="fisher_mass")
    action = {a.dest: a for a in _subparser("lora")._actions}["rank_step"]
    assert f"default {LoraHintConfig.rank_step!r}" in action.help


def test_bad_flag_value_is_reported_once_with_the_recipe(tmp_path, capsys):
    err = _fails(["calibrate", "--out", str(tmp_path / "o"), "--dtype", "float8", "--batch-size", "0"], capsys,
                 "with --batch-size, --dtype: ", "dtype: expected one of float32", "batch_size: must be at least 1")
    assert err.count("rl-arithmetic.yaml") == 1 and "command line" not in err
    assert not (tmp_path / "o").exists()


def test_verify_ignores_masks_saved_beside_a_run(demo_run, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(demo_run, copy)
    assert main(["select", str(copy), "--top", "0.01", "--out", str(copy / "extra-mask.safetensors")]) == 0
    assert main(["verify", str(demo_run), str(copy)]) == 0
