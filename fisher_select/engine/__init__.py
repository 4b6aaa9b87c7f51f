"""The score engine: exact per-sample squared scores in one backward (rules/ per layer family)."""

from fisher_select.engine.coverage import Coverage, plan_coverage
from fisher_select.engine.scoring import score_sums
from fisher_select.engine.sums import ScoreSums

__all__ = ["Coverage", "ScoreSums", "plan_coverage", "score_sums"]
