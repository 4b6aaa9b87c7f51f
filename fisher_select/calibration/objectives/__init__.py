"""Objectives share the model Fisher and differ only in their signal a(x, y) and its scale."""

from fisher_select.calibration.objectives.base import (Context, ExtraResult, Group, GroupSignal, Objective, ScoringRow,
                                                       Statistics, leave_one_out, unbiased_variance)
from fisher_select.calibration.objectives.distill import FullStatistics, OPDFullObjective, OPDPGObjective, PGStatistics
from fisher_select.calibration.objectives.rl import RLObjective
from fisher_select.calibration.objectives.sft import SFTDemonstrationsObjective, SFTObjective, SFTStatistics

__all__ = ["Context", "ExtraResult", "Group", "GroupSignal", "Objective", "ScoringRow", "Statistics",
           "RLObjective", "leave_one_out", "unbiased_variance", "SFTObjective", "SFTDemonstrationsObjective",
           "SFTStatistics", "OPDPGObjective", "OPDFullObjective", "PGStatistics", "FullStatistics"]
