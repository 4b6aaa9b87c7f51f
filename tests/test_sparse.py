"""Sparse-delta fine-tuning: the same steps as dense masked fine-tuning, state for the selected coordinates only."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import Trainer, TrainingArguments

from fisher_select.errors import FisherSelectError
from fisher_select.outputs.masks import select_masks
from fisher_select.training.callback import FisherMaskCallback
from fisher_select.training.enforce import apply_masks
from fisher_select.training.sparse import SparseDeltaHandle, empty_delta, load_sparse_delta, read_sparse_delta
from fisher_select.run.names import SPARSE_DELTA_FILE, SPARSE_META_FILE
from tests.test_masks import FROZEN, batch, make_run, snapshot, tiny_llama, tiny_masks


def adamw_steps(model, params, steps: int = 4, micro: int = 1) -> list[float]:
    """AdamW (weight decay 0.1) with clipping at 0.05 (so it clips); returns the norms clipping saw."""
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    norms = []
    for step in range(steps):
        ids = batch(step)
        for part in ids.chunk(micro):  # gradient accumulation over micro-batches
            (model(input_ids=part, labels=part).loss / micro).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.05)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def state_numels(optimizer) -> list[int]:
    return [t.numel() for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim()]


def outputs(model, seed: int = 9) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch(seed)).logits


@pytest.mark.parametrize("micro", [1, 2], ids=["one-batch", "accumulated"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sparse_and_dense_take_the_same_adamw_steps(tied, micro):
    dense, sparse = tiny_llama(tied=tied), tiny_llama(tied=tied)
    masks = tiny_masks(dense)
    before = snapshot(dense)
    dense_handle = apply_masks(dense, masks)
    handle = apply_masks(sparse, masks, sparse=True)
    assert isinstance(handle, SparseDeltaHandle) and FROZEN in handle.frozen
    dense_norms = adamw_steps(dense, trainable(dense), micro=micro)
    sparse_norms = adamw_steps(sparse, handle.parameters(), micro=micro)
    dense_handle.remove()
    handle.merge()

    torch.testing.assert_close(sparse_norms, dense_norms, rtol=1e-5, atol=0)  # clipping saw the same norm
    assert all(n > 0.05 for n in dense_norms)  # ... and clipped
    got, want = dict(sparse.named_parameters()), dict(dense.named_parameters())
    assert set(got) == set(want)  # merge removed the values from the model
    for name, mask in masks.items():
        torch.testing.assert_close(got[name].detach()[mask], want[name].detach()[mask], rtol=1e-5, atol=1e-6)
        assert torch.equal(got[name].detach()[~mask], before[name][~mask]), f"{name}: unselected moved"
        assert (got[name].detach()[mask] != before[name][mask]).all(), f"{name}: a selected coordinate stayed"


def test_gradients_and_optimizer_state_exist_for_the_selected_coordinates_only():
    model = tiny_llama()
    masks = tiny_masks(model)
    handle = apply_masks(model, masks, sparse=True)
    seen = []  # dense gradients alive when each parameter's hook ran
    for e in handle.entries:
        e.param.register_post_accumulate_grad_hook(
            lambda p: seen.append(sum(q.grad is not None for q in model.parameters() if q.dim() > 1)))
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2, weight_decay=0.1)  # as Trainer: all requires_grad
    model(input_ids=batch(0), labels=batch(0)).loss.backward()
    assert max(seen) <= 1  # a dense gradient lives for one layer at a time
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(".sparse_values." in n for n in grads)  # no dense .grad left
    assert all(g.dtype == torch.float32 and g.dim() == 1 for g in grads.values())
    optimizer.step()
    for e in handle.entries:
        state = optimizer.state[e.values]
        assert state["exp_avg"].shape == state["exp_avg_sq"].shape == (e.indices.numel(),)
        assert e.indices.dtype == torch.int32 and e.indices.numel() == int(masks[e.name].sum())
        assert e.param not in optimizer.state
    assert max(state_numels(optimizer)) <= max(int(m.sum()) for m in masks.values())
    assert sum(state_numels(optimizer)) == 2 * handle.selected
    handle.merge()


def test_save_load_merge_round_trips_and_a_modified_model_is_refused(tmp_path):
    base = tiny_llama()
    model = copy.deepcopy(base)
    masks = tiny_masks(model)
    handle = apply_masks(model, masks, sparse=True)
    adamw_steps(model, handle.parameters(), steps=3)
    trained = outputs(model)
    out = handle.save(tmp_path / "delta")
    meta = json.loads((out / SPARSE_META_FILE).read_text())
    assert meta["selected"] == handle.selected and meta["base_model"]["fingerprint"]["id"]
    stored, _ = read_sparse_delta(out)  # only indices (int32) and fp32 deltas of the selected coordinates
    assert sum(i.numel() for i, _ in stored.values()) == sum(d.numel() for _, d in stored.values()) == handle.selected
    assert {(i.dtype, d.dtype) for i, d in stored.values()} == {(torch.int32, torch.float32)}
    assert set(stored) == set(masks) - {FROZEN} and (out / SPARSE_DELTA_FILE).is_file()

    fresh = copy.deepcopy(base)
    loaded = load_sparse_delta(fresh, out)
    torch.testing.assert_close(outputs(fresh), trained, rtol=1e-6, atol=1e-6)
    for a, b in zip(loaded.entries, handle.entries):
        assert torch.equal(a.indices, b.indices)
        torch.testing.assert_close(a.values, b.values, rtol=1e-7, atol=1e-8)  # base + delta: within an fp32 ulp
    loaded.merge()
    rounding = handle.merge()
    assert rounding["moved"] == handle.selected and rounding["lost"] == 0  # fp32 weights keep every delta
    assert not any("sparse_values" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(outputs(model), trained, rtol=1e-6, atol=1e-6)
    handle.save(tmp_path / "after-merge")  # the handle keeps the fp32 values

    modified = copy.deepcopy(base)
    with torch.no_grad():
        modified.get_parameter("model.layers.1.mlp.up_proj.weight")[0, 0] += 1.0
    with pytest.raises(FisherSelectError, match="model.layers.1.mlp.up_proj.weight"):
        load_sparse_delta(modified, out)
    with pytest.raises(FisherSelectError, match="different parameter names or shapes"):
        load_sparse_delta(tiny_llama(layers=1), out)


def test_bf16_base_keeps_fp32_values_and_reports_what_merging_loses(tmp_path):
    model = tiny_llama().to(torch.bfloat16)
    masks = tiny_masks(model)
    before = snapshot(model)
    handle = apply_masks(model, masks, sparse=True)
    assert all(e.values.dtype == torch.float32 and e.param.dtype == torch.bfloat16 for e in handle.entries)
    optimizer = torch.optim.AdamW(handle.parameters(), lr=1e-5, weight_decay=0.0)  # small steps: some are lost
    for step in range(2):
        model(input_ids=batch(step), labels=batch(step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(s.dtype == torch.float32 for st in optimizer.state.values() for s in st.values() if s.dim())
    deltas = handle.deltas()
    rounding = handle.merge()
    assert 0 < rounding["lost"] < rounding["moved"] and 0 < rounding["bf16_lost_share"] < 1
    for e in handle.entries:
        weight = e.param.detach().reshape(-1)
        assert torch.equal(weight[e.indices.long()], e.values.detach().bfloat16())
        assert deltas[e.name][1].dtype == torch.float32
    for name, mask in masks.items():
        assert torch.equal(model.get_parameter(name).detach().float()[~mask], before[name][~mask])
    saved = json.loads((handle.save(tmp_path / "d") / SPARSE_META_FILE).read_text())
    assert saved["rounding"]["lost"] == rounding["lost"]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_gives_the_same_steps(reentrant):
    plain, checkpointed = tiny_llama(), tiny_llama()
    masks = tiny_masks(plain)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    checkpointed.train()
    plain.train()  # the same mode in both (dropout is 0 in this config)
    results = []
    for model in (plain, checkpointed):
        handle = apply_masks(model, masks, sparse=True)
        results.append(adamw_steps(model, handle.parameters(), steps=2))
        handle.merge()
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=0)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def trainer_args(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                             weight_decay=0.1, max_grad_norm=0.05, report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, seed=0, **kwargs)


def test_trainer_with_the_sparse_callback_matches_the_dense_one(tmp_path):
    data = [{"input_ids": batch(i)[0], "labels": batch(i)[0]} for i in range(12)]
    results = {}
    for sparse in (False, True):
        model = tiny_llama()
        masks = tiny_masks(model)
        before = snapshot(model)
        callback = FisherMaskCallback(masks, sparse=sparse)
        trainer = Trainer(model=model, args=trainer_args(tmp_path), train_dataset=data, callbacks=[callback])
        trainer.train()
        results[sparse] = dict(model.named_parameters())
        if sparse:
            held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
            assert {id(p) for p in callback.last_handle.parameters()} <= held
            assert max(state_numels(trainer.optimizer)) <= max(int(m.sum()) for m in masks.values())
            assert callback.handle is None and callback.last_handle.merged
    for name, mask in masks.items():
        torch.testing.assert_close(results[True][name][mask], results[False][name][mask], rtol=1e-5, atol=1e-6)
        assert torch.equal(results[True][name].detach()[~mask], before[name][~mask])


def test_sparse_callback_added_after_the_optimizer_exists_is_refused(tmp_path):
    model = tiny_llama()
    data = [{"input_ids": batch(i)[0], "labels": batch(i)[0]} for i in range(12)]
    trainer = Trainer(model=model, args=trainer_args(tmp_path), train_dataset=data)
    trainer.create_optimizer()
    trainer.add_callback(FisherMaskCallback(tiny_masks(model), sparse=True))
    with pytest.raises(FisherSelectError, match="Trainer's constructor"):
        trainer.train()


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_trl_trainers_train_the_selected_coordinates_sparsely(kind, tmp_path):
    from tests.test_trl import BUILDERS, gradient_steps, mask_file
    from tests.test_trl import tiny_llama as trl_llama

    model = trl_llama()
    path, masks = mask_file(model, tmp_path)
    before = snapshot(model)
    callback = FisherMaskCallback(path, sparse=True)
    trainer = BUILDERS[kind](model, tmp_path, callbacks=[callback])
    trainer.train()
    assert any(g > 0 for g in gradient_steps(trainer))
    assert max(state_numels(trainer.optimizer)) <= max(int(m.sum()) for m in masks.values())
    for name, p in model.named_parameters():
        mask = masks[name]
        assert torch.equal(p.detach()[~mask], before[name][~mask]), f"{kind}: unselected {name} moved"
        assert (p.detach()[mask] != before[name][mask]).all(), f"{kind}: selected {name} did not move"


def test_an_exported_empty_delta_starts_sparse_training_on_the_mask(tmp_path):
    model = tiny_llama()
    maskset = select_masks(make_run(model), top=0.05)
    out = empty_delta(maskset, tmp_path / "start")
    reference, before = outputs(model), snapshot(model)
    handle = load_sparse_delta(model, out)
    torch.testing.assert_close(outputs(model), reference, rtol=0, atol=0)  # zero deltas: the base model
    assert handle.selected == maskset.selected and handle.provenance["masks"]["run_id"] == "run-0"
    adamw_steps(model, handle.parameters(), steps=1)
    handle.merge()
    for name, mask in maskset.masks.items():
        moved = model.get_parameter(name).detach() != before[name]
        assert torch.equal(moved, mask), f"{name}: moved where the mask is not"


def test_casting_the_model_during_sparse_training_is_refused():
    model = tiny_llama()
    handle = apply_masks(model, tiny_masks(model), sparse=True)
    model.to(torch.float64)  # casts the fp32 values too
    with pytest.raises(FisherSelectError, match="cast the model before"):
        handle.merge()
    assert handle.merged and not handle._hooks  # detached all the same: no global hook left behind


def test_public_names_and_the_validate_flag():
    import fisher_select
    from fisher_select.cli import build_parser

    assert fisher_select.sparse_fine_tune and fisher_select.load_sparse_delta and fisher_select.SparseDeltaHandle
    argv = ["validate", "RUN", "--steps", "1", "--lr", "1e-3", "--sparse-masks"]
    args = build_parser(argv).parse_args(argv)
    assert args.sparse_masks
