"""On-policy distillation (PG-style and full-vocabulary): exact enumeration, Monte Carlo, bad teachers.

Exact references (tests/test_token_fisher.py enumerates every response of a tiny model):
- PG: ``E[(sigma - E[sigma|x]) h]`` equals the autograd gradient of ``-KL(pi || T)`` over all outcomes;
- full: ``E[sum_t A_t h_t]`` equals the autograd gradient of ``E_y sum_t KL(pi(.|s_t) || T(.|s_t))``
  with the state distribution held fixed; the exact-variance and sampled-token scales agree;
- the bounds ``sqrt(F S)`` and ``sqrt(F^tok S_tok)`` hold for every coordinate.
"""

from __future__ import annotations

import math

import pytest
import torch

from fisher_select.calibration.calibrator import calibrate
from fisher_select.errors import FisherSelectError
from fisher_select.engine.logprob import forward_logits
from fisher_select.calibration.objectives import Context, Group, OPDFullObjective, OPDPGObjective, SFTObjective
from fisher_select.calibration.objectives.distill import OPDFullConfig, OPDPGConfig
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.engine.reference import sequence_logprob
from fisher_select.calibration.teachers import Teacher, TeacherConfig, check_same_vocabulary, resolve_teacher
from tests.test_objectives_sft import exact_sft, gradient_sd, projection
from tests.enumeration import (MAX_NEW, PROMPTS, VOCAB, bound_slack, exact_fisher, exact_token_fisher, flat,
                              moments, records, state_tables, stratified_sd, student, student_outcomes,
                              teacher, teacher_views)
from tests.tiny import TinyTokenizer, enumeration_model

K = 512  # samples per prompt in the Monte Carlo checks (2 prompts)


def sigmas(kind: str) -> list[list[float]]:
    return [[v.logt - o.logpi for o, v in zip(rows, vs)] for rows, vs in zip(student_outcomes(), teacher_views(kind))]


def exact_pg(kind: str):
    """(g, S, per-prompt (mean, var, 4th central moment) of sigma)."""
    per_prompt, g = [], 0
    for rows, sig in zip(student_outcomes(), sigmas(kind)):
        m = sum(o.prob * s for o, s in zip(rows, sig))
        var = sum(o.prob * (s - m) ** 2 for o, s in zip(rows, sig))
        m4 = sum(o.prob * (s - m) ** 4 for o, s in zip(rows, sig))
        per_prompt.append((m, var, m4))
        g = g + sum(o.prob * (s - m) * o.h for o, s in zip(rows, sig))
    return g / len(PROMPTS), sum(v for _, v, _ in per_prompt) / len(PROMPTS), per_prompt


def exact_full(kind: str):
    """(g, S_tok exact-variance, S_tok sampled-token, per-outcome tuples) for full-vocabulary distillation."""
    outcomes, views = student_outcomes(), teacher_views(kind)
    g = sum(sum(o.prob * (v.a[:, None] * o.ht).sum(0) for o, v in zip(rows, vs))
            for rows, vs in zip(outcomes, views)) / len(PROMPTS)
    s_var = sum(sum(o.prob * float(v.var.sum()) for o, v in zip(rows, vs)) for rows, vs in zip(outcomes, views))
    s_a2 = sum(sum(o.prob * float((v.a**2).sum()) for o, v in zip(rows, vs)) for rows, vs in zip(outcomes, views))
    return g, s_var / len(PROMPTS), s_a2 / len(PROMPTS)


def autograd_reference(kind: str, full: bool) -> torch.Tensor:
    """d/dtheta of -KL(pi || T) over all outcomes (PG), or of E_y sum_t KL_t with P(y) held fixed (full)."""
    model, t = student(), teacher(kind)
    params = [p for _, p in model.named_parameters()]
    total = 0
    for prompt, rows in zip(PROMPTS, student_outcomes()):
        for o in rows:
            if full:
                ids = torch.tensor([prompt + o.response])
                states = slice(len(prompt) - 1, -1)  # positions whose next token is a response token
                lp = torch.log_softmax(forward_logits(model, ids, torch.ones_like(ids))[0, states].float(), -1)
                with torch.no_grad():
                    lt = torch.log_softmax(forward_logits(t, ids, torch.ones_like(ids))[0, states].float(), -1)
                total = total + o.prob * (lp.exp() * (lp - lt)).sum()
            else:
                lp = sequence_logprob(model, prompt, o.response)
                with torch.no_grad():
                    lt = sequence_logprob(t, prompt, o.response)
                total = total + lp.exp() * (lt - lp)
    grads = torch.autograd.grad(total / len(PROMPTS), params)
    return torch.cat([g.double().flatten() for g in grads])


