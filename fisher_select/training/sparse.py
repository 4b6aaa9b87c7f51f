"""Sparse-delta fine-tuning: train the selected coordinates only, with memory for them alone.

Dense masked fine-tuning (``apply_masks``) keeps a dense ``.grad`` and two dense AdamW moments for
every tensor that holds a selected coordinate; at a 1% global mask that is almost every tensor,
so it costs more than full fine-tuning. Here, for each parameter with selected coordinates:

- ``indices``: the flat (row-major) indices of the selected coordinates, 1-D, int32 where the
  tensor has fewer than 2^31 entries (else int64), on the parameter's device;
- ``values``: a trainable 1-D **fp32** ``nn.Parameter`` holding the selected coordinates' current
  values (``W0[indices]`` at the start). The optimizer sees only these, so its state is the
  selected count per moment;
- ``base``: ``W0[indices]`` in the weight's dtype, so the delta ``values - base`` can be saved.

How the forward sees ``W + scatter(delta)``: the selected coordinates of the weight tensor itself
are overwritten with ``values`` (rounded to the weight's dtype) after every optimizer step (an
optimizer step post-hook, as ``apply_masks``). Autograd then differentiates the weight exactly,
and a post-accumulate-grad hook on the weight gathers ``grad[indices]`` into ``values.grad``
(fp32) and drops the weight's dense gradient at once: a dense gradient exists for one layer at a
time, transiently, inside the backward. Why not ``torch.nn.utils.parametrize``: its output
``W + scatter(delta)`` is a new dense tensor per layer, and every Linear saves its weight for the
backward, so a parametrization holds a dense copy of every weight until the backward ends.

Why ``values`` holds the coordinates and not the delta: AdamW's decoupled weight decay then acts
on the same numbers as in dense masked fine-tuning (``W_i``, not ``W_i - W0_i``), so the two modes
take identical steps (tests/test_sparse.py). The saved file holds the fp32 delta ``values - base``.

The base weights get no optimizer update and no optimizer state; they keep ``requires_grad=True``
only so that autograd computes their (immediately dropped) gradient. ``values`` live in a
``SparseValues`` child of each owning module (``<module>.sparse_values.<weight|bias>``), so
``Trainer`` (which builds its optimizer from ``model.named_parameters()``) finds them; that child
is left out of ``state_dict()``, so a checkpoint written during training is the model with the
current values rounded into its weights. Resuming a Trainer checkpoint does not restore the fp32
values: save and load the delta (``handle.save`` / ``load_sparse_delta``) instead.

bf16 / fp16 weights: the forward sees ``values`` rounded to the weight's dtype, but the fp32
``values`` accumulate every update, so small steps are not lost across steps. ``merge()`` leaves
the rounded values in the weights and reports the share of moved coordinates whose whole delta
the rounding lost (``bf16_lost_share``, as ``validate``); the saved fp32 delta stays the truth.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fisher_select.atomic import write_dir
from fisher_select.errors import FisherSelectError
from fisher_select.models import check_fingerprint, fingerprint
from fisher_select.run.io import save_tensors, write_json
from fisher_select.run.names import SPARSE_DELTA_FILE, SPARSE_FORMAT, SPARSE_META_FILE

ATTR = "sparse_values"  # the child module of an owning module that holds its values
META_KEY = "fisher_select"
CAVEAT = ("a sparse delta applies to the exact base model it was trained from (checked by fingerprint); "
          "merged into bf16/fp16 weights, deltas below half the weight's spacing are rounded away")


class SparseValues(nn.ParameterDict):
    """The fp32 values of one module's selected coordinates, keyed by parameter ("weight", "bias").

    Left out of ``state_dict`` (save and load): the model's own weights carry the current values.
    """

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass

    def _load_from_state_dict(self, *args, **kwargs):
        pass


@dataclass
class _Entry:
    """One parameter trained sparsely."""

    name: str
    param: nn.Parameter  # the base weight (its dtype), selected coordinates overwritten with values
    indices: torch.Tensor  # (k,) int32/int64 flat indices, sorted, on the parameter's device
    values: nn.Parameter  # (k,) fp32, trainable: the selected coordinates' current values
    base: torch.Tensor  # (k,) the weight's dtype: W0[indices]

    def delta(self) -> torch.Tensor:
        """(k,) fp32 ``values - W0[indices]``."""
        return self.values.detach() - self.base.float().to(self.values.device)

    def follow(self, device) -> torch.Tensor:
        """The indices on ``device``: after ``model.to(...)`` moved the weight and values, they follow."""
        if self.indices.device != device:
            self.indices, self.base = self.indices.to(device), self.base.to(device)
        return self.indices


@dataclass
class SparseDeltaHandle:
    """What ``sparse_fine_tune`` did: the sparse values, their hooks, and save / merge."""

    entries: list[_Entry] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)  # parameters without a selected coordinate
    base_fingerprint: dict = field(default_factory=dict)  # of the model before training
    provenance: dict = field(default_factory=dict)  # run id, rule, ... of the masks (if known)
    _hooks: list = field(default_factory=list, repr=False)
    _owners: list = field(default_factory=list, repr=False)  # (module, child attached)
    _flags: list = field(default_factory=list, repr=False)  # (param, requires_grad before)
    merged: bool = False

    @property
    def selected(self) -> int:
        return sum(e.indices.numel() for e in self.entries)

    @property
    def numel(self) -> int:
        return sum(e.param.numel() for e in self.entries) + self._frozen_numel

    _frozen_numel: int = 0

    def parameters(self) -> list[nn.Parameter]:
        """The trainable fp32 values (what to hand a plain ``torch.optim`` optimizer)."""
        return [e.values for e in self.entries]

    @torch.no_grad()
    def sync(self) -> None:
        """Write the current values into the weights (rounded to their dtype)."""
        for e in self.entries:
            if e.values.dtype != torch.float32:
                raise FisherSelectError(
                    f"the sparse values of {e.name} became {e.values.dtype} (model.to(dtype) / .half() casts them "
                    "too); cast the model before sparse_fine_tune / load_sparse_delta, never during training")
            flat = _flat(e.param, e.name)
            flat.index_put_((e.follow(flat.device),), e.values.detach().to(flat.device, flat.dtype))

    def deltas(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """name -> (indices, fp32 delta), both 1-D."""
        return {e.name: (e.indices, e.delta()) for e in self.entries}

    def save(self, out: "str | os.PathLike", *, overwrite: bool = False) -> Path:
        """Write indices + fp32 deltas (safetensors) and the JSON meta, atomically, into ``out``."""
        return save_sparse_delta(self.deltas(), self._meta(), out, overwrite=overwrite)

    def _meta(self) -> dict:
        shapes = {e.name: [list(e.param.shape), str(e.param.dtype).removeprefix("torch.")] for e in self.entries}
        return {"format": SPARSE_FORMAT, "base_model": {"fingerprint": self.base_fingerprint},
                "provenance": self.provenance, "caveat": CAVEAT, "selected": self.selected,
                "numel": self.numel, "parameters": shapes, "frozen": list(self.frozen),
                "rounding": self.rounding()}

    @torch.no_grad()
    def rounding(self) -> dict:
        """What the weights' dtype keeps of the deltas: moved coordinates, and those whose whole delta
        rounding to the weight's dtype loses (``W0 + delta`` rounds back to ``W0``)."""
        moved = lost = 0
        for e in self.entries:
            delta = e.delta()
            changed = delta != 0
            kept = (e.base.float() + delta).to(e.base.dtype)
            moved += int(changed.sum())
            lost += int((changed & (kept == e.base)).sum())
        return {"moved": moved, "lost": lost, "bf16_lost_share": lost / moved if moved else None,
                "note": "share of the moved coordinates whose whole delta the weights' dtype rounds away"}

    def merge(self) -> dict:
        """Leave ``W0 + delta`` (rounded to the weights' dtype) in the weights and detach everything.

        Returns ``rounding()``: in bf16/fp16, the share of moved coordinates whose delta was lost.
        The handle keeps the fp32 values: ``save`` still works after a merge.
        """
        if not self.merged:
            try:
                self.sync()
            finally:  # a refused sync still detaches: no hook may outlive the handle
                self._detach()
        return self.rounding()

    def _detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for module in self._owners:
            delattr(module, ATTR)
        for param, flag in self._flags:
            param.requires_grad_(flag)
            param.grad = None
        self._hooks, self._owners, self._flags = [], [], []
        self.merged = True

    remove = merge  # as ``MaskHandle.remove``: training's result stays, the machinery goes


