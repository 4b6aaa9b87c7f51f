"""The model families users fine-tune, each exact against the float64 per-sample loop in every mode.

One table, one entry per family: a tiny model built from its config object (no network; 2 layers,
hidden 16) and the rule every parameter-holding module class gets (the coverage table of
docs/ENGINE.md). For each family: the coverage is exactly that table, nothing is on the exact
fallback unless the entry names it, the self-check passes (fp32 and bf16), and ``score_sums`` in float64 equals
``engine.reference.per_sample_scores`` (each row alone, unpadded, one backward) at relative error
1e-10 (1e-6 for Gemma, whose norms compute in float32 inside a float64 model) on a batch with left-padded rows
(Gemma 2: float64 without padding, see ``GEMMA2_FLOAT64_NAN``; the fp32 self-check has padded rows), in each accumulator mode as calibrate runs it (``full``,
``gradient``, ``fisher``), in the squares-free one-signal pass (the rules' ``weighted_sum``), each
with all parameters and with a ``params`` subset. MoE families are more entries of ``FAMILIES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import transformers as tf
from torch import nn

from fisher_select import plan_coverage, score_sums
from fisher_select.engine import rules
from fisher_select.engine.reference import per_sample_scores
from fisher_select.engine.selfcheck import FALLBACK, check_rules
from tests.rule_checks import EXACT, rel
from tests.tiny import random_batch

VOCAB = 64
# Small enough for seconds per family; GQA (one key/value head), 2 layers, ids 1 = EOS = padding.
COMMON = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=8, eos_token_id=1, bos_token_id=None, pad_token_id=1)


@dataclass(frozen=True)
class Family:
    build: Callable[[], nn.Module]  # the tiny model, random weights
    rules: dict[str, str]  # class of each module holding parameters -> its rule (or "fallback")
    fallback: frozenset[str] = field(default_factory=frozenset)  # parameters deliberately on the fallback
    tolerance: float = EXACT  # float64 engine vs float64 loop: only summation order differs
    padded: bool = True  # left-padded rows in the float64 batch (the fp32 self-check always has them)


# Gemma's RMSNorm computes in float32 even in a float64 model (``x.float()``), so a padded batch and a row
# alone round differently there (well inside 1e-6 here); with that cast removed they agree to 1e-10.
GEMMA_FP32_NORM = 1e-6
# Gemma 2's eager attention (the only one it allows) takes its softmax in float32: a float64 model's mask
# value (float64 min) becomes -inf there, a padded position's all-masked row gives NaN, and the NaN reaches
# real positions through the next layer's values (0 * NaN). Float64 only: fp32 and bf16 models are finite.
GEMMA2_FLOAT64_NAN = False


def _causal(config_cls, model_cls, **overrides):
    return lambda: model_cls(config_cls(**{**COMMON, **overrides}))


def _rms(norm: str) -> dict[str, str]:
    return {"Embedding": "EmbeddingRule", "Linear": "LinearRule", norm: "FunctionalNormRule"}


def _scaled(prefix: str) -> dict[str, str]:
    return {f"{prefix}TextScaledWordEmbedding": "ScaledEmbeddingRule", "Linear": "LinearRule",
            f"{prefix}RMSNorm": "FunctionalNormRule"}


FAMILIES = {
    "llama": Family(_causal(tf.LlamaConfig, tf.LlamaForCausalLM, tie_word_embeddings=True), _rms("LlamaRMSNorm")),
    "qwen2": Family(_causal(tf.Qwen2Config, tf.Qwen2ForCausalLM, tie_word_embeddings=False), _rms("Qwen2RMSNorm")),
    "qwen3": Family(_causal(tf.Qwen3Config, tf.Qwen3ForCausalLM), _rms("Qwen3RMSNorm")),  # q/k norms per head
    "gemma": Family(_causal(tf.GemmaConfig, tf.GemmaForCausalLM), _scaled("Gemma"), tolerance=GEMMA_FP32_NORM),
    "gemma2": Family(_causal(tf.Gemma2Config, tf.Gemma2ForCausalLM, sliding_window=4), _scaled("Gemma2"),
                     tolerance=GEMMA_FP32_NORM, padded=GEMMA2_FLOAT64_NAN),
    "gemma3": Family(_causal(tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, sliding_window=4,
                             layer_types=["sliding_attention", "full_attention"]), _scaled("Gemma3"),
                     tolerance=GEMMA_FP32_NORM),
    "mistral": Family(_causal(tf.MistralConfig, tf.MistralForCausalLM, sliding_window=4), _rms("MistralRMSNorm")),
    "phi3": Family(_causal(tf.Phi3Config, tf.Phi3ForCausalLM), _rms("Phi3RMSNorm")),  # fused qkv and gate_up
    "gpt2": Family(lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2,
                                                            n_positions=64, eos_token_id=1, bos_token_id=1,
                                                            pad_token_id=1)),
                   {"Embedding": "EmbeddingRule", "Conv1D": "Conv1DRule", "LayerNorm": "LayerNormRule",
                    "Linear": "LinearRule"}),
    "gpt-neox": Family(lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        eos_token_id=1, bos_token_id=1, pad_token_id=1)),
        {"Embedding": "EmbeddingRule", "Linear": "LinearRule", "LayerNorm": "LayerNormRule"}),
    "olmo2": Family(_causal(tf.Olmo2Config, tf.Olmo2ForCausalLM), _rms("Olmo2RMSNorm")),  # q/k norms over all heads
}

# How calibrate runs each accumulator mode (engine.memory.MemoryMode) with two objectives' signal rows,
# and the squares-free pass with one signal: kwargs of score_sums, and whether a signal is passed.
MODES = {
    "full": (dict(squares=True, totals=True), "two"),
    "gradient": (dict(squares=True, totals=False), "two"),
    "fisher": (dict(squares=True, totals=False), None),
    "signal-only": (dict(squares=False, totals=False), "one"),  # Rule.weighted_sum: one GEMM per layer
}


def tiny_family(name: str, seed: int = 0) -> nn.Module:
    """The family's tiny model in float64, eval mode, weights perturbed so no gradient is trivially zero."""
    torch.manual_seed(seed)
    model = FAMILIES[name].build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


