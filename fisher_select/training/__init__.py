"""Code that runs during a user's training: masks enforced on a model.

- ``enforce``: ``apply_masks`` (dense masked fine-tuning, ``MaskHandle``), ``sparse_fine_tune``,
  ``resolve_masks``;
- ``sparse``: sparse-delta fine-tuning (``SparseDeltaHandle``) and its delta files
  (``load_sparse_delta``);
- ``callback``: ``FisherMaskCallback`` for ``transformers.Trainer`` and TRL.

Selecting masks and their file format are ``fisher_select.outputs.masks``; studies of a run
against real training are ``fisher_select.studies``.
"""
