"""TRL end to end: ``FisherMaskCallback`` and LoRA hints inside TRL's GRPOTrainer and SFTTrainer.

A tiny Llama (built from a config) with a word-level tokenizer, a few optimizer steps of TRL's
default AdamW with weight decay on CPU: masked coordinates must be bit-identical afterwards and
every selected coordinate must have moved; a LoRA config from ``lora_config`` goes in through
``peft_config=`` and its adapters train while the base weights stay put.
"""

from __future__ import annotations

import re

import peft
import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from fisher_select.models import fingerprint
from fisher_select.outputs.lora import lora_config, lora_hints
from fisher_select.outputs.masks import save_masks, select_masks
from fisher_select.training.callback import FisherMaskCallback
from tests import runs

VOCAB = 64
FROZEN = "model.norm.weight"  # forced fully unselected: frozen before the optimizer exists
FREE = "model.layers.0.input_layernorm.weight"  # forced fully selected


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level: "w3 w9" -> two tokens; EOS and pad distinct (TRL pads with pad, stops on EOS)."""
    words = ["<unk>", "</s>", "<pad>"] + [f"w{i}" for i in range(VOCAB - 3)]
    backend = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", pad_token="<pad>")


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                         eos_token_id=1, pad_token_id=2, bos_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # no exact zeros (the pad row): weight decay then moves every free coordinate
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def tiny_run(model):
    gen = torch.Generator().manual_seed(0)
    fisher = {n: torch.rand(p.shape, generator=gen) * 10 ** (3 * torch.rand(1, generator=gen).item())
              for n, p in model.named_parameters()}
    return runs.make_run(fisher, fingerprint=fingerprint(model), model_name="tiny-llama", run_id="run-trl")


def mask_file(model, tmp_path):
    """A fingerprinted mask file (top 30% of each parameter) with one parameter fully masked, one free."""
    maskset = select_masks(tiny_run(model), top=0.3, per_module=True)
    maskset.masks[FROZEN] = torch.zeros_like(maskset.masks[FROZEN])
    maskset.masks[FREE] = torch.ones_like(maskset.masks[FREE])
    return save_masks(maskset, tmp_path / "masks.safetensors"), maskset.masks


def prompts(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"w{3 + i} w{4 + i} w{5 + i}"} for i in range(n)])


def demonstrations(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"w{3 + i} w{4 + i}", "completion": f" w{5 + i} w{6 + i}"}
                              for i in range(n)])


def mean_word_index(prompts, completions, **kwargs) -> list[float]:
    """A reward that varies within every group of sampled completions (so advantages are non-zero)."""
    return [sum(int(w) for w in re.findall(r"w(\d+)", c)) / max(1, len(c.split())) for c in completions]


def common_args(tmp_path, checkpointing: bool = False) -> dict:
    # TRL defaults to bf16 (not on CPU) and gradient checkpointing (slower; tested once below, as
    # recomputation re-runs the forward). AdamW (TRL's default optimizer) with weight decay is
    # what moves coordinates without a gradient.
    return dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, gradient_checkpointing=checkpointing,
                max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, weight_decay=0.1,
                logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=0)


def grpo_trainer(model, tmp_path, checkpointing=False, **kwargs) -> GRPOTrainer:
    # per_device_train_batch_size (4) must be a multiple of num_generations (4): one prompt group per step.
    args = GRPOConfig(**common_args(tmp_path, checkpointing), num_generations=4, max_completion_length=8)
    return GRPOTrainer(model=model, reward_funcs=mean_word_index, args=args, train_dataset=prompts(),
                       processing_class=word_tokenizer(), **kwargs)


def sft_trainer(model, tmp_path, checkpointing=False, **kwargs) -> SFTTrainer:
    args = SFTConfig(**common_args(tmp_path, checkpointing), max_length=16)
    return SFTTrainer(model=model, args=args, train_dataset=demonstrations(), processing_class=word_tokenizer(),
                      **kwargs)


BUILDERS = {"grpo": grpo_trainer, "sft": sft_trainer}


def gradient_steps(trainer) -> list[float]:
    """Gradient norms of the logged steps: proof that the steps carried a gradient, not only decay."""
    return [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_mask_callback_keeps_masked_coordinates_bit_identical_in_trl(kind, checkpointing, tmp_path):
    model = tiny_llama()
    path, masks = mask_file(model, tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    callback = FisherMaskCallback(path)  # a file: fingerprint-checked against the trainer's model
    trainer = BUILDERS[kind](model, tmp_path, checkpointing, callbacks=[callback])
    assert not model.get_parameter(FROZEN).requires_grad  # applied at the end of Trainer.__init__
    trainer.train()

    assert trainer.state.global_step == 3
    assert any(g > 0 for g in gradient_steps(trainer)), "no step had a gradient"
    partial = 0
    for name, p in model.named_parameters():
        mask = masks[name]
        assert torch.equal(p.detach()[~mask], before[name][~mask]), f"{kind}: a masked coordinate of {name} moved"
        assert (p.detach()[mask] != before[name][mask]).all(), f"{kind}: a selected coordinate of {name} did not move"
        partial += bool(mask.any()) and not bool(mask.all())
    assert partial == len(masks) - 2  # all others partly selected: the restore hook did the work
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert id(model.get_parameter(FROZEN)) not in in_optimizer
    assert callback.handle is None and model.get_parameter(FROZEN).requires_grad  # undone at train end


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_lora_hint_goes_through_peft_config_and_trains(kind, tmp_path):
    model = tiny_llama()
    run = tiny_run(model)
    kwargs = dict(top_n=5, total_rank=24, rank_step=2, min_rank=2)
    hints = lora_hints(run, model=model, **kwargs)
    ranks = hints.ranks
    assert len(set(ranks.values())) > 1  # per-module ranks, so rank_pattern must be honoured
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = BUILDERS[kind](model, tmp_path, peft_config=lora_config(run, **kwargs))
    assert isinstance(trainer.model, peft.PeftModel)
    adapted = {n: m for n, m in trainer.model.get_base_model().named_modules() if getattr(m, "lora_A", None)}
    assert set(adapted) == set(ranks)
    for name, layer in adapted.items():
        assert layer.lora_A["default"].weight.shape[0] == ranks[name]
    trainer.train()

    assert any(g > 0 for g in gradient_steps(trainer)), "no step had a gradient"
    for name, layer in adapted.items():  # lora_B starts at zero: non-zero means the adapter trained
        assert layer.lora_B["default"].weight.abs().sum() > 0, f"{kind}: adapter of {name} did not train"
    for name, p in trainer.model.get_base_model().named_parameters():
        if "lora_" not in name:
            original = name.replace(".base_layer", "")
            assert torch.equal(p.detach(), base[original]), f"{kind}: base weight {name} moved"


def test_example_reward_is_the_recipe_reward_on_chat_and_plain_completions():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "grpo_with_mask.py"
    spec = importlib.util.spec_from_file_location("grpo_with_mask", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    reward = example.arithmetic_reward()
    completions = [[{"role": "assistant", "content": "Ann has 14 stamps"}], "13", [{"role": "assistant", "content": "7?"}]]
    assert reward(prompts=[None] * 3, completions=completions, answer=[14, 13, 3]) == [1.0, 1.0, 0.0]
    assert example.parse_args([]).top == 0.05