_CACHE: dict[str, tuple] = {}


def _family_reference(name: str):
    """(float64 model, batch, signal (2, B), per-sample gradients), built once per family."""
    if name not in _CACHE:
        model = tiny_family(name).double()
        padding = {} if FAMILIES[name].padded else {"pad_rows": ()}
        ids, attn, resp, signal = random_batch(vocab=VOCAB, **padding)  # rows 1 and 2 left padded
        assert attn.all() != FAMILIES[name].padded
        signals = torch.stack([signal, signal.flip(0) * 2 - 1])  # (2, B): two objectives
        _CACHE[name] = (model, (ids, attn, resp), signals, per_sample_scores(model, ids, attn, resp))
    return _CACHE[name]


def _subset(model: nn.Module) -> set[str]:
    """Every other parameter, so each kind of layer is in and out of the subset somewhere."""
    return {n for i, (n, _) in enumerate(model.named_parameters()) if i % 2 == 0}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_coverage_is_the_table_and_nothing_falls_back_by_accident(name):
    model = tiny_family(name)
    got = {}
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            rule = rules.lookup(module)
            got[type(module).__name__] = FALLBACK if rule is None else type(rule).__name__
    assert got == FAMILIES[name].rules
    assert set(plan_coverage(model).fallback) == FAMILIES[name].fallback


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_self_check_passes(name, dtype):
    model = tiny_family(name).to(dtype)
    ids, attn, resp, signal = random_batch(vocab=VOCAB)
    got = check_rules(model, ids, attn, resp, rows=2, signal=signal)
    assert got["parameters"] == len(plan_coverage(model).users) and got["max_relative_error"] <= got["tolerance"]


@pytest.mark.parametrize("subset", [False, True], ids=["all", "params-subset"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_exact_in_float64_in_every_mode(name, mode, subset):
    model, batch, signals, scores = _family_reference(name)
    kwargs, signal_rows = MODES[mode]
    signal = {None: None, "two": signals, "one": signals[0]}[signal_rows]
    params = _subset(model) if subset else None
    sums = score_sums(model, *batch, signal, params=params, accumulate_dtype=torch.float64, **kwargs)
    names = params if subset else {n for n, _ in model.named_parameters()}
    want = {
        "squares": {n: sum(s[n] ** 2 for s in scores) for n in names} if kwargs["squares"] else None,
        "total": {n: sum(s[n] for s in scores) for n in names} if kwargs["totals"] else None,
    }
    if signal is not None:
        rows = signal.reshape(-1, signal.shape[-1])  # (O, B)
        per_row = [{n: sum(float(a) * s[n] for a, s in zip(row, scores)) for n in names} for row in rows]
        want["signal"] = per_row[0] if signal.dim() == 1 else {n: torch.stack([r[n] for r in per_row]) for n in names}
    else:
        want["signal"] = None
    for kind, expected in want.items():
        got = getattr(sums, kind)
        if expected is None:
            assert got is None, kind
            continue
        assert set(got) == names, kind
        for n, value in expected.items():
            assert got[n].dtype == torch.float64 and got[n].shape == value.shape, (kind, n)
            assert rel(got[n], value) <= FAMILIES[name].tolerance, (kind, n, rel(got[n], value))
