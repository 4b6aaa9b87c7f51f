"""Studies of a run against real training: a plain reference training loop, realized movement, and how
well a run's ranking (and its peers' rules) predicts which coordinates move (`fisher-select validate`),
and the outcome studies. The code that runs during a user's own training is ``fisher_select.training``.

- ``loop``: the seeded training loop and its tasks (on-policy objectives, SFT from demonstrations);
- ``movement``: parameter snapshots and realized movement ``|theta_T - theta_0|`` in fp32;
- ``metrics``: AUROC, precision/recall@k, Jaccard@k, Spearman on a seeded coordinate subsample;
- ``baselines``: random, ``|theta|``, single-batch ``|grad|``, Spectrum's weight SNR, PEFT's KappaTune;
- ``validate``: the orchestration behind ``validation.json``; ``plots``: its figures;
- ``outcomes``: the protocol-1 outcome study (withdrawn; kept to read old results);
- protocol 2 of the outcome study (docs/OUTCOMES.md): ``protocol`` (settings, draws, grids), ``grid``
  (lr choice off the edges), ``cells`` (the cell cache), ``cell_run``, ``arms``, ``measures``
  (content, forgetting, frozen teacher), ``study``, ``paired`` (paired statistics), ``assemble``,
  ``prefix`` (a shared prompt prefix computed once), ``outcome_methods``, ``outcome_plots``; the
  tables are ``report.outcome_tables``.
"""
