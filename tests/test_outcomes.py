"""The matched-budget outcome study (training.outcomes) on tiny models: every method's entry, the
learning rate chosen on the validation split alone, and LoRA budgets matched on the adapted model."""

from __future__ import annotations

import copy
import json

import peft
import pytest

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import SFTDemonstrationsObjective
from fisher_select.errors import FisherSelectError
from fisher_select.models import fingerprint
from fisher_select.outputs.lora import lora_config, trainable_lora_parameters
from fisher_select.training.outcomes import (ADAPTER_METHODS, METHODS, MODULE_METHODS, OutcomeConfig, _Study,
                                             attention_modules, choose_lr, outcome_table, outcome_study,
                                             write_outcomes)
from fisher_select.training.validate import Setup
from tests.runs import make_run
from tests.test_validate import DemoTokenizer, _prompts
from tests.tiny import tiny_model

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
    for method, targets in ((study._lora_all_linear(), "all-linear"),
                            (study._lora_attention(), attention_modules(setup.model))):
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