# ---------------------------------------------------------------------------
# Exact enumeration


@pytest.mark.parametrize("kind", ["near", "far"])
def test_pg_gradient_is_minus_kl_gradient_and_the_bound_holds(kind):
    g, S, _ = exact_pg(kind)
    ref = autograd_reference(kind, full=False)
    assert float((g - ref).norm() / ref.norm()) < 1e-5
    uncentred = sum(sum(o.prob * s * o.h for o, s in zip(rows, sig))
                    for rows, sig in zip(student_outcomes(), sigmas(kind))) / len(PROMPTS)
    assert float((uncentred - g).norm() / g.norm()) < 1e-4  # the baseline E[sigma|x] is free
    assert 0 < bound_slack(g, exact_fisher(), S) <= 1


@pytest.mark.parametrize("kind", ["near", "far"])
def test_full_gradient_is_the_per_state_kl_gradient_and_the_token_bound_holds(kind):
    g, s_var, s_a2 = exact_full(kind)
    ref = autograd_reference(kind, full=True)
    assert float((g - ref).norm() / ref.norm()) < 1e-5
    assert s_var == pytest.approx(s_a2, rel=1e-6)  # both scale estimators have the same expectation
    plus_kl = sum(sum(o.prob * ((v.a + v.kl)[:, None] * o.ht).sum(0) for o, v in zip(rows, vs))
                  for rows, vs in zip(student_outcomes(), teacher_views(kind))) / len(PROMPTS)
    assert float((plus_kl - g).norm() / g.norm()) < 1e-4  # centring by KL_t is free
    assert 0 < bound_slack(g, exact_token_fisher(), s_var) <= 1


# ---------------------------------------------------------------------------
# Monte Carlo agreement


def test_pg_calibrate_agrees_with_exact():
    """S (mean of unbiased within-prompt variances) within 4 sd, with Var(s^2) = (mu4 - (K-3)/(K-1) var^2)/K;
    the leave-one-out gradient along a fixed direction within 4 sd (variance inflated by K/(K-1))."""
    g, S, per_prompt = exact_pg("near")
    cal = calibrate(student(), TinyTokenizer(VOCAB), records(), OPDPGObjective(Teacher(teacher("near"))),
                    samples_per_prompt=K, max_new_tokens=MAX_NEW, seed=21, batch_size=K, progress=False)
    sd_s = math.sqrt(sum((m4 - (K - 3) / (K - 1) * v**2) / K for _, v, m4 in per_prompt)) / len(PROMPTS)
    assert abs(cal.signal_scale - S) < 4 * sd_s, (cal.signal_scale, S, sd_s)
    u = projection(2)
    centred = [[s - m for s in sig] for sig, (m, _, _) in zip(sigmas("near"), per_prompt)]
    sd_g = gradient_sd(centred, u, K, loo=True)
    mc = float(flat(cal.grad_estimate) @ u)
    assert abs(mc - float(g @ u)) < 4 * sd_g, (mc, float(g @ u), sd_g)
    kl = -sum(m for m, _, _ in per_prompt) / len(PROMPTS)
    assert cal.objectives[0].summary["reverse_kl_estimate"] == pytest.approx(kl, rel=0.5)


def test_full_calibrate_agrees_with_exact():
    """Exact-variance S_tok, sampled-token S_tok and the token-weighted gradient along u, each within
    4 sd computed from the exact per-prompt variances of the per-sample quantities."""
    g, s_var, _ = exact_full("near")
    objective = OPDFullObjective(Teacher(teacher("near")), sign_draws=1)
    cal = calibrate(student(), TinyTokenizer(VOCAB), records(), objective, samples_per_prompt=K,
                    max_new_tokens=MAX_NEW, seed=22, batch_size=K, progress=False)
    views = teacher_views("near")
    for estimate, per_outcome in [
        (cal.signal_scale, [[float(v.var.sum()) for v in vs] for vs in views]),
        (cal.objectives[0].summary["signal_scale_sampled"], [[float((v.a**2).sum()) for v in vs] for vs in views]),
    ]:
        sd = stratified_sd([v for _, v in moments(per_outcome)], K)
        assert abs(estimate - s_var) < 4 * sd, (estimate, s_var, sd)
    u = projection(3)
    per_sample = [[float((v.a[:, None] * o.ht).sum(0) @ u) for o, v in zip(rows, vs)]
                  for rows, vs in zip(student_outcomes(), views)]
    sd_g = stratified_sd([v for _, v in moments(per_sample)], K)
    mc = float(flat(cal.grad_estimate) @ u)
    assert abs(mc - float(g @ u)) < 4 * sd_g, (mc, float(g @ u), sd_g)
    assert cal.fisher_for(objective.name) is cal.token_fisher
    for n, b in cal.bound().items():
        assert torch.allclose(b, (cal.token_fisher[n] * cal.signal_scale).sqrt())


