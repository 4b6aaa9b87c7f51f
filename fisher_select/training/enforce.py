"""Train with a mask enforced: coordinates outside the mask never move.

``apply_masks(model, masks)`` enforces a mask (True = may move) three ways:

1. A parameter with no selected coordinate is frozen (``requires_grad=False``, ``.grad`` cleared):
   call it before building the optimizer, which then never sees the parameter.
2. A partly selected parameter gets its gradient zeroed at masked coordinates right after each
   accumulation (``register_post_accumulate_grad_hook``), so gradient clipping and logging see
   the masked norm.
3. Zero gradients are not enough: AdamW's decoupled weight decay ``p -= lr * wd * p`` moves every
   coordinate, and momentum carried from earlier steps moves coordinates with zero gradient. So
   the handle keeps a copy of the masked values of each partly selected parameter and writes it
   back after every optimizer step (an optimizer step post-hook), leaving them bit-identical.

By default the restore hook is global (``torch.optim`` fires it after the step of *any*
optimizer, including one created later, e.g. by ``Trainer``); restoring is idempotent, so
steps of unrelated optimizers only cost a copy. Pass ``optimizer=`` to scope it to one.
All state lives in the returned ``MaskHandle``; ``handle.remove()`` undoes hooks and freezing.

**Sparse-delta fine-tuning** (``apply_masks(..., sparse=True)`` = ``sparse_fine_tune``): the same
steps with gradients and optimizer state for the selected coordinates only (``training.sparse``).

Choosing masks and their file format are ``fisher_select.outputs.masks``; the callback for
``transformers.Trainer`` is ``training.callback``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fisher_select.errors import FisherSelectError
from fisher_select.models import check_fingerprint
from fisher_select.outputs.masks import MaskSet, load_masks
from fisher_select.training.sparse import mask_provenance, sparse_from_masks


@dataclass
class _Partial:
    """A partly selected parameter and the values its masked coordinates must keep."""

    param: torch.nn.Parameter
    keep: torch.Tensor  # bool, parameter-shaped: True = masked out (must not move)
    saved: torch.Tensor  # 1-D, param[keep] at apply time, the parameter's dtype


@dataclass
class MaskHandle:
    """What ``apply_masks`` did, and the means to undo it."""

    frozen: list[str] = field(default_factory=list)  # no selected coordinate
    partial: list[str] = field(default_factory=list)  # some selected coordinates
    free: list[str] = field(default_factory=list)  # every coordinate selected
    _partials: list[_Partial] = field(default_factory=list, repr=False)
    _was_trainable: dict = field(default_factory=dict, repr=False)  # frozen name -> (param, flag)
    _hooks: list = field(default_factory=list, repr=False)

    def restore(self) -> None:
        """Write the saved values back into every masked coordinate."""
        with torch.no_grad():
            for part in self._partials:
                if part.keep.device != part.param.device:  # the model moved after apply_masks
                    part.keep = part.keep.to(part.param.device)
                    part.saved = part.saved.to(part.param.device)
                part.param.masked_scatter_(part.keep, part.saved)

    def remove(self) -> None:
        """Remove all hooks and give frozen parameters their ``requires_grad`` back."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for param, flag in self._was_trainable.values():
            param.requires_grad_(flag)
        self._was_trainable.clear()
        self._partials.clear()


