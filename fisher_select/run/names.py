"""Every file name fisher_select writes, in one place, and the paths built from them."""

from __future__ import annotations

import os
from pathlib import Path

# A run directory (`fisher-select calibrate --out RUN`)
FISHER_FILE = "fisher.safetensors"
BOUNDS_FILE = "bounds.safetensors"
GRAD_FILE = "grad_estimate.safetensors"  # the primary objective's
GRAD_FILE_OF = "grad_estimate-{objective}.safetensors"  # every further objective's
GRAD_GLOB = "grad_estimate*.safetensors"
TOKEN_FISHER_FILE = "fisher_token.safetensors"
SAMPLES_FILE = "samples.jsonl"
REPORT_FILE = "report.json"
HTML_FILE = "report.html"
MARKDOWN_FILE = "report.md"
# `fisher-select validate` inside a run directory: RUN/validation-<optimizer>-seed<seed>/
VALIDATION_DIR = "validation-{optimizer}-seed{seed}"
VALIDATION_GLOB = "validation-*/validation.json"
VALIDATION_FILE = "validation.json"
VALIDATION_PLOTS = {"bound": "bound_vs_movement.png", "curves": "precision_at_k.png",
                    "objective": "objective_per_step.png"}
# The matched-budget outcome study (``training.outcomes``) inside a run directory: RUN/outcomes-<kind>/
OUTCOMES_DIR = "outcomes-{kind}"
OUTCOMES_GLOB = "outcomes-*/outcomes.json"
OUTCOMES_FILE = "outcomes.json"
OUTCOMES_PLOT = "recovery_vs_density.png"
# A calibration checkpoint beside the run: RUN.checkpoint/rank-000-of-001/batch-000004/
CHECKPOINT_SUFFIX = ".checkpoint"
CHECKPOINT_RANK_DIR = "rank-{rank:03d}-of-{world:03d}"
CHECKPOINT_BATCH_DIR = "batch-{batches:06d}"
CHECKPOINT_BATCH_PATTERN = r"^batch-(\d{6})$"
CHECKPOINT_MANIFEST, CHECKPOINT_TENSORS, CHECKPOINT_SAMPLES = "manifest.json", "tensors.safetensors", "samples.jsonl"
# A mask file FILE (safetensors of booleans) and its sidecar FILE.json
MASK_FORMAT = "fisher_select.masks/1"
MASK_SIDECAR_SUFFIX = ".json"
# A LoRA hint directory: PEFT's own config file name, and the provenance beside it
LORA_CONFIG_FILE = "adapter_config.json"  # peft.utils.CONFIG_NAME (checked in the tests)
LORA_PROVENANCE_FILE = "fisher_select_provenance.json"
LORA_PROVENANCE_FORMAT = "fisher_select.lora_provenance/1"
# A sparse delta directory (``training.sparse``): indices + values, provenance
SPARSE_DELTA_FILE = "sparse_delta.safetensors"
SPARSE_META_FILE = "sparse_delta.json"
SPARSE_FORMAT = "fisher_select.sparse_delta/1"
# The embedded default converted from its GGUF, in the model cache
MODEL_SOURCE_FILE = "fisher_select_source.json"


def sidecar_path(path: "str | os.PathLike") -> Path:
    """``<path>.json``: the human-readable copy of a mask file's metadata."""
    path = Path(path)
    return path.with_name(path.name + MASK_SIDECAR_SUFFIX)


def checkpoint_folder(out: "str | os.PathLike") -> Path:
    """``OUT.checkpoint`` beside the run directory ``OUT``."""
    out = Path(out)
    return out.with_name(out.name + CHECKPOINT_SUFFIX)


def validation_dir(run_path: "str | os.PathLike", optimizer: str, seed: int) -> Path:
    """Where `fisher-select validate` writes by default: inside the run directory."""
    return Path(run_path) / VALIDATION_DIR.format(optimizer=optimizer, seed=seed)


def outcomes_dir(run_path: "str | os.PathLike", kind: str) -> Path:
    """Where the outcome study of one training kind is kept: inside the run directory."""
    return Path(run_path) / OUTCOMES_DIR.format(kind=kind)


def grad_file_for(index: int, name: str) -> str:
    """The gradient-estimate file of the index-th objective."""
    return GRAD_FILE if index == 0 else GRAD_FILE_OF.format(objective=name)
