"""engine.selfcheck: the rules against autograd on the first rows, in every accumulator mode.

It passes on correct models (fp32 and float64, with a signal, restricted to some parameters) and
refuses a deliberately wrong rule with one error naming the module, its class and the rule.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fisher_select import FisherSelectError, plan_coverage
from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import RLObjective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.engine.memory import ACCUMULATORS
from fisher_select.engine.rules import registry
from fisher_select.engine.rules.linear import LinearRule
from fisher_select.engine.selfcheck import FALLBACK, TOLERANCE, check_rules, rule_names
from tests.tiny import TinyTokenizer, random_batch, tiny_model


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-bias", "gpt2", "llama-fallback", "linear-called-twice"])
def test_passes_on_correct_models(name):
    model = tiny_model(name)
    ids, attn, resp, signal = random_batch()
    got = check_rules(model, ids, attn, resp, signal=signal)
    assert got["rows"] == 2 and got["parameters"] == len(plan_coverage(model).users)
    assert got["max_relative_error"] <= got["tolerance"] == TOLERANCE[torch.float32]
    several = torch.stack([signal, -signal])  # (O, B): the per-sample path of the signal sums
    assert check_rules(model.double(), ids, attn, resp, rows=3, signal=several)["max_relative_error"] < 1e-12


def test_params_restricts_the_check():
    model = tiny_model("llama-untied")
    ids, attn, resp, _ = random_batch()
    chosen = {"model.layers.1.mlp.down_proj.weight", "lm_head.weight"}
    got = check_rules(model, ids, attn, resp, params=chosen)
    assert got["parameters"] == 2 and got["parameter"] in chosen


class OffsetLinear(nn.Linear):
    """Computes X W^T + b + 1: a subclass a user registered with the Linear rule by mistake."""

    def forward(self, x):
        return super().forward(x) * 2.0 + 1.0


@pytest.fixture
def wrong_rule():
    """OffsetLinear registered with the plain Linear rule (which misses its factor 2), then removed."""
    registry._BY_CLASS[OffsetLinear] = LinearRule()
    try:
        yield
    finally:
        del registry._BY_CLASS[OffsetLinear]


def _with_offset_linear(model, path):
    parent, _, child = path.rpartition(".")
    old = model.get_submodule(path)
    new = OffsetLinear(old.in_features, old.out_features, bias=old.bias is not None)
    new.load_state_dict(old.state_dict())
    setattr(model.get_submodule(parent), child, new)
    return model


@pytest.mark.parametrize("mode", ["full", "gradient", "fisher"])
def test_catches_a_wrong_rule_and_names_the_module(wrong_rule, mode):
    model = _with_offset_linear(tiny_model("llama-untied"), "model.layers.0.mlp.gate_proj")
    ids, attn, resp, signal = random_batch()
    signal = None if mode == "fisher" else signal  # what each accumulator mode passes
    with pytest.raises(FisherSelectError) as err:
        check_rules(model, ids, attn, resp, signal=signal)
    message = str(err.value)
    assert "model.layers.0.mlp.gate_proj.weight" in message and "'model.layers.0.mlp.gate_proj'" in message
    assert "OffsetLinear" in message and "LinearRule" in message
    assert "up_proj" not in message  # only the wrong one is named


def test_refuses_a_sharded_model_with_one_error(monkeypatch):
    from fisher_select.engine import selfcheck

    monkeypatch.setattr(selfcheck, "_sharded", lambda model: True)
    ids, attn, resp, _ = random_batch()
    with pytest.raises(FisherSelectError, match="before fully_shard"):
        check_rules(tiny_model("llama-tied"), ids, attn, resp)


def test_rule_names_list_every_parameter_and_the_fallback():
    model = tiny_model("llama-fallback")
    names = rule_names(plan_coverage(model))
    assert list(names) == [n for n, _ in model.named_parameters()]
    assert names["model.layers.0.mlp.down_proj.0.scale"] == FALLBACK
    assert names["model.embed_tokens.weight"] == "EmbeddingRule"
    assert names["model.layers.0.input_layernorm.weight"] == "FunctionalNormRule"
    assert {v for k, v in names.items() if k.endswith("proj.weight") or k.endswith("proj.1.weight")} == {"LinearRule"}


def test_a_wrong_rule_outside_params_is_not_checked(wrong_rule):
    """params= restricts the check as it restricts the accumulators: the wrong layer is left out."""
    model = _with_offset_linear(tiny_model("llama-untied"), "model.layers.0.mlp.gate_proj")
    ids, attn, resp, _ = random_batch()
    assert check_rules(model, ids, attn, resp, params={"model.layers.0.mlp.up_proj.weight"})["parameters"] == 1
    with pytest.raises(FisherSelectError, match="gate_proj"):
        check_rules(model, ids, attn, resp, params={"model.layers.0.mlp.gate_proj.weight"})


def test_parameters_checked_in_groups_give_the_same_verdicts(wrong_rule):
    """group_elements bounds the memory of a large model's check: one pass per group, same answers."""
    model = tiny_model("llama-untied")
    ids, attn, resp, signal = random_batch()
    one = check_rules(model, ids, attn, resp, signal=signal)
    many = check_rules(model, ids, attn, resp, signal=signal, group_elements=600)  # 16x32 MLP weights: 1 each
    assert many["parameters"] == one["parameters"] and many["max_relative_error"] <= many["tolerance"]
    _with_offset_linear(model, "model.layers.1.mlp.gate_proj")
    with pytest.raises(FisherSelectError, match=r"layers\.1\.mlp\.gate_proj\.weight"):
        check_rules(model, ids, attn, resp, group_elements=600)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_catches_the_plain_embedding_rule_on_gemmas_scaled_embedding(dtype):
    """The bug of issue 30: Gemma 3's scaled embedding given the plain Embedding rule (as the registry did
    before it compared forwards) is refused, in fp32 and in bf16, with the module named."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from fisher_select.engine.rules.embedding import EmbeddingRule
    from tests.test_families import VOCAB, tiny_family

    model = tiny_family("gemma3").to(dtype)
    ids, attn, resp, signal = random_batch(vocab=VOCAB)
    assert check_rules(model, ids, attn, resp, signal=signal)["parameters"] > 0  # its own rule: passes
    saved = registry._BY_CLASS[Gemma3TextScaledWordEmbedding]
    registry._BY_CLASS[Gemma3TextScaledWordEmbedding] = EmbeddingRule()
    try:
        with pytest.raises(FisherSelectError, match=r"model\.embed_tokens\.weight \(module 'model\.embed_tokens'"):
            check_rules(model, ids, attn, resp)
    finally:
        registry._BY_CLASS[Gemma3TextScaledWordEmbedding] = saved


# ---- calibrate() runs the self-check on its first batch in every accumulator mode --------------------------------

CAL_PROMPTS = [PromptRecord(i, p, None, {}) for i, p in enumerate(["2 3", "4 2 9", "3 3"])]


def _reward(record, text):
    return float(len(text) % 2)  # varies within a prompt's responses: a nonzero signal


def _calibrate(model, **kw):
    return calibrate(model, TinyTokenizer(64), CAL_PROMPTS, RLObjective(_reward), samples_per_prompt=2,
                     max_new_tokens=3, seed=3, batch_size=4, stability=False, progress=False, **kw)


@pytest.mark.parametrize("mode", ACCUMULATORS)
def test_calibrate_refuses_a_wrong_rule_in_every_accumulator_mode(wrong_rule, mode):
    """The bug of issue 30: outside accumulators=full nothing compared the rules with autograd."""
    model = _with_offset_linear(tiny_model("llama-untied"), "model.layers.0.mlp.gate_proj")
    with pytest.raises(FisherSelectError) as err:
        _calibrate(model, accumulators=mode)
    message = str(err.value)
    assert "model.layers.0.mlp.gate_proj.weight (module 'model.layers.0.mlp.gate_proj'" in message
    assert "OffsetLinear" in message and "LinearRule" in message and "up_proj" not in message


@pytest.mark.parametrize("mode", ACCUMULATORS)
def test_calibrate_records_the_selfcheck_in_every_accumulator_mode(mode):
    model = tiny_model("llama-untied")
    cal = _calibrate(model, accumulators=mode)
    got = cal.checks["selfcheck"]
    assert got["rows"] == 2 and got["parameters"] == len(plan_coverage(model).users) > 0
    assert 0 < got["max_relative_error"] <= got["tolerance"] == TOLERANCE[torch.float32]
    assert ("autograd" in cal.checks) == (mode == "full")  # the score sums' check, as before
    assert cal.objectives[0].signal_scale > 0  # the first batch's signal was not zero: its sums were compared too


@pytest.mark.filterwarnings("ignore::fisher_select.errors.DegenerateResultWarning")  # S does not matter here
def test_calibrate_checks_only_the_modules_it_keeps_and_verify_false_skips(wrong_rule):
    model = _with_offset_linear(tiny_model("llama-untied"), "model.layers.0.mlp.gate_proj")
    cal = _calibrate(model, accumulators="fisher", modules=r"layers\.1\.mlp")
    assert cal.checks["selfcheck"]["parameters"] == 3  # gate, up, down of layer 1; the wrong layer is not kept
    assert "selfcheck" not in _calibrate(model, verify=False).checks