def test_mixed_bound_uses_each_objectives_own_fisher():
    """SFT + PG share F; a full-vocabulary objective in the mix brings sqrt(F^tok S_tok)."""
    near = Teacher(teacher("near"))
    cal = calibrate(student(), TinyTokenizer(VOCAB), records(),
                    [SFTObjective(near), OPDPGObjective(near), OPDFullObjective(near, sign_draws=2)],
                    samples_per_prompt=32, max_new_tokens=MAX_NEW, seed=5, batch_size=32, progress=False)
    s = {o.name: o.signal_scale for o in cal.objectives}
    c = {"sft": 1.0, "opd-pg": -0.5, "opd-full": 2.0}
    for n, b in cal.mixed_bound(c).items():
        expected = (cal.fisher[n].sqrt() * (math.sqrt(s["sft"]) + 0.5 * math.sqrt(s["opd-pg"]))
                    + 2.0 * (cal.token_fisher[n] * s["opd-full"]).sqrt())
        assert torch.allclose(b, expected, rtol=1e-6)
    # exact: |g_sft - 0.5 g_pg| <= sqrt(F) (sqrt(S_sft) + 0.5 sqrt(S_pg)) for every coordinate
    g_sft, S_sft, _ = exact_sft("near")
    g_pg, S_pg, _ = exact_pg("near")
    bound = exact_fisher().sqrt() * (math.sqrt(S_sft) + 0.5 * math.sqrt(S_pg))
    assert bool(((g_sft - 0.5 * g_pg).abs() <= bound * (1 + 1e-6)).all())


# ---------------------------------------------------------------------------
# Teachers that cannot be used, or give probability 0


@pytest.mark.parametrize("make", [lambda t: OPDPGObjective(t), lambda t: OPDFullObjective(t)], ids=["pg", "full"])
def test_teacher_with_zero_probability_gives_infinite_scale_not_a_crash(make):
    objective = make(Teacher(teacher("banned")))
    cal = calibrate(student(), TinyTokenizer(VOCAB), records(), objective, samples_per_prompt=16,
                    max_new_tokens=MAX_NEW, seed=1, batch_size=16, progress=False)
    summary = cal.objectives[0].summary
    assert cal.signal_scale == math.inf and summary["infinite_groups"] >= 1
    assert any("probability 0" in w and "infinite" in w for w in summary["warnings"])
    assert all(torch.isfinite(t).all() for t in cal.grad_estimate.values())  # affected groups left out
    fisher = cal.fisher_for(objective.name)
    assert all(torch.isinf(b[fisher[n] > 0]).all() for n, b in cal.bound().items())  # no bound


class OtherTokenizer(TinyTokenizer):
    """Same size, but id 3 is another string."""

    def get_vocab(self):
        return {**{str(i): i for i in range(self.vocab) if i != 3}, "x": 3}


def test_teacher_with_another_vocabulary_is_refused():
    with pytest.raises(FisherSelectError, match=r"differs from the model's at id 3: the model has '3', .* has 'x'"):
        check_same_vocabulary(TinyTokenizer(VOCAB), OtherTokenizer(VOCAB), "the teacher")
    larger = r"has 6 tokens, the model 5: id 5 \('5'\) is only in the teacher's vocabulary"
    with pytest.raises(FisherSelectError, match=larger):
        check_same_vocabulary(TinyTokenizer(VOCAB), TinyTokenizer(6), "the teacher")
    objective = OPDPGObjective(Teacher(teacher("far"), OtherTokenizer(VOCAB), name="the teacher"))
    with pytest.raises(FisherSelectError, match="at id 3"):
        calibrate(student(), TinyTokenizer(VOCAB), records(), objective, samples_per_prompt=2,
                  max_new_tokens=MAX_NEW, progress=False)
    wider = Teacher(enumeration_model(seed=1, vocab=6), name="the teacher")
    with pytest.raises(FisherSelectError, match="outputs 6 logits per position, the model 5"):
        resolve_teacher(wider, Context(student(), TinyTokenizer(VOCAB)))


