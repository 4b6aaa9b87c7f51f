"""Objectives share the model Fisher and differ only in their signal a(x, y) and its scale."""

from .base import Context, Group, GroupSignal, Objective, leave_one_out, unbiased_variance
from .rl import RLObjective

__all__ = ["Context", "Group", "GroupSignal", "Objective", "RLObjective", "leave_one_out", "unbiased_variance"]