# ---------------------------------------------------------------------------
# Building a handle


def sparse_from_masks(model: nn.Module, params: dict[str, nn.Parameter], masks: dict[str, torch.Tensor], *,
                      optimizer=None, provenance: dict | None = None) -> SparseDeltaHandle:
    """Sparse mode over checked masks (``apply_masks(..., sparse=True)`` resolves and checks them)."""
    base_fingerprint = fingerprint(model)
    chosen = {}
    for name, param in params.items():
        flat_mask = masks[name].reshape(-1)
        chosen[name] = flat_mask.nonzero().squeeze(1) if param.requires_grad else flat_mask[:0].long()
    return _attach(model, params, chosen, None, base_fingerprint, provenance or {}, optimizer)


def _attach(model, params, chosen, deltas, base_fingerprint, provenance, optimizer) -> SparseDeltaHandle:
    """Freeze every parameter, then give each one with chosen indices its values and hooks."""
    handle = SparseDeltaHandle(base_fingerprint=base_fingerprint, provenance=provenance)
    modules = dict(model.named_modules())
    for param in {id(p): p for p in model.parameters()}.values():
        handle._flags.append((param, param.requires_grad))
        param.requires_grad_(False)
        param.grad = None  # a stale gradient would still reach the optimizer
    try:
        for name, param in params.items():
            idx = chosen[name]
            if idx.numel() == 0:
                handle.frozen.append(name)
                handle._frozen_numel += param.numel()
                continue
            delta = None if deltas is None else deltas[name]
            handle.entries.append(_entry(handle, modules, name, param, idx, delta))
    except BaseException:
        handle.merge()
        raise
    handle.sync()
    step_hook = register_optimizer_step_post_hook if optimizer is None else optimizer.register_step_post_hook
    handle._hooks.append(step_hook(lambda *args, **kwargs: handle.sync()))
    return handle


