"""The ground floor's statistics: pure functions of tensors and lists that every floor above uses.

- ``naming``: parameter -> module names, layer index and kind;
- ``bounds``: the coordinate bound, ``BoundsView`` (shared by a Calibration and a loaded Run) and
  per-module masses (the one place they are summed);
- ``ranking``: exact top-k over named tensors (radix select, canonical tie-breaking);
- ``topk``: coarse bit-pattern histograms, thresholds, top masses and overlaps (report speed);
- ``correlation``: Spearman's rank correlation, mask overlaps;
- ``stability``: split-half stability of a Fisher estimate;
- ``conformity``: the score-mean check (do the samples follow the model?).
- ``experts``: fused MoE expert tensors (expert index = dim 0) split into per-expert units.

Nothing here imports from another floor of fisher_select but ``errors``.
"""