def apply_masks(model: torch.nn.Module, masks, *, optimizer=None, sparse: bool = False):
    """Make coordinates outside ``masks`` immovable during training of ``model``.

    ``masks``: dict name -> bool tensor (True = may move), a ``MaskSet``, or a mask file path.
    A mask file or ``MaskSet`` must carry the fingerprint of ``model``; names and shapes must
    match the model's parameters, and every trainable parameter needs a mask. Call before
    building the optimizer. Returns a ``MaskHandle`` (dense), or with ``sparse=True`` a
    ``SparseDeltaHandle``: gradients and optimizer state for the selected coordinates only
    (``fisher_select.training.sparse``).
    """
    masks, meta = _resolve(masks, model)
    params = _check_names(masks, model)
    if sparse:
        return sparse_from_masks(model, params, masks, optimizer=optimizer, provenance=mask_provenance(meta))
    handle = MaskHandle()
    for name, param in params.items():
        mask = masks[name].to(param.device)
        if bool(mask.all()):
            handle.free.append(name)
        elif not bool(mask.any()):
            handle._was_trainable[name] = (param, param.requires_grad)
            param.requires_grad_(False)
            param.grad = None  # a stale gradient would still be applied by the optimizer
            handle.frozen.append(name)
        else:
            _protect(handle, name, param, ~mask)
    step_hook = register_optimizer_step_post_hook if optimizer is None else optimizer.register_step_post_hook
    handle._hooks.append(step_hook(lambda *args, **kwargs: handle.restore()))
    return handle


def _protect(handle: MaskHandle, name: str, param, keep: torch.Tensor) -> None:
    """Zero masked gradients after accumulation and remember the masked values."""

    def zero_masked_grad(p: torch.Tensor) -> None:
        p.grad.masked_fill_(keep.to(p.grad.device), 0)

    if param.grad is not None:
        param.grad.masked_fill_(keep, 0)
    handle._hooks.append(param.register_post_accumulate_grad_hook(zero_masked_grad))
    handle._partials.append(_Partial(param, keep, param.detach()[keep]))  # indexing copies
    handle.partial.append(name)


def sparse_fine_tune(model: torch.nn.Module, masks, *, optimizer=None):
    """Sparse-delta fine-tuning: ``apply_masks(model, masks, sparse=True)``; see ``training.sparse``."""
    return apply_masks(model, masks, optimizer=optimizer, sparse=True)


def resolve_masks(masks, model) -> dict[str, torch.Tensor]:
    """Mask dict from a dict, ``MaskSet`` or file; files and MaskSets are fingerprint-checked."""
    return _resolve(masks, model)[0]


def _resolve(masks, model) -> tuple[dict[str, torch.Tensor], dict | None]:
    """``(mask dict, its metadata or None for a plain dict)``, fingerprint-checked."""
    if isinstance(masks, (str, os.PathLike)):
        path = os.fspath(masks)
        masks, meta = load_masks(path)
        check_fingerprint(meta["model"]["fingerprint"], model, f"mask file {path}")
        return masks, meta
    if isinstance(masks, MaskSet):
        check_fingerprint(masks.meta["model"]["fingerprint"], model, f"masks of run {masks.meta['run_id']}")
        return masks.masks, masks.meta
    if isinstance(masks, dict):
        return masks, None
    raise FisherSelectError(
        f"masks must be a dict, a MaskSet or a mask file path, not {type(masks).__name__}"
    )


def _check_names(masks: dict, model) -> dict[str, torch.nn.Parameter]:
    """Mask name -> parameter (aliases of tied weights resolved); refuses a foreign mask."""
    by_name = dict(model.named_parameters(remove_duplicate=False))  # tied aliases included
    params, seen = {}, {}
    for name, mask in masks.items():
        param = by_name.get(name)
        if param is None:
            raise FisherSelectError(
                f"mask names parameter {name}, which the model does not have; "
                "the mask was computed for another model"
            )
        if tuple(mask.shape) != tuple(param.shape) or mask.dtype != torch.bool:
            raise FisherSelectError(
                f"mask for {name} is {mask.dtype} {tuple(mask.shape)} but the parameter is "
                f"{tuple(param.shape)}; the mask was computed for another model"
            )
        if id(param) in seen:
            if not torch.equal(masks[seen[id(param)]], mask):
                raise FisherSelectError(f"tied parameters {seen[id(param)]} and {name} have different masks")
            continue
        seen[id(param)] = name
        params[name] = param
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise FisherSelectError(
            f"the masks cover no entry for trainable parameter {missing[0]} "
            f"({len(missing)} missing); the mask was computed for another model"
        )
    return params