def _entry(handle, modules, name, param, idx, delta) -> _Entry:
    """Values, base copy and gradient hook of one parameter; values attached to its module."""
    owner, _, attr = name.rpartition(".")
    flat = _flat(param, name)
    dtype = torch.int32 if param.numel() < 2**31 else torch.int64
    indices = idx.to(flat.device, dtype)  # (k,)
    base = flat.detach().index_select(0, indices).clone()  # (k,) the weight's dtype
    start = base.to(torch.float32, copy=True)  # a copy also in fp32: values must not share base's storage
    if delta is not None:
        start += delta.to(flat.device, torch.float32)
    values = nn.Parameter(start)  # (k,) fp32
    module = modules[owner]
    if not hasattr(module, ATTR):
        module.add_module(ATTR, SparseValues())
        handle._owners.append(module)
    getattr(module, ATTR)[attr] = values
    param.requires_grad_(True)  # autograd must compute its gradient; the hook drops it at once
    entry = _Entry(name, param, indices, values, base)
    handle._hooks.append(param.register_post_accumulate_grad_hook(_gather_hook(entry)))
    return entry


def _gather_hook(entry: _Entry):
    """Move the selected coordinates of a freshly accumulated dense gradient into ``values.grad``."""
    values = entry.values

    def gather(param: torch.Tensor) -> None:
        grad = param.grad.reshape(-1)  # (numel,) the weight's dtype
        part = grad.index_select(0, entry.follow(grad.device)).to(values.device, torch.float32)  # (k,)
        if values.grad is None:
            values.grad = part
        else:
            values.grad.add_(part)  # gradient accumulation over micro-batches
        param.grad = None  # the dense gradient lives for this layer only

    return gather


def _flat(param: torch.Tensor, name: str) -> torch.Tensor:
    if not param.is_contiguous():
        raise FisherSelectError(f"parameter {name} is not contiguous; sparse fine-tuning writes into it in place "
                                "(call .contiguous() on the model's weights first)")
    return param.data.view(-1)


# ---------------------------------------------------------------------------
# Files


