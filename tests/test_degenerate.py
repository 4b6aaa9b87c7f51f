"""Degenerate results warn where the user looks: S = 0 in the Python API, a selection above half the model."""

from __future__ import annotations

import warnings

import pytest

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import RLObjective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.errors import DegenerateResultWarning
from tests.tiny import TinyTokenizer, enumeration_model

PROMPTS = [PromptRecord(i, p, None, {}) for i, p in enumerate(["2 3", "4 2 0", "3 3"])]


def _calibrate(reward):
    return calibrate(enumeration_model(), TinyTokenizer(5), PROMPTS, RLObjective(reward), samples_per_prompt=4,
                     max_new_tokens=3, seed=3, batch_size=8, progress=False)


def test_zero_signal_scale_warns_in_the_python_api():
    with pytest.warns(DegenerateResultWarning, match="signal scale S = 0") as caught:
        cal = _calibrate(lambda record, text: 1.0)  # every reward equal: no signal
    assert cal.signal_scale == 0.0
    assert len([w for w in caught if w.category is DegenerateResultWarning]) == 1  # once per calibration
    assert len(cal.warnings) == 1 and cal.warnings[0].startswith("(rl) signal scale S = 0: ")


def test_a_varying_reward_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DegenerateResultWarning)
        cal = _calibrate(lambda record, text: float(len(text.split()) % 2))
    assert cal.signal_scale > 0 and cal.warnings == []
