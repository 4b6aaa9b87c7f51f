"""fisher_select: locate the parameter coordinates fine-tuning is likely to move, before it runs."""

from .calibrate import Calibration, calibrate
from .engine import ScoreSums, plan_coverage, score_sums
from .errors import FisherSelectError
from .models import fingerprint, load_model
from .objectives import Objective, RLObjective
from .prompts import PromptRecord, load_prompts
from .rewards import numeric_match, regex_match
from .run import Run, load_run

__version__ = "0.1.0"

__all__ = [
    "Calibration", "FisherSelectError", "Objective", "PromptRecord", "RLObjective", "Run", "ScoreSums",
    "calibrate", "fingerprint", "load_model", "load_prompts", "load_run", "numeric_match", "plan_coverage",
    "regex_match", "score_sums", "__version__",
]