def save_sparse_delta(deltas: dict[str, tuple[torch.Tensor, torch.Tensor]], meta: dict,
                      out: "str | os.PathLike", *, overwrite: bool = False) -> Path:
    """A sparse delta directory: ``<name>.indices`` + ``<name>.delta`` (fp32) safetensors, and the JSON meta."""
    tensors = {}
    for name, (indices, delta) in deltas.items():
        tensors[f"{name}.indices"], tensors[f"{name}.delta"] = indices, delta.float()

    def writer(tmp: Path) -> None:
        save_tensors(tmp / SPARSE_DELTA_FILE, tensors, {META_KEY: json.dumps(meta)})
        write_json(tmp / SPARSE_META_FILE, meta)

    return write_dir(Path(out), writer, overwrite=overwrite)


def read_sparse_delta(path: "str | os.PathLike") -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict]:
    """``(name -> (indices, delta), meta)`` of a directory written by ``handle.save``."""
    file = Path(path) / SPARSE_DELTA_FILE
    if not file.is_file():
        raise FisherSelectError(f"{path} is not a sparse delta directory (no {SPARSE_DELTA_FILE}); pass the directory "
                                "written by handle.save or `fisher-select export --format sparse-delta`")
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[META_KEY])
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:  # safetensors / JSON raise their own types for damaged files
        raise FisherSelectError(f"{file} is damaged or not a fisher_select sparse delta ({err}); write it again") from err
    if meta.get("format") != SPARSE_FORMAT:
        raise FisherSelectError(f"{file} has format {meta.get('format')!r}, expected {SPARSE_FORMAT}")
    names = list(meta["parameters"])
    return {n: (tensors[f"{n}.indices"], tensors[f"{n}.delta"]) for n in names}, meta


def load_sparse_delta(model: nn.Module, path: "str | os.PathLike", *, optimizer=None) -> SparseDeltaHandle:
    """Start sparse fine-tuning of ``model`` from a saved delta: ``values = W0[indices] + delta``.

    ``model`` must be the base model the delta was trained from (fingerprint checked, the refusal
    names the first differing tensor). The forward then sees the delta at once; ``merge()``
    writes it into the weights for good, or keep training.
    """
    deltas, meta = read_sparse_delta(path)
    check_fingerprint(meta["base_model"]["fingerprint"], model, f"sparse delta {path}")
    by_name = dict(model.named_parameters(remove_duplicate=False))
    params = {name: by_name[name] for name in deltas}
    for name in meta.get("frozen", []):
        params.setdefault(name, by_name[name])
    chosen = {name: deltas[name][0].long() if name in deltas else torch.zeros(0, dtype=torch.long)
              for name in params}
    delta = {name: d for name, (_, d) in deltas.items()}
    delta.update({name: torch.zeros(0) for name in params if name not in deltas})
    return _attach(model, params, chosen, delta, meta["base_model"]["fingerprint"], meta.get("provenance", {}),
                   optimizer)


def empty_delta(maskset, out: "str | os.PathLike", *, overwrite: bool = False) -> Path:
    """A sparse delta directory with every selected coordinate's delta at 0 (``export --format sparse-delta``).

    ``load_sparse_delta(model, out)`` then starts sparse fine-tuning with these coordinates; the
    fingerprint is the masks' (the run's model)."""
    deltas = {}
    parameters = {}
    for name, mask in maskset.masks.items():
        idx = mask.reshape(-1).nonzero().squeeze(1)
        if idx.numel():
            dtype = torch.int32 if mask.numel() < 2**31 else torch.int64
            deltas[name] = (idx.to(dtype), torch.zeros(idx.numel()))
            parameters[name] = [list(mask.shape), None]
    meta = {"format": SPARSE_FORMAT, "base_model": maskset.meta["model"], "provenance": mask_provenance(maskset.meta),
            "caveat": CAVEAT, "selected": maskset.selected, "numel": maskset.numel, "parameters": parameters,
            "frozen": sorted(n for n in maskset.masks if n not in deltas), "rounding": None}
    return save_sparse_delta(deltas, meta, out, overwrite=overwrite)


def mask_provenance(mask_meta: dict | None) -> dict:
    """What a delta records of the masks it was trained on: run, rule, density, caveats."""
    if not mask_meta:
        return {}
    keys = ("run_id", "rule", "density", "selected", "numel", "caveat", "run_caveats")
    return {"masks": {k: mask_meta[k] for k in keys if k in mask_meta}}
