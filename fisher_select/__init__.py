"""fisher_select: locate the parameter coordinates fine-tuning is likely to move, before it runs.

Every name below is imported on first use (PEP 562), so ``import fisher_select`` and the CLI's
light commands (``--version``, ``recipes``) never load torch, transformers or PEFT.
"""

from fisher_select.version import __version__

_LAZY = {
    "Calibration": "fisher_select.calibration.calibrator",
    "CalibrationConfig": "fisher_select.calibration.config",
    "calibrate": "fisher_select.calibration.calibrator",
    "Objective": "fisher_select.calibration.objectives",
    "RLObjective": "fisher_select.calibration.objectives",
    "PromptRecord": "fisher_select.calibration.prompts",
    "load_prompts": "fisher_select.calibration.prompts",
    "numeric_match": "fisher_select.calibration.rewards",
    "regex_match": "fisher_select.calibration.rewards",
    "ScoreSums": "fisher_select.engine.sums",
    "plan_coverage": "fisher_select.engine.coverage",
    "score_sums": "fisher_select.engine.scoring",
    "FisherSelectError": "fisher_select.errors",
    "fingerprint": "fisher_select.models",
    "load_model": "fisher_select.models",
    "Run": "fisher_select.run.load",
    "load_run": "fisher_select.run.load",
    "MaskSet": "fisher_select.outputs.masks",
    "select_masks": "fisher_select.outputs.masks",
    "save_masks": "fisher_select.outputs.masks",
    "load_masks": "fisher_select.outputs.masks",
    "apply_masks": "fisher_select.training.enforce",
    "MaskHandle": "fisher_select.training.enforce",
    "FisherMaskCallback": "fisher_select.training.callback",
    "sparse_fine_tune": "fisher_select.training.enforce",
    "SparseDeltaHandle": "fisher_select.training.sparse",
    "load_sparse_delta": "fisher_select.training.sparse",
    "LoraHintConfig": "fisher_select.outputs.config",
    "LoraHints": "fisher_select.outputs.lora",
    "lora_hints": "fisher_select.outputs.lora",
    "lora_config": "fisher_select.outputs.lora",
    "load_lora_config": "fisher_select.outputs.lora",
    "shira_config": "fisher_select.outputs.shira",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fisher_select' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = ["__version__", *sorted(_LAZY)]
