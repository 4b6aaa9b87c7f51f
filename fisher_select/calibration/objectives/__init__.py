"""Objectives share the model Fisher and differ only in their signal a(x, y) and its scale."""

from fisher_select.calibration.objectives.base import Context, Group, GroupSignal, Objective, leave_one_out, unbiased_variance
from fisher_select.calibration.objectives.distill import OPDFullObjective, OPDPGObjective
from fisher_select.calibration.objectives.rl import RLObjective
from fisher_select.calibration.objectives.sft import SFTDemonstrationsObjective, SFTObjective

__all__ = ["Context", "Group", "GroupSignal", "Objective", "RLObjective", "leave_one_out", "unbiased_variance",
           "SFTObjective", "SFTDemonstrationsObjective", "OPDPGObjective", "OPDFullObjective"]
