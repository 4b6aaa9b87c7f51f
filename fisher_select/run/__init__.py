"""The run directory and nothing else (docs/RUN_FORMAT.md): its file names, typed records, loading,
the one writer, format migration, comparison of two runs, and the JSON / tensor / sample I/O.

- ``names``: every file name fisher_select writes, and the path helpers;
- ``io``: JSON, safetensors and JSONL samples, read and written (a damaged file is one clear error);
- ``schema``: report.json's typed, versioned records (``RunReport``, ``ModelInfo``, ``ObjectiveEntry``,
  ``ModuleEntry``);
- ``validation``: validation.json's typed, versioned record;
- ``load``: ``Run`` and ``load_run`` (the bound maths is ``stats.bounds.BoundsView``'s);
- ``write``: the one writer of a run directory;
- ``migrate``: older run formats upgraded in place;
- ``verify``: two runs compared (``fisher-select verify``, bit for bit; ``fisher-select compare``,
  the agreement of their rankings).

Nothing here imports from a floor above the ground floor; building the report's content is
``report.build``'s.
"""
