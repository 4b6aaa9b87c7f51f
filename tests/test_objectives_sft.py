"""SFT toward a demonstrator nu: exact enumeration, Monte Carlo agreement, weights, demonstrations.

Exact references come from enumerating every response of a tiny model (tests/test_token_fisher.py):
``g = E_pi[(w - 1) h]`` must equal ``E_nu[h]`` (the SFT gradient) and be unchanged by a prompt-only
baseline, and ``|g_i| <= sqrt(F_i chi2)`` must hold for every coordinate. calibrate()'s estimates
(K = 512 samples per prompt) must agree with the exact values within stated standard deviations.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from fisher_select.calibration.calibrator import calibrate
from fisher_select.errors import FisherSelectError
from fisher_select.calibration.objectives import Group, RLObjective, SFTDemonstrationsObjective, SFTObjective
from fisher_select.calibration.objectives.sft import MAX_SIGNAL, SFTConfig, weight_diagnostics
from fisher_select.engine.reference import per_sample_scores
from fisher_select.calibration.teachers import Teacher, TeacherConfig
from tests.enumeration import (MAX_NEW, PROMPTS, VOCAB, bound_slack, exact_fisher, flat, moments, records,
                              stratified_sd, student, student_outcomes, teacher, teacher_views)
from tests.tiny import TinyTokenizer

K = 512  # samples per prompt in the Monte Carlo checks (2 prompts)


def log_weights(kind: str, context: tuple[int, ...] = ()) -> list[list[float]]:
    """Per prompt and outcome: log w = log nu(y|x) - log pi(y|x) (-inf where nu(y|x) = 0)."""
    return [[v.logt - o.logpi for o, v in zip(rows, views)]
            for rows, views in zip(student_outcomes(), teacher_views(kind, context))]


def exact_sft(kind: str, context: tuple[int, ...] = ()):
    """(g, S, per-prompt moments of (w-1)^2) for SFT toward the teacher ``kind``."""
    lw = log_weights(kind, context)
    g = sum(sum(o.prob * math.expm1(x) * o.h for o, x in zip(rows, ls))
            for rows, ls in zip(student_outcomes(), lw)) / len(PROMPTS)
    sq = moments([[math.expm1(x) ** 2 for x in ls] for ls in lw])
    return g, sum(m for m, _ in sq) / len(sq), sq


def projection(seed: int) -> torch.Tensor:
    return torch.randn(exact_fisher().shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def gradient_sd(signal: list[list[float]], u: torch.Tensor, k: int, loo: bool = False) -> float:
    """sd of the Monte Carlo gradient along u: per-prompt Var(a u.h) / K (times K/(K-1) for leave-one-out)."""
    var = [v for _, v in moments([[a * float(o.h @ u) for o, a in zip(rows, sig)]
                                  for rows, sig in zip(student_outcomes(), signal)])]
    return stratified_sd(var, k) * (math.sqrt(k / (k - 1)) if loo else 1.0)


# ---------------------------------------------------------------------------
# Exact enumeration


@pytest.mark.parametrize("kind", ["near", "far", "banned"])
def test_sft_signal_gives_the_demonstrators_mean_score_and_the_bound_holds(kind):
    g, S, _ = exact_sft(kind)
    outcomes, views = student_outcomes(), teacher_views(kind)
    nu_total = [sum(math.exp(v.logt) for v in vs) for vs in views]
    assert all(abs(t - 1) < 1e-5 for t in nu_total)  # nu is a distribution over the same outcomes
    e_nu_h = sum(sum(math.exp(v.logt) * o.h for o, v in zip(rows, vs))
                 for rows, vs in zip(outcomes, views)) / len(PROMPTS)
    assert float((g - e_nu_h).norm() / e_nu_h.norm()) < 1e-4
    # a prompt-only baseline b(x) leaves the gradient unchanged
    shifted = sum(sum(o.prob * (math.expm1(x) + b) * o.h for o, x in zip(rows, ls))
                  for rows, ls, b in zip(outcomes, log_weights(kind), [2.5, -7.0])) / len(PROMPTS)
    assert float((shifted - g).norm() / g.norm()) < 1e-4
    slack = bound_slack(g, exact_fisher(), S)
    assert 0 < slack <= 1
    assert math.isfinite(S)  # nu(y|x) = 0 (banned) gives w = 0, a finite contribution


def test_demonstrator_that_zeroes_responses_has_finite_scale():
    """log nu = -inf for sampled responses means w = 0: (w - 1)^2 = 1, not an infinite S."""
    assert any(math.isinf(x) for ls in log_weights("banned") for x in ls)
    _, S, _ = exact_sft("banned")
    cal = calibrate(student(), TinyTokenizer(VOCAB), records(), SFTObjective(Teacher(teacher("banned"))),
                    samples_per_prompt=64, max_new_tokens=MAX_NEW, seed=2, batch_size=64, progress=False)
    summary = cal.objectives[0].summary
    assert summary["weights"]["zero_weight_samples"] > 0
    assert math.isfinite(cal.signal_scale) and cal.signal_scale > 0
    assert not any("overflow" in w or "infinite" in w for w in summary["warnings"])
    assert all(torch.isfinite(t).all() for t in cal.grad_estimate.values())
    assert S > 0


# ---------------------------------------------------------------------------
# Monte Carlo agreement


@pytest.mark.parametrize("spec,context", [
    ("near", ()),
    ("self+system", (0,)),  # context distillation: nu(y|x) = pi(y | "0" + x)
])
def test_calibrate_scale_and_gradient_agree_with_exact(spec, context):
    """S within 4 sd (sd from the exact per-prompt variance of (w-1)^2), gradient along a fixed
    direction within 4 sd, on K = 512 samples per prompt."""
    if spec == "near":
        demonstrator, kind = Teacher(teacher("near")), "near"
    else:
        demonstrator, kind = TeacherConfig(model="self", system_prompt="0"), "self"
    g, S, sq = exact_sft(kind, context)
    cal = calibrate(student(), TinyTokenizer(VOCAB), records(), SFTObjective(demonstrator),
                    samples_per_prompt=K, max_new_tokens=MAX_NEW, seed=11, batch_size=K, progress=False)
    sd_s = stratified_sd([v for _, v in sq], K)
    assert abs(cal.signal_scale - S) < 4 * sd_s, (cal.signal_scale, S, sd_s)
    u = projection(1)
    signal = [[math.expm1(x) for x in ls] for ls in log_weights(kind, context)]
    sd_g = gradient_sd(signal, u, K)
    mc = float(flat(cal.grad_estimate) @ u)
    assert abs(mc - float(g @ u)) < 4 * sd_g, (mc, float(g @ u), sd_g)


def test_weight_diagnostics_match_direct_computation_on_the_samples():
    cal = calibrate(student(), TinyTokenizer(VOCAB), records(), SFTObjective(Teacher(teacher("near"))),
                    samples_per_prompt=16, max_new_tokens=MAX_NEW, seed=4, batch_size=16, progress=False)
    weights = cal.objectives[0].summary["weights"]
    for entry in weights["per_prompt"]:
        w = torch.tensor([math.exp(s["value"]["sft"]) for s in cal.samples
                          if s["prompt_index"] == entry["prompt_index"]], dtype=torch.float64)
        assert entry["ess"] == pytest.approx(float(w.sum() ** 2 / (w**2).sum()), rel=1e-9)
        assert entry["max_weight_share"] == pytest.approx(float(w.max() / w.sum()), rel=1e-9)
        assert 1 <= entry["ess"] <= 16


def _group(logprobs: list[float]) -> Group:
    k = len(logprobs)
    return Group(records()[0], PROMPTS[0], [[2]] * k, ["2"] * k, logprobs, [True] * k)


class _FixedDensity:
    """A demonstrator stub: fixed log nu(y|x) for every response of a group."""

    name = "stub"

    def __init__(self, values):
        self.values = torch.tensor(values, dtype=torch.float64)

    def sequence_logprobs(self, group):
        return self.values


def test_huge_weights_do_not_overflow_and_are_reported():
    """log w = 800 overflows w in fp64: S is inf (the true value exceeds fp64), the signal is clipped,
    ESS and the largest share still come out (computed from log w), warnings say all of it."""
    obj = SFTObjective(Teacher(student()))
    obj.teacher = _FixedDensity([0.0, -800.0, -math.inf, -800.0])
    out = obj.signals(_group([-800.0, -800.0, -3.0, -800.0]), None)  # log w = 800, 0, -inf, 0
    assert out.signal[0] == MAX_SIGNAL and out.signal[2] == -1.0 and out.signal[1] == 0.0
    assert math.isinf(out.scale_term)
    stats = obj.new_statistics()  # the calibrator's side: statistics of the groups seen
    stats.add(out)
    summary = obj.summary(stats)
    entry = summary["weights"]["per_prompt"][0]
    assert entry["ess"] == pytest.approx(1.0) and entry["max_weight_share"] == pytest.approx(1.0)
    text = " ".join(summary["warnings"])
    assert "overflows fp64" in text and "clipped" in text and "one sample carries" in text
    assert summary["signal_scale"] == math.inf


def test_moderate_weights_give_textbook_ess():
    w = [0.5, 1.5, 1.0, 1.0]
    diag = weight_diagnostics([(0, torch.tensor(w, dtype=torch.float64).log())])
    assert diag["per_prompt"][0]["ess"] == pytest.approx(16 / 4.5)
    assert diag["per_prompt"][0]["max_weight_share"] == pytest.approx(0.375)
    assert diag["mean_weight"] == pytest.approx(1.0)


def test_nan_demonstrator_is_an_error():
    obj = SFTObjective(Teacher(student()))
    obj.teacher = _FixedDensity([math.nan, 0.0])
    with pytest.raises(FisherSelectError, match="NaN"):
        obj.signals(_group([-1.0, -1.0]), None)


# ---------------------------------------------------------------------------
# Demonstrations without a density


class DemoTokenizer(TinyTokenizer):
    """TinyTokenizer that accepts add_special_tokens= (demonstration responses are tokenized without them)."""

    def __call__(self, text: str, add_special_tokens: bool = True):
        return super().__call__(text)


def _write_demos(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_demonstrations_give_mean_score_unknown_scale_and_chi_square_lower_bound(tmp_path):
    demos = [{"prompt": "2 3", "response": "4 4"}, {"prompt": "2 3", "response": "0"},
             {"prompt": "4 2 0", "response": "3 2"}, {"prompt": "9 9", "response": "2"}]  # last: unused
    path = _write_demos(tmp_path / "demos.jsonl", demos)
    cal = calibrate(student(), DemoTokenizer(VOCAB), records(), SFTDemonstrationsObjective(path),
                    samples_per_prompt=32, max_new_tokens=MAX_NEW, seed=0, batch_size=32, progress=False)
    result = cal.objectives[0]
    assert result.signal_scale is None and result.summary["signal_scale"] is None
    # the gradient estimate is the plain mean of the demonstration pairs' scores (EOS appended)
    rows = [PROMPTS[0] + [4, 4, 1], PROMPTS[0] + [0, 1], PROMPTS[1] + [3, 2, 1]]
    starts = [len(PROMPTS[0])] * 2 + [len(PROMPTS[1])]
    ref = torch.zeros_like(exact_fisher())
    for row, start in zip(rows, starts):
        ids = torch.tensor([row])
        resp = torch.zeros_like(ids, dtype=torch.bool)
        resp[0, start:] = True
        ref += flat(per_sample_scores(student(), ids, torch.ones_like(ids), resp)[0]) / len(rows)
    mean = flat(result.grad_estimate)
    assert float((mean - ref).norm() / ref.norm()) < 1e-4
    # smallest chi-square consistent with it: max_i (E_nu h_i)^2 / F_i over F_i > 0
    f = flat(cal.fisher)
    live = f > 0
    lower = result.summary["chi_square_lower_bound"]
    assert lower["value"] == pytest.approx(float((mean[live] ** 2 / f[live]).max()), rel=1e-4)
    assert "noisy lower bound" in lower["label"]
    assert result.summary["demonstrations"]["pairs"] == 3 and result.summary["demonstrations"]["unused_lines"] == 1
    assert any("unknown" in w for w in result.summary["warnings"])
    for n, b in cal.bound().items():  # S unknown: sqrt(F), same ranking
        assert torch.allclose(b, cal.fisher[n].sqrt())
    with pytest.raises(FisherSelectError, match="unknown signal scale"):
        cal.mixed_bound({"sft": 1.0})


def test_demonstrations_for_other_prompts_are_refused_before_sampling(tmp_path):
    lines = [{"prompt": "2 3", "response": "4"}, {"prompt": "3 3", "response": "4"}]  # "3 3" is no prompt
    path = _write_demos(tmp_path / "demos.jsonl", lines)

    class NoSampling(torch.nn.Module):  # any forward pass would fail: the check must come first
        def __init__(self):
            super().__init__()
            self.inner = student()
            self.config, self.generation_config = self.inner.config, self.inner.generation_config

        def forward(self, **kwargs):
            raise AssertionError("sampled before checking the demonstrations")

    with pytest.raises(FisherSelectError, match=r"no demonstration for prompt 1 .*1 of 2 calibration prompts"):
        calibrate(NoSampling(), DemoTokenizer(VOCAB), records(), SFTDemonstrationsObjective(path),
                  samples_per_prompt=2, max_new_tokens=MAX_NEW, progress=False, verify=False)


def test_demonstration_without_response_is_refused(tmp_path):
    path = _write_demos(tmp_path / "demos.jsonl", [{"prompt": "2 3", "answer": "4"}])
    with pytest.raises(FisherSelectError, match=r"demos.jsonl:1: needs a \"response\""):
        SFTDemonstrationsObjective(path)


def test_sft_config_problems():
    assert SFTConfig().problems() == ["give exactly one of 'demonstrator' (a density) and 'demonstrations' (a file)"]
    assert "signal is zero" in " ".join(SFTConfig(demonstrator={"model": "self"}).problems())
    assert "unknown key 'sytem_prompt'" in " ".join(SFTConfig(demonstrator={"sytem_prompt": "x"}).problems())
    assert SFTConfig(demonstrator={"system_prompt": "Be brief."}).problems() == []


# ---------------------------------------------------------------------------
# Two objectives, one Fisher


def reward(record, text):
    return 1.0 if "3" in text.split() else 0.0


def test_sft_and_rl_share_one_fisher_and_the_mixed_bound_follows_math():
    tok = TinyTokenizer(VOCAB)
    args = dict(samples_per_prompt=64, max_new_tokens=MAX_NEW, seed=3, batch_size=64, progress=False)
    both = calibrate(student(), tok, records(), [SFTObjective(Teacher(teacher("near"))), RLObjective(reward)], **args)
    alone = calibrate(student(), tok, records(), SFTObjective(Teacher(teacher("near"))), **args)
    for n in both.fisher:  # same samples, same Fisher, same SFT estimate
        assert torch.allclose(both.fisher[n], alone.fisher[n], rtol=1e-6, atol=0)
        assert torch.allclose(both.objective("sft").grad_estimate[n], alone.grad_estimate[n], rtol=1e-5, atol=1e-9)
    c = {"sft": 0.5, "rl": -2.0}
    s_sft, s_rl = both.objective("sft").signal_scale, both.objective("rl").signal_scale
    for n, b in both.mixed_bound(c).items():
        expected = both.fisher[n].sqrt() * (0.5 * math.sqrt(s_sft) + 2.0 * math.sqrt(s_rl))
        assert torch.allclose(b, expected, rtol=1e-6)
    # exact: |0.5 g_sft - 2 g_rl| <= sqrt(F) (0.5 sqrt(S_sft) + 2 sqrt(S_rl)) for every coordinate
    g_sft, S_sft, _ = exact_sft("near")
    r = [[reward(None, " ".join(str(t) for t in o.response if t != 1)) for o in rows]  # decoded as calibrate does
         for rows in student_outcomes()]
    rm = moments(r)
    g_rl = sum(sum(o.prob * (ri - m) * o.h for o, ri in zip(rows, rr))
               for rows, rr, (m, _) in zip(student_outcomes(), r, rm)) / len(PROMPTS)
    S_rl = sum(v for _, v in rm) / len(rm)
    mixed = (0.5 * g_sft - 2.0 * g_rl).abs()
    bound = exact_fisher().sqrt() * (0.5 * math.sqrt(S_sft) + 2.0 * math.sqrt(S_rl))
    assert bool((mixed <= bound * (1 + 1e-6)).all())
