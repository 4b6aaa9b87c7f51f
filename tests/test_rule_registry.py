"""The rule registry answers the layer questions the rest of the package asks: which modules are
Linear-like (LoRA targets), a parameter's logical shape (packed 4-bit weights), which modules are
the input embeddings / output head, and the guards that keep layers differentiable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fisher_select import FisherSelectError, plan_coverage
from fisher_select.engine import rules
from fisher_select.models import fingerprint
from fisher_select.outputs.lora import lora_hints
from tests import runs
from tests.tiny import tiny_model


@pytest.mark.parametrize("name", ["llama-tied", "llama-untied", "gpt2"])
def test_layer_questions_on_tiny_models(name):
    model = tiny_model(name)
    linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    conv1d = {n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    assert {n for n, m in model.named_modules() if rules.is_linear_like(m)} == linear | conv1d
    assert bool(conv1d) == (name == "gpt2")
    assert rules.parameter_shapes(model) == {n: tuple(p.shape) for n, p in model.named_parameters()}
    heads = rules.embeddings_and_heads(model)
    assert heads == [model.get_input_embeddings(), model.get_output_embeddings()]


def _quantized_llama():
    pytest.importorskip("bitsandbytes")
    from tests.test_bnb import quantize

    plain = tiny_model("llama-untied")
    q, _ = quantize(plain, "nf4")
    return plain, q


def test_layer_questions_on_a_4bit_model():
    import bitsandbytes as bnb

    plain, q = _quantized_llama()
    layer = q.model.layers[0].self_attn.q_proj
    assert isinstance(layer, bnb.nn.Linear4bit) and layer.weight.shape != (16, 16)  # stored packed
    assert rules.is_linear_like(layer)
    assert rules.fisher_shape(layer, "weight", layer.weight) == (16, 16)  # (out, in)
    assert rules.parameter_shapes(q) == {n: tuple(p.shape) for n, p in plain.named_parameters()}
    assert {n for n, m in q.named_modules() if rules.is_linear_like(m)} == \
        {n for n, m in plain.named_modules() if isinstance(m, nn.Linear)}
    assert plan_coverage(q).shapes == plan_coverage(plain).shapes
    assert fingerprint(q)["parameters_sha256"] == fingerprint(plain)["parameters_sha256"]


def test_4bit_guard_keeps_layers_training_and_check_refuses_repacked_weights():
    plain, q = _quantized_llama()
    layer = q.model.layers[0].mlp.up_proj
    assert not layer.training
    with rules.guard_model(q):
        assert layer.training and not q.model.layers[0].mlp.training  # only the 4-bit layers
    assert not layer.training
    rules.check_model(q)
    # What bitsandbytes' CPU inference path records after repacking (only on AVX512-BF16 CPUs):
    layer.weight.quant_state.packing_format_for_cpu = True
    with pytest.raises(FisherSelectError, match="inference layout"):
        rules.check_model(q)
    rules.check_model(plain)  # no rule of a plain model refuses anything


class RenamedLM(nn.Module):
    """A causal LM whose embedding and head have names no name pattern would recognise."""

    def __init__(self, vocab=32, d=8):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)
        self.readout = nn.Linear(d, vocab)

    def get_input_embeddings(self):
        return self.tokens

    def get_output_embeddings(self):
        return self.readout

    def forward(self, input_ids, **kwargs):
        return self.readout(self.gate(torch.tanh(self.mix(self.tokens(input_ids)))))


def test_lora_targets_come_from_the_rules_with_or_without_the_model():
    torch.manual_seed(0)
    model = RenamedLM()
    cov = plan_coverage(model)
    assert cov.embeddings == ["tokens", "readout"] and cov.linear_like == ["mix", "gate", "readout"]
    fisher = {n: torch.rand(p.shape) for n, p in model.named_parameters()}
    run = runs.make_run(fisher, fingerprint=fingerprint(model))
    run.report.coverage = cov.summary()  # as calibrate() records it
    for given in (model, None):
        hints = lora_hints(run, coverage=1.0, total_rank=8, rank_step=4, model=given)
        assert sorted(hints.target_modules) == ["gate", "mix"], given
