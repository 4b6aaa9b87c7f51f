"""bitsandbytes 4-bit / 8-bit base models: Fisher over the dequantized weights, from layer hooks."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("bitsandbytes")  # a declared test dependency; this only guards partial installs
import bitsandbytes as bnb  # noqa: E402

from fisher_select import plan_coverage, score_sums  # noqa: E402
from fisher_select.models import load_model  # noqa: E402
from fisher_select.engine.rules.bnb import BnbLinearRule  # noqa: E402
from tests.tiny import random_batch, tiny_model  # noqa: E402


def _quantized_child(child: torch.nn.Linear, kind: str):
    if kind in ("nf4", "fp4"):
        layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=torch.float32, quant_type=kind)
        layer.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type=kind)
    else:
        layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                    has_fp16_weights=False, threshold=0.0)
        layer.weight = bnb.nn.Int8Params(child.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
    if child.bias is not None:
        layer.bias = torch.nn.Parameter(child.bias.data.clone())
    return layer.to("cpu")  # quantizes the weight


def _dequantized(layer) -> torch.Tensor:
    w = layer.weight
    if isinstance(w, bnb.nn.Params4bit):
        return bnb.functional.dequantize_4bit(w.data, w.quant_state).float()
    return w.data.float() * w.SCB.float()[:, None] / 127.0


def quantize(model, kind):
    """(quantized model, fp32 model holding the dequantized weights)."""
    q, ref = copy.deepcopy(model), copy.deepcopy(model)
    for name, module in list(q.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and child_name != "lm_head":
                layer = _quantized_child(child, kind)
                setattr(module, child_name, layer)
                ref.get_submodule(f"{name}.{child_name}" if name else child_name).weight.data.copy_(_dequantized(layer))
    return q.eval(), ref.eval()


def rel(a, b):
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


@pytest.mark.parametrize("kind,tol", [("nf4", 1e-4), ("fp4", 1e-4), ("int8", 0.15)])
def test_quantized_fisher_matches_dequantized_fp32_model(kind, tol):
    """4-bit layers compute with the dequantized weight, so the Fisher agrees to fp32 precision;
    8-bit (LLM.int8) also quantizes activations, so agreement is at quantization level."""
    q, ref = quantize(tiny_model("qwen2-bias"), kind)
    ids, attn, resp, signal = random_batch()
    cov = plan_coverage(q)
    assert not cov.fallback
    assert isinstance(cov.users["model.layers.0.self_attn.q_proj.weight"][0].rule, BnbLinearRule)
    mine = score_sums(q, ids, attn, resp, signal, coverage=cov)
    want = score_sums(ref, ids, attn, resp, signal)
    for name, sq in want.squares.items():
        assert mine.squares[name].shape == sq.shape, name  # dequantized shape, not the packed one
        assert rel(mine.squares[name], sq) < tol, (name, rel(mine.squares[name], sq))
        assert rel(mine.signal[name], want.signal[name]) < tol, name


def test_load_model_in_4bit_and_calibrate(tmp_path, smol_tokenizer):
    """The whole path: transformers' BitsAndBytesConfig on CPU, then calibrate()."""
    from fisher_select.calibration.calibrator import calibrate
    from fisher_select.calibration.objectives import RLObjective
    from fisher_select.calibration.prompts import PromptRecord
    from tests.tiny import save_small_llama

    save_small_llama(tmp_path, smol_tokenizer)
    model, tokenizer, _ = load_model(str(tmp_path), quantization="nf4")
    layer = model.model.layers[0].mlp.up_proj
    assert isinstance(layer, bnb.nn.Linear4bit)
    records = [PromptRecord(0, "Say a number.", None, {}), PromptRecord(1, "Say a word.", None, {})]
    cal = calibrate(model, tokenizer, records, RLObjective(lambda r, t: float(len(t) % 2)), samples_per_prompt=2,
                    max_new_tokens=4, progress=False)
    fisher = cal.fisher["model.layers.0.mlp.up_proj.weight"]
    assert fisher.shape == (128, 64) and float(fisher.sum()) > 0

    # QLoRA: hints from the 4-bit run target the quantized layers, with the allocated ranks.
    import peft

    from fisher_select.models import fingerprint
    from fisher_select.outputs.lora import lora_config
    from fisher_select.report.build import build_report, write_run_with_pages
    from fisher_select.run.schema import ModelInfo

    report = build_report(cal, model=ModelInfo(str(tmp_path), fingerprint(model), str(tmp_path), "float32", "nf4",
                                            type(model).__name__),
                          recipe=None, recipe_name=None, sampling={}, settings={})
    assert {m.type for m in report.modules} >= {"Linear4bit"}
    write_run_with_pages(tmp_path / "run", cal, report, overwrite=False)
    config = lora_config(tmp_path / "run", top_n=3, total_rank=12, rank_step=2, model=model)
    adapted = peft.get_peft_model(model, config)
    lora_layers = {n: m for n, m in adapted.named_modules() if isinstance(m, peft.tuners.lora.bnb.Linear4bit)}
    assert len(lora_layers) == 3
    assert sum(m.lora_A["default"].weight.shape[0] for m in lora_layers.values()) == 12


def test_cpu_inference_repacking_is_prevented_and_refused():
    """bitsandbytes repacks 4-bit weights for CPU inference in eval mode (no backward, bf16 absmax)."""
    from fisher_select import FisherSelectError
    from fisher_select.engine.rules.bnb import keep_trainable_layout

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the CPU inference kernel needs row counts divisible by its block (64)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    q, _ = quantize(base.eval(), "nf4")
    ids, attn, resp, signal = random_batch()
    layer = q.model.layers[0].mlp.up_proj
    if not getattr(layer, "support_avx512bf16_for_cpu", False):
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks here")
    with torch.no_grad(), keep_trainable_layout(q):
        q(ids)
    assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
    score_sums(q, ids, attn, resp, signal)  # still differentiable
    with torch.no_grad():
        q(ids)  # plain eval-mode inference repacks
    assert layer.weight.quant_state.packing_format_for_cpu
    with pytest.raises(FisherSelectError, match="inference layout"):
        score_sums(q, ids, attn, resp, signal)
