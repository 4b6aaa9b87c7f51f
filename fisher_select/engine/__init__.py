"""The score engine: exact per-sample squared scores in one backward (rules/ per layer family)."""

from fisher_select.engine.scoring import Coverage, ScoreSums, plan_coverage, score_sums

__all__ = ["Coverage", "ScoreSums", "plan_coverage", "score_sums"]
