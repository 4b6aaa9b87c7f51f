"""Objectives share the model Fisher and differ only in their signal a(x, y) and its scale.

Every name below is imported on first use (PEP 562): reading a recipe imports ``config`` and
``registry`` of this package, which need no torch, and so loads none of the objectives.
"""

_LAZY = {
    **dict.fromkeys(["Context", "ExtraResult", "Group", "GroupSignal", "Objective", "ScoringRow", "Statistics",
                     "leave_one_out", "unbiased_variance"], "base"),
    **dict.fromkeys(["FullStatistics", "OPDFullObjective", "OPDPGObjective", "PGStatistics"], "distill"),
    "RLObjective": "rl",
    **dict.fromkeys(["SFTDemonstrationsObjective", "SFTObjective", "SFTStatistics"], "sft"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
