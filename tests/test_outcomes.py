"""The matched-budget outcome study (studies.outcomes) on tiny models: every method's entry, the
learning rate chosen on the validation split alone, and LoRA budgets matched on the adapted model."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import peft
import pytest

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import (OPDFullObjective, OPDPGObjective, RLObjective,
                                                  SFTDemonstrationsObjective)
from fisher_select.calibration.teachers import Teacher
from fisher_select.errors import FisherSelectError
from fisher_select.models import fingerprint
from fisher_select.outputs.lora import lora_config, trainable_lora_parameters
from fisher_select.report.outcomes_section import findings, load_outcomes, outcome_table
from fisher_select.studies.outcomes import (ADAPTER_METHODS, METHODS, MODULE_METHODS, OutcomeConfig, _Study,
                                             attention_modules, choose_lr, keep_in_run, outcome_study,
                                             write_outcomes)
from fisher_select.studies.validate import Setup
from tests.runs import make_run, write_run_dir
from tests.test_validate import DemoTokenizer, _prompts, _reward
from tests.tiny import TinyTokenizer, tiny_model

ROOT = Path(__file__).resolve().parent.parent
FAST = dict(steps=2, prompts_per_step=2, samples_per_prompt=1, max_new_tokens=4, batch_size=8, shira_r=2,
            lora_mean_rank=4, validation_prompts=2, heldout_prompts=2)


def _sft(tmp_path, responses):
    """A tiny SFT run: 3 training prompts then the others, one demonstration each (``responses[i]``)."""
    model, tok, prompts = tiny_model("llama-untied"), DemoTokenizer(64), _prompts(len(responses))
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"prompt": p.prompt, "response": r}) + "\n"
                             for p, r in zip(prompts, responses)))
    cal = calibrate(model, tok, prompts[:3], SFTDemonstrationsObjective(demos), samples_per_prompt=4,
                    max_new_tokens=4, progress=False)
    run = make_run(cal.fisher, objectives=[{"name": "sft", "signal_scale": None}], fingerprint=fingerprint(model))
    setup = Setup(model, tok, SFTDemonstrationsObjective(demos), prompts[:3], prompts[3:], True)
    return run, setup, cal.grad_estimate


def test_outcome_study_end_to_end_has_every_method_and_the_lr_it_picked(tmp_path):
    run, setup, grad = _sft(tmp_path, [f"{5 + i} 7" for i in range(7)])
    config = OutcomeConfig(densities=(0.01, 0.1), lr_multipliers=(1.0, 3.0), full_lr_multipliers=(1.0, 3.0),
                           base_lr=0.03, seeds=2, optimizer="adamw", **FAST)
    report = outcome_study(run, config, setup=setup, grad_estimate=grad)
    full = report["full"]
    assert full["lr_grid"] == pytest.approx([0.03, 0.09]) and full["lr_chosen"] in full["lr_grid"]
    assert len(full["held_out_after"]) == 2 and full["kind"] == "full"
    masks = {f"{m}@{d:g}" for m in METHODS[:5] for d in (0.01, 0.1)}
    assert set(report["methods"]) == masks | set(MODULE_METHODS) | set(ADAPTER_METHODS)
    for key, m in report["methods"].items():
        if "unavailable" in m:  # recorded with its reason, never dropped (KappaTune needs a recent peft)
            assert m["method"] == "kappatune" and m["unavailable"]
            continue
        assert m["lr_grid"] == pytest.approx([full["lr_chosen"], 3 * full["lr_chosen"]]), key
        by_lr = {s["lr"]: s["validation"] for s in m["lr_sweep"]}
        assert m["lr_chosen"] == choose_lr(by_lr, higher_is_better=False), key
        assert m["seeds"] == [0, 1] and len(m["recovered"]) == 2 and m["trainable"] > 0, key
        assert all(r == pytest.approx((a - full["held_out_before"]) / (f - full["held_out_before"]))
                   for r, a, f in zip(m["recovered"], m["held_out_after"], full["held_out_after"])), key
    total = sum(f.numel() for f in run.fisher.values())
    assert report["methods"]["bound@0.1"]["trainable"] == report["methods"]["random@0.1"]["trainable"]
    assert report["methods"]["bound@0.1"]["density"] == pytest.approx(0.1, abs=1 / total)
    assert report["methods"]["shira_fisher"]["trainable"] == report["methods"]["shira_random"]["trainable"]
    assert report["signal_share"] is None and report["finished_share"] is None  # SFT samples nothing
    assert report["kind"] == "sft" and report["selection_seconds"]["calibration"] is None
    write_outcomes(report, tmp_path / "o.json", tmp_path / "o.png")
    assert json.loads((tmp_path / "o.json").read_text())["methods"].keys() == report["methods"].keys()
    assert (tmp_path / "o.png").stat().st_size > 0
    table = "\n".join(outcome_table(report))
    assert "| bound@0.1 | mask |" in table and "lora_all_linear" in table
    run_dir = write_run_dir(run, tmp_path / "run")  # kept in the run: its report shows the study
    folder = keep_in_run(report, run_dir)
    assert folder.name == "outcomes-sft" and (folder / "recovery_vs_density.png").stat().st_size > 0
    markdown, page = (run_dir / "report.md").read_text(), (run_dir / "report.html").read_text()
    assert "## Outcomes at matched budgets" in markdown and "| bound@0.1 | mask |" in markdown
    assert "<h2>Outcomes at matched budgets</h2>" in page and page.count("data:image/png;base64") >= 1
    assert load_outcomes(run_dir)[0][1]["methods"].keys() == report["methods"].keys()


def test_lr_is_chosen_on_validation_alone(tmp_path):
    """Validation demonstrations repeat training's answer, held-out ones another: more training helps the
    first and hurts the second, so the held-out split would pick full fine-tuning's smaller lr where
    validation picks the larger one. Every entry's lr is the validation split's best; held-out is only reported."""
    run, setup, _ = _sft(tmp_path, ["5 7"] * 5 + ["9 3"] * 2)
    config = OutcomeConfig(densities=(0.1,), lr_multipliers=(0.1, 1.0), full_lr_multipliers=(0.1, 1.0),
                           base_lr=0.1, seeds=1, optimizer="sgd", methods=("bound",), **(FAST | {"steps": 4}))
    report = outcome_study(run, config, setup=setup)
    full = report["full"]
    by_held_out = min(full["lr_sweep"], key=lambda s: s["held_out"][0])["lr"]
    assert full["lr_chosen"] == pytest.approx(0.1) and by_held_out == pytest.approx(0.01)
    for entry in (full, report["methods"]["bound@0.1"]):
        sweep = entry["lr_sweep"]
        assert entry["lr_chosen"] == min(sweep, key=lambda s: s["validation"][0])["lr"]
        assert entry["held_out_after"] == next(s["held_out"] for s in sweep if s["lr"] == entry["lr_chosen"])


def test_uniform_lora_counts_match_lora_config_on_the_adapted_model(tmp_path):
    """all-linear and attention-only LoRA: the largest uniform rank whose trainable count, counted on the
    PEFT-adapted model, does not exceed lora_config's (one rank more would)."""
    run, setup, _ = _sft(tmp_path, [f"{5 + i} 7" for i in range(7)])
    study = _Study(run, setup, OutcomeConfig(**FAST), None, False)
    budget = trainable_lora_parameters(peft.get_peft_model(copy.deepcopy(setup.model),
                                                           lora_config(run, mean_rank=4, model=setup.model)))
    for method, targets in ((study.selections._lora_all_linear(), "all-linear"),
                            (study.selections._lora_attention(), attention_modules(setup.model))):
        def count(r):
            cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, task_type="CAUSAL_LM")
            return trainable_lora_parameters(peft.get_peft_model(copy.deepcopy(setup.model), cfg))

        adapted = method.adapter(0, copy.deepcopy(setup.model))
        assert trainable_lora_parameters(adapted) == method.trainable <= budget
        r = method.trainable // count(1)
        assert method.trainable == count(r) and count(r + 1) > budget
    assert setup.model.__class__.__name__ == "LlamaForCausalLM"  # the study adapted copies, never the model


