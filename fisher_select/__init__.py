"""fisher_select: locate the parameter coordinates fine-tuning is likely to move, before it runs."""

from fisher_select.calibration.calibrator import Calibration, calibrate
from fisher_select.engine.scoring import ScoreSums, plan_coverage, score_sums
from fisher_select.errors import FisherSelectError
from fisher_select.models import fingerprint, load_model
from fisher_select.calibration.objectives import Objective, RLObjective
from fisher_select.calibration.prompts import PromptRecord, load_prompts
from fisher_select.calibration.rewards import numeric_match, regex_match
from fisher_select.rundir import Run, load_run

__version__ = "0.1.0"

__all__ = [
    "Calibration", "FisherSelectError", "Objective", "PromptRecord", "RLObjective", "Run", "ScoreSums",
    "calibrate", "fingerprint", "load_model", "load_prompts", "load_run", "numeric_match", "plan_coverage",
    "regex_match", "score_sums", "__version__",
]