def test_teacher_log_probabilities_match_unpadded_references():
    """Batched, left-padded teacher scoring equals scoring each response alone; -inf stays -inf."""
    responses = [[4], [2, 3, 1], [0, 4, 2]]
    group = Group(records()[0], PROMPTS[0], responses, [""] * 3, [0.0] * 3, [True] * 3)
    for kind in ("far", "banned"):
        t = Teacher(teacher(kind))
        seq = t.sequence_logprobs(group)
        tables = t.token_tables(group)
        for r, lp, table in zip(responses, seq, tables):
            ref = float(sequence_logprob(teacher(kind), PROMPTS[0], r).detach())
            assert (lp == ref) if math.isinf(ref) else lp == pytest.approx(ref, abs=1e-5)
            assert torch.allclose(table.double(), state_tables(teacher(kind), PROMPTS[0], r), atol=1e-5)  # inf == inf
    assert math.isinf(float(Teacher(teacher("banned")).sequence_logprobs(group)[1]))  # response has token 3


def test_context_teacher_renders_system_prompt_and_record_fields():
    t = Teacher(student(), TinyTokenizer(VOCAB), system_prompt="0", user_template="{prompt} {answer}")
    rec = records()[1]  # prompt "4 2 0", answer 4
    assert t.context_ids(rec, PROMPTS[1]) == [0, 4, 2, 0, 4]
    missing = Teacher(student(), TinyTokenizer(VOCAB), user_template="{prompt} {solution}", name="the teacher")
    with pytest.raises(FisherSelectError, match=r"\{solution\} but prompt 0 .* has no field 'solution'"):
        missing.context_ids(records()[0], PROMPTS[0])


def test_context_teacher_with_chat_template(embedded):
    model, tok, _ = embedded
    t = resolve_teacher(TeacherConfig(system_prompt="Be brief.", user_template="{prompt} (answer: {answer})"),
                        Context(model, tok))
    rec = records()[0]
    text = tok.decode(t.context_ids(rec, []))
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text and "(answer: 3)<|im_end|>" in text
    assert "SmolLM" not in text  # the teacher's system prompt replaces the template's default one
    assert text.endswith("<|im_start|>assistant\n")


def test_distill_config_problems():
    assert OPDPGConfig(teacher={"model": "self", "user_template": "{prompt}"}).problems() == []
    assert "signal is zero" in " ".join(OPDPGConfig(teacher={}).problems())
    bad_draws = OPDFullConfig(teacher={"system_prompt": "x"}, sign_draws=0)
    assert "sign_draws: must be at least 1" in " ".join(bad_draws.problems())
    assert "not a valid format string" in " ".join(OPDPGConfig(teacher={"user_template": "{prompt"}).problems())


def _word_tokenizer(words):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", pad_token="</s>")


def test_teacher_loaded_from_a_directory_is_checked_and_used(tmp_path):
    """A recipe-style teacher (a model directory): same tokenizer runs; one changed token is refused."""
    from transformers import LlamaConfig, LlamaForCausalLM

    words = ["<unk>", "</s>", "hello", "world"] + [f"w{i}" for i in range(4)]
    config = LlamaConfig(vocab_size=len(words), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=1, bos_token_id=None,
                         pad_token_id=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    for name, vocab in [("same", words), ("other", words[:5] + ["HELLO"] + words[6:])]:
        torch.manual_seed(1)
        LlamaForCausalLM(config).save_pretrained(tmp_path / name)
        _word_tokenizer(vocab).save_pretrained(tmp_path / name)
    prompts = [PromptRecord(0, "hello world", None, {})]
    ok = OPDPGObjective(TeacherConfig(model=str(tmp_path / "same")))
    cal = calibrate(model, _word_tokenizer(words), prompts, ok, samples_per_prompt=4, max_new_tokens=2, progress=False)
    assert math.isfinite(cal.signal_scale) and cal.signal_scale > 0
    bad = OPDPGObjective(TeacherConfig(model=str(tmp_path / "other")))
    with pytest.raises(FisherSelectError, match=r"at id 5: the model has 'w1', .* has 'HELLO'"):
        calibrate(model, _word_tokenizer(words), prompts, bad, samples_per_prompt=2, max_new_tokens=2, progress=False)
