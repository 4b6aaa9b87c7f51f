"""fisher_select: locate the parameter coordinates fine-tuning is likely to move, before it runs."""

from fisher_select.calibration.calibrator import Calibration, calibrate
from fisher_select.calibration.objectives import Objective, RLObjective
from fisher_select.calibration.prompts import PromptRecord, load_prompts
from fisher_select.calibration.rewards import numeric_match, regex_match
from fisher_select.engine.scoring import ScoreSums, plan_coverage, score_sums
from fisher_select.errors import FisherSelectError
from fisher_select.models import fingerprint, load_model
from fisher_select.outputs.selection import load_masks, save_masks, select_masks
from fisher_select.rundir import Run, load_run

__version__ = "0.1.0"

# Imported on first use: masking needs transformers' Trainer, peft_hints needs peft (slow imports
# that calibration does not need).
_LAZY = {"FisherMaskCallback": "fisher_select.outputs.masking", "MaskHandle": "fisher_select.outputs.masking",
         "apply_masks": "fisher_select.outputs.masking", "lora_config": "fisher_select.outputs.peft_hints",
         "shira_config": "fisher_select.outputs.peft_hints"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fisher_select' has no attribute {name!r}")

__all__ = [
    "Calibration", "FisherMaskCallback", "FisherSelectError", "MaskHandle", "Objective", "PromptRecord",
    "RLObjective", "Run", "ScoreSums", "__version__", "apply_masks", "calibrate", "fingerprint", "load_masks",
    "load_model", "load_prompts", "load_run", "lora_config", "numeric_match", "plan_coverage", "regex_match",
    "save_masks", "score_sums", "select_masks", "shira_config",
]
