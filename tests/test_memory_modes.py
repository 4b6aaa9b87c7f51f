"""calibrate()'s memory modes (``accumulators``, ``modules``, ``accumulate_on``) on a tiny Llama.

Every mode samples the same responses (same seed), so what it keeps must equal the full mode's
numbers to fp32 rounding; the full mode itself is checked against the brute-force per-sample
reference (``engine.reference.brute_force_sums``) on the very rows it sampled. What a reduced
mode lacks (score-mean check, autograd check, gradient estimate) is said in the report's
warnings, never a crash.
"""

from __future__ import annotations

import pytest
import torch

from fisher_select import FisherSelectError
from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import RLObjective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.calibration.sampling import left_pad
from fisher_select.engine.memory import MemoryMode
from fisher_select.engine.reference import brute_force_sums
from fisher_select.models import fingerprint
from fisher_select.report.build import build_report, write_run_with_pages
from fisher_select.run.load import load_run
from fisher_select.run.schema import ModelInfo
from tests.tiny import TinyTokenizer, enumeration_model

PROMPTS = [PromptRecord(i, p, None, {}) for i, p in enumerate(["2 3", "4 2 0", "3 3", "0 4 4 2"])]
TOL = 1e-5  # same samples, same fp32 engine: only the order of fp32 additions may differ
MODULES = r"layers\.0\.(self_attn\.(q|v)_proj|mlp\.down_proj)\.weight"


def reward(record, text):
    return float(len(text.split()) % 2)


def _calibrate(stability=True, **mode):
    return calibrate(enumeration_model(), TinyTokenizer(5), PROMPTS, RLObjective(reward), samples_per_prompt=4,
                     max_new_tokens=4, seed=7, batch_size=8, progress=False, stability=stability, **mode)


@pytest.fixture(scope="module", params=[True, False], ids=["stability", "no-stability"])
def full(request):
    return request.param, _calibrate(stability=request.param)


def rel(a, b):
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def test_full_mode_equals_brute_force_on_its_own_samples(full):
    _, cal = full
    model = enumeration_model()
    rows = [s["prompt_ids"] + s["response_ids"] for s in cal.samples]
    ids, attn = left_pad(rows, 1, "cpu")  # (N, T) each
    resp = torch.zeros_like(ids, dtype=torch.bool)
    for b, s in enumerate(cal.samples):
        resp[b, ids.shape[1] - len(s["response_ids"]):] = True
    signal = torch.tensor([s["signal"]["rl"] for s in cal.samples])  # (N,) leave-one-out signals as scored
    squares, weighted, total = brute_force_sums(model, ids, attn, resp, signal)
    n = len(cal.samples)
    assert set(cal.fisher) == set(squares)
    for name in squares:
        assert rel(cal.fisher[name], squares[name] / n) < 1e-4, name
        assert rel(cal.grad_estimate[name], weighted[name] / n) < 1e-4, name
        assert rel(cal.score_mean[name], total[name] / n) < 1e-4, name
    assert cal.checks["memory"]["missing"] == []
    assert "score_mean" in cal.checks and "autograd" in cal.checks


@pytest.mark.parametrize("mode", [
    {"accumulators": "gradient"},
    {"accumulators": "fisher"},
    {"modules": MODULES},
    {"accumulate_on": "cpu"},
    {"accumulators": "fisher", "modules": MODULES, "accumulate_on": "cpu"},
], ids=["gradient", "fisher", "modules", "cpu", "fisher-modules-cpu"])
def test_each_mode_keeps_exactly_the_full_modes_numbers(full, mode):
    stability, ref = full
    cal = _calibrate(stability=stability, **mode)
    memory = MemoryMode(**mode)
    assert [s["response_ids"] for s in cal.samples] == [s["response_ids"] for s in ref.samples]  # same samples
    names = set(ref.fisher) if memory.modules is None else {n for n in ref.fisher if n in _matching(MODULES, ref)}
    assert set(cal.fisher) == names and names
    for name in names:
        assert rel(cal.fisher[name], ref.fisher[name]) < TOL, name
    if memory.signals:
        assert set(cal.grad_estimate) == names
        for name in names:
            assert rel(cal.grad_estimate[name], ref.grad_estimate[name]) < TOL, name
    else:
        assert cal.grad_estimate == {}
    if memory.totals:
        for name in names:
            assert rel(cal.score_mean[name], ref.score_mean[name]) < TOL, name
        assert "score_mean" in cal.checks and "autograd" in cal.checks
    else:
        assert cal.score_mean == {} and "score_mean" not in cal.checks and "autograd" not in cal.checks
    assert cal.signal_scale == pytest.approx(ref.signal_scale)  # S needs no accumulator
    for name in names:  # the bound needs only F and S
        assert rel(cal.bound()[name], ref.bound()[name]) < TOL, name
    missing = cal.checks["memory"]["missing"]
    assert bool(missing) == (mode != {"accumulate_on": "cpu"})
    if stability and cal.diagnostics.split_half is not None:
        assert cal.diagnostics.unit_names == sorted(names, key=list(ref.fisher).index)


