"""fisher_select: locate the parameter coordinates fine-tuning is likely to move, before it runs."""

from .engine import ScoreSums, plan_coverage, score_sums
from .errors import FisherSelectError
from .run import Run, load_run

__version__ = "0.1.0"

__all__ = ["FisherSelectError", "Run", "ScoreSums", "load_run", "plan_coverage", "score_sums", "__version__"]
