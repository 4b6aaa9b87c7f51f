"""``FisherMaskCallback``: ``apply_masks`` (or sparse deltas) for ``transformers.Trainer`` and TRL."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from fisher_select.errors import FisherSelectError
from fisher_select.training.enforce import apply_masks, resolve_masks


class FisherMaskCallback(TrainerCallback):
    """``apply_masks`` for ``transformers.Trainer`` and trainers built on it (TRL).

    Trainer creates its optimizer inside ``train()``, *before* ``on_train_begin``; so the masks are
    applied at ``on_init_end`` (end of ``Trainer.__init__``: frozen parameters never reach the
    optimizer). A callback added later is applied at ``on_train_begin``: frozen parameters are
    then in the optimizer but never get a gradient, which torch optimizers skip. The restore
    runs through the global optimizer step post-hook after every ``optimizer.step()``. Hooks are
    removed at ``on_train_end`` and put back by the next ``train()``; the fingerprint is checked
    once, on first sight of the model (training changes the weights it samples). Tested with TRL's
    ``GRPOTrainer`` and ``SFTTrainer`` (tests/test_trl.py), with and without gradient checkpointing.

    ``sparse=True``: sparse-delta fine-tuning (``training.sparse``) instead: gradients and optimizer
    state for the selected coordinates only. Applied at ``on_init_end`` the optimizer holds the fp32
    values (a callback added later would leave them out of it: refused). At ``on_train_end`` the
    delta is merged into the weights; ``last_handle`` keeps it (``callback.last_handle.save(dir)``).
    """

    def __init__(self, masks, *, sparse: bool = False):
        self._source = masks
        self._masks: dict[str, torch.Tensor] | None = None
        self.sparse = sparse
        self.handle = None  # MaskHandle, or SparseDeltaHandle with sparse=True; None outside train()
        self.last_handle = None  # the latest handle, kept after train() ends

    def _apply(self, model, optimizer=None) -> None:
        if self.handle is not None or model is None:
            return
        if self._masks is None:
            self._masks = resolve_masks(self._source, model)
        if self.sparse and optimizer is not None:
            raise FisherSelectError("FisherMaskCallback(sparse=True) must be passed to the Trainer's constructor "
                                    "(callbacks=[...]) and used for one train(): added later, or for a second train() after the first merged "
                                    "the delta, the optimizer would not hold the sparse values; build a new Trainer")
        self.handle = self.last_handle = apply_masks(model, self._masks, sparse=self.sparse)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._apply(model)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._apply(model, optimizer)

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