def _matching(pattern, cal):
    import re

    return {n for n in cal.fisher if re.search(pattern, n)}


def test_reduced_mode_report_says_what_is_missing_and_writes_a_run(tmp_path):
    cal = _calibrate(accumulators="fisher", modules=MODULES)
    model = enumeration_model()
    report = build_report(cal, model=ModelInfo("tiny", fingerprint(model), None, None, None, None), recipe=None,
                          recipe_name=None, sampling={"temperature": 1.0}, settings={})
    text = " ".join(report.warnings)
    assert "score-mean check" in text and "no gradient estimate" in text and "F covers 3 of" in text
    assert report.statistics.get("conformity") is None and not report.statistics.get("bound_ratios")
    run = load_run(write_run_with_pages(tmp_path / "run", cal, report, overwrite=False))
    assert set(run.fisher) == set(cal.fisher)


def test_bad_modes_are_refused_before_any_work():
    with pytest.raises(FisherSelectError, match="accumulators: expected one of full, gradient, fisher"):
        _calibrate(accumulators="squares")
    with pytest.raises(FisherSelectError, match="accumulators must be one of"):
        MemoryMode(accumulators="squares")  # the engine's own check, for callers beside calibrate
    with pytest.raises(FisherSelectError, match="unknown key .samples.*unknown key .max_new_tokens_."):
        _calibrate(samples=3, max_new_tokens_=1)  # every problem of the settings in one error
    with pytest.raises(FisherSelectError, match="matches no parameter"):
        _calibrate(modules="no_such_layer")
    with pytest.raises(FisherSelectError, match="not a regular expression"):
        MemoryMode(modules="(")


def test_accumulator_bytes_of_each_mode():
    # fp32, per kept parameter coordinate: full 4 * (2 + O), gradient 4 * (1 + O), fisher 4
    from fisher_select.engine.scoring import plan_coverage

    cov = plan_coverage(enumeration_model())
    coords = sum(torch.Size(s).numel() for s in cov.shapes.values())
    for accumulators, per in (("full", 4 * 3), ("gradient", 4 * 2), ("fisher", 4)):
        assert MemoryMode(accumulators).zeros(cov, 1).nbytes() == per * coords


def test_the_smallest_mode_from_the_command_line(tmp_path, small_llama_dir):
    """`--accumulators fisher --no-stability`: F alone (4 bytes per parameter); the run says what it lacks."""
    import json

    from tests.tiny import run_command

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(2)))
    (tmp_path / "r.yaml").write_text(f"model: {small_llama_dir}\nprompts: p.jsonl\nobjective:\n  type: rl\n"
                                     "  reward: {type: regex, pattern: '[0-9]'}\n")
    assert run_command(["calibrate", "--recipe", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "run"),
                        "--accumulators", "fisher", "--no-stability", "--samples-per-prompt", "2",
                        "--max-new-tokens", "4", "--no-progress"]) == 0
    run = load_run(tmp_path / "run")
    assert run.report.config["accumulators"] == "fisher" and run.report.config["stability"] is False
    assert any("no gradient estimate" in w for w in run.report.warnings)