def test_bad_study_settings_are_listed_in_one_error(tmp_path):
    run, setup, _ = _sft(tmp_path, [f"{5 + i} 7" for i in range(4)])
    bad = OutcomeConfig(densities=(0.0,), methods=("bound", "nope"), seeds=0, **FAST)
    with pytest.raises(FisherSelectError) as err:
        outcome_study(run, bad, setup=setup)
    for part in ("density 0.0", "unknown method(s) nope", "seeds must be at least 1"):
        assert part in str(err.value)
    with pytest.raises(FisherSelectError, match="only 1 are left"):  # 4 prompts: 3 train, 1 left for 2 + 2
        outcome_study(run, OutcomeConfig(**FAST), setup=setup)


def test_bench_command_on_a_calibrated_run_directory(tmp_path, small_llama_dir, capsys):
    """calibrate through the CLI, then bench/outcomes.py: the JSON, the plot, the table from the JSON alone,
    and a refusal of the wrong kind before any training."""
    from fisher_select.cli import main as cli

    spec = importlib.util.spec_from_file_location("bench_outcomes", ROOT / "bench" / "outcomes.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    run_dir = tmp_path / "run"
    assert cli(["calibrate", "--recipe", "sft-demonstrations", "--model", str(small_llama_dir), "--out", str(run_dir),
                "--num-prompts", "2", "--samples-per-prompt", "2", "--max-new-tokens", "4", "--no-progress"]) == 0
    common = [str(run_dir), "--densities", "0.01", "--lr-multipliers", "1", "--full-lr-multipliers", "1",
              "--seeds", "1", "--steps", "1", "--validation-prompts", "2", "--heldout-prompts", "2",
              "--prompts-per-step", "2", "--samples-per-prompt", "1", "--methods", "bound", "grad_estimate",
              "lora_config", "--calibration-seconds", "12.5"]
    assert bench.main([*common, "--kind", "rl"]) == 2 and "not 'rl'" in capsys.readouterr().err
    out, plot = tmp_path / "outcomes-sft.json", tmp_path / "outcomes-sft.png"
    assert bench.main([*common, "--kind", "sft", "--json", str(out), "--plot", str(plot)]) == 0
    report = json.loads(out.read_text())
    assert set(report["methods"]) == {"bound@0.01", "grad_estimate@0.01", "lora_config"}
    assert "unavailable" not in report["methods"]["grad_estimate@0.01"]  # read from the run's own file
    assert report["selection_seconds"]["calibration"] == 12.5 and plot.stat().st_size > 0
    capsys.readouterr()
    assert bench.main(["--table", str(out)]) == 0
    assert "| bound@0.01 | mask |" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["rl", "opd-pg", "opd-full"])
