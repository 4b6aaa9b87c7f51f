"""The run directory and nothing else (docs/RUN_FORMAT.md): file names, typed and versioned records,
loading, the one writer, migration, comparison of runs, and JSON / tensor / sample I/O. Nothing
here imports from a floor above the ground floor."""
