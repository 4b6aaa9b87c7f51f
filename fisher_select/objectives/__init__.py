"""Objectives share the model Fisher and differ only in their signal a(x, y) and its scale."""

from .base import Context, Group, GroupSignal, Objective, leave_one_out, unbiased_variance
from .distill import OPDFullObjective, OPDPGObjective
from .rl import RLObjective
from .sft import SFTDemonstrationsObjective, SFTObjective

__all__ = ["Context", "Group", "GroupSignal", "Objective", "RLObjective", "leave_one_out", "unbiased_variance",
           "SFTObjective", "SFTDemonstrationsObjective", "OPDPGObjective", "OPDFullObjective"]
