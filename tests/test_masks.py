"""Masked full fine-tuning: masked coordinates stay bit-identical under AdamW with weight decay."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from fisher_select.errors import FisherSelectError
from fisher_select.outputs.masks import save_masks, select_masks
from fisher_select.training.callback import FisherMaskCallback
from fisher_select.training.enforce import apply_masks
from fisher_select.models import fingerprint
from fisher_select.run.load import Run
from tests import runs

FROZEN = "model.norm.weight"  # forced fully unselected
FREE = "model.layers.0.input_layernorm.weight"  # forced fully selected




def tiny_llama(seed: int = 0, layers: int = 2, tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def make_run(model, seed: int = 0) -> Run:
    """A run over ``model``'s parameters with a random Fisher and the model's real fingerprint."""
    gen = torch.Generator().manual_seed(seed)
    fisher = {n: torch.rand(p.shape, generator=gen) for n, p in model.named_parameters()}  # tied: once
    return runs.make_run(fisher, fingerprint=fingerprint(model), model_name="tiny-llama", run_id=f"run-{seed}")


def tiny_masks(model) -> dict[str, torch.Tensor]:
    masks = dict(select_masks(make_run(model), top=0.3).masks)
    masks[FROZEN] = torch.zeros_like(masks[FROZEN])
    masks[FREE] = torch.ones_like(masks[FREE])
    return masks


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(seed))


def train_steps(model, steps: int = 4, zero_masked: dict | None = None, check_grads: dict | None = None):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        if zero_masked is not None:  # control: gradient masking without the restore
            for n, p in model.named_parameters():
                p.grad.masked_fill_(~zero_masked[n], 0)
        if check_grads is not None:
            for n, p in model.named_parameters():
                if p.grad is not None:
                    assert not p.grad[~check_grads[n]].any(), f"{n}: masked gradient is not zero"
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()


def assert_masked_unchanged_selected_moved(model, before, masks):
    for name, p in model.named_parameters():
        mask = masks[name]
        assert torch.equal(p.detach()[~mask], before[name][~mask]), f"{name}: a masked coordinate moved"
        assert (p.detach()[mask] != before[name][mask]).all(), f"{name}: a selected coordinate did not move"


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_adamw_with_weight_decay_leaves_masked_coordinates_bit_identical(tied):
    model = tiny_llama(tied=tied)
    masks = tiny_masks(model)  # tied: one entry, model.embed_tokens.weight, also guards lm_head
    before = snapshot(model)
    handle = apply_masks(model, masks)
    try:
        assert FROZEN in handle.frozen and FREE in handle.free and len(handle.partial) > 10
        assert not model.get_parameter(FROZEN).requires_grad
        train_steps(model, check_grads=masks)
        assert_masked_unchanged_selected_moved(model, before, masks)
    finally:
        handle.remove()


def test_control_gradient_masking_alone_lets_weight_decay_move_masked_coordinates():
    # Shows the test above can fail: without the restore, masked coordinates move.
    model = tiny_llama()
    masks = tiny_masks(model)
    before = snapshot(model)
    train_steps(model, zero_masked=masks)
    name = "model.layers.1.mlp.up_proj.weight"
    moved = model.get_parameter(name).detach() != before[name]
    assert moved[~masks[name]].all()


def test_remove_undoes_hooks_and_freezing():
    model = tiny_llama()
    masks = tiny_masks(model)
    apply_masks(model, masks).remove()
    assert model.get_parameter(FROZEN).requires_grad
    before = snapshot(model)
    train_steps(model, steps=1)
    name = "model.layers.1.mlp.up_proj.weight"
    assert (model.get_parameter(name).detach() != before[name])[~masks[name]].all()


def test_mask_file_for_another_model_is_refused(tmp_path):
    model = tiny_llama(seed=0)
    path = save_masks(select_masks(make_run(model), top=0.3), tmp_path / "m.safetensors")
    with pytest.raises(FisherSelectError, match="different weights"):
        apply_masks(tiny_llama(seed=1), path)
    with pytest.raises(FisherSelectError, match="different parameter names or shapes"):
        apply_masks(tiny_llama(seed=0, layers=1), path)
    handle = apply_masks(model, path)  # the right model is accepted
    assert handle.partial
    handle.remove()


def test_mask_dict_with_wrong_names_or_shapes_is_refused():
    model = tiny_llama()
    masks = tiny_masks(model)
    with pytest.raises(FisherSelectError, match="does not have"):
        apply_masks(model, {**masks, "model.layers.7.mlp.up_proj.weight": masks[FREE]})
    with pytest.raises(FisherSelectError, match="computed for another model"):
        apply_masks(model, {**masks, FREE: torch.ones(3, dtype=torch.bool)})
    missing = dict(masks)
    del missing[FREE]
    with pytest.raises(FisherSelectError, match=f"no entry for trainable parameter {FREE}"):
        apply_masks(model, missing)
    assert all(p.requires_grad for p in model.parameters())  # nothing applied on error


def test_trainer_callback_keeps_masked_coordinates(tmp_path):
    model = tiny_llama()
    masks = tiny_masks(model)
    before = snapshot(model)
    data = [{"input_ids": batch(i)[0], "labels": batch(i)[0]} for i in range(16)]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
        weight_decay=0.1, max_grad_norm=1.0, report_to=[], use_cpu=True, save_strategy="no",
        logging_strategy="no", disable_tqdm=True,
    )
    callback = FisherMaskCallback(masks)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    assert_masked_unchanged_selected_moved(model, before, masks)
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert id(model.get_parameter(FROZEN)) not in in_optimizer  # frozen before optimizer creation
    assert callback.handle is None and model.get_parameter(FROZEN).requires_grad  # removed at train end