def test_on_policy_kinds_report_signal_and_finished_shares_and_keep_the_teacher(kind):
    """RL and both distillations through the study: rows with signal and finished responses are shares, and
    the adapted copies get their own task without rebinding (or reloading) the objective's teacher."""
    model, tok, prompts = tiny_model("llama-tied"), TinyTokenizer(64), _prompts(8)
    objective = {"rl": lambda: RLObjective(_reward),
                 "opd-pg": lambda: OPDPGObjective(Teacher(tiny_model("llama-tied", seed=1))),
                 "opd-full": lambda: OPDFullObjective(Teacher(tiny_model("llama-tied", seed=1)))}[kind]()
    cal = calibrate(model, tok, prompts[:4], objective, samples_per_prompt=4, max_new_tokens=5, progress=False)
    run = make_run(cal.fisher, objectives=[{"name": kind, "signal_scale": cal.signal_scale}],
                   fingerprint=fingerprint(model))
    teacher = getattr(objective, "teacher", None)
    config = OutcomeConfig(densities=(0.1,), lr_multipliers=(1.0,), full_lr_multipliers=(1.0,), base_lr=1e-2,
                           seeds=2, methods=("bound", "lora_config", "shira_fisher"),
                           **(FAST | {"samples_per_prompt": 4, "max_new_tokens": 5}))
    report = outcome_study(run, config, setup=Setup(model, tok, objective, prompts[:4], prompts[4:], True),
                           grad_estimate=cal.grad_estimate)
    assert report["kind"] == kind and getattr(objective, "teacher", None) is teacher
    assert 0 <= report["signal_share"] <= 1 and 0 <= report["finished_share"] <= 1
    assert report["task"]["higher_is_better"] == (kind != "opd-full")  # full distillation reports KL
    assert set(report["methods"]) == {"bound@0.1", "lora_config", "shira_fisher"}


def _entry(kind, shares, density=0.01):
    return {"kind": kind, "density": density, "trainable": 10, "lr_chosen": 1e-3, "recovered": shares,
            "recovered_mean": sum(shares) / len(shares)}


def test_findings_say_where_a_peer_matches_or_beats_the_bound_at_the_same_budget():
    methods = {"bound@0.01": _entry("mask", [0.5, 0.6]), "random@0.01": _entry("mask", [0.7, 0.8]),
               "single_batch_grad@0.01": _entry("mask", [0.55, 0.62]), "grad_estimate@0.01": _entry("mask", [0.1, 0.2]),
               "random@0.1": _entry("mask", [0.9, 0.95], 0.1),  # no bound at 0.1: nothing to hold it against
               "lora_config": _entry("lora", [0.4, 0.5]), "lora_all_linear": _entry("lora", [0.3, 0.45]),
               "spectrum": _entry("modules", [2.0, 2.0])}  # modules run at their own share: not a peer
    notes = findings({"methods": methods})
    assert len(notes) == 2
    assert notes[0].startswith("random@0.01 recovered 0.750") and "on every seed" in notes[0]
    assert notes[1].startswith("single_batch_grad@0.01 recovered 0.585") and "within the spread" in notes[1]


def test_an_unreadable_outcome_study_is_named(tmp_path):
    (tmp_path / "outcomes-sft").mkdir()
    (tmp_path / "outcomes-sft" / "outcomes.json").write_text("{")
    with pytest.raises(FisherSelectError, match="outcomes-sft/outcomes.json is unreadable"):
        load_outcomes(tmp_path)
