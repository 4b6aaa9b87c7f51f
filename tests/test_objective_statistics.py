"""The calibration/objective contract: objectives are pure, the calibration holds their statistics.

- ``Statistics.merge`` is associative and equals the statistics of the groups added in sequence
  (what ranks and resumed runs rely on), leaves its inputs unchanged and refuses other types;
- ``to_dict`` / ``from_dict`` round-trip, through JSON too (scale terms may be inf or nan);
- one objective instance used in two calibrations gives exactly what a fresh instance gives.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

import pytest
import torch

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import (Context, Group, OPDFullObjective, OPDPGObjective, RLObjective,
                                                  SFTDemonstrationsObjective, SFTObjective, Statistics)
from fisher_select.calibration.teachers import Teacher
from tests.enumeration import MAX_NEW, PROMPTS, VOCAB, records, student, teacher
from tests.test_objectives_sft import DemoTokenizer, _write_demos
from tests.tiny import TinyTokenizer

RESPONSES = [[[2, 1], [3, 1], [4]], [[0, 3, 1], [2], [1]], [[3], [3, 1], [4, 2, 1]],
             [[1], [2, 2, 1], [0]], [[4, 1], [4, 1], [4, 1]], [[2, 3], [0, 1], [3, 3, 3]]]


class _Fixed:
    """A teacher / demonstrator stub: fixed log-probabilities per group, in call order."""

    name = "stub"

    def __init__(self, rows):
        self.rows = iter(rows)

    def sequence_logprobs(self, group):
        return torch.tensor(next(self.rows), dtype=torch.float64)


def _groups() -> list[Group]:
    recs = records()
    out = []
    for i, resp in enumerate(RESPONSES):
        p = i % len(PROMPTS)
        texts = [" ".join(str(t) for t in r if t != 1) for r in resp]
        out.append(Group(recs[p], PROMPTS[p], resp, texts, [-1.0 - 0.5 * k - 0.1 * i for k in range(3)], [True] * 3))
    return out


def _reward(record, text):
    return float(len(text.split()) % 2)  # groups 0 and 4 have constant rewards: zero scale terms


# log nu for SFT: moderate, one huge weight (clipped, infinite term), and nu(y|x) = 0
_SFT_ROWS = [[-1.2, -1.0, -2.5], [0.0, 800.0, -2.0], [-math.inf, -1.5, -2.2], [-1.0, -1.0, -1.0],
             [-3.0, -0.5, -2.0], [-2.0, -2.0, -math.inf]]


@lru_cache(maxsize=None)
def _signals(kind: str):
    """(objective, GroupSignals of the six groups): real signals, including infinite and zero terms.
    Cached: nothing downstream changes them (Statistics.add only reads)."""
    groups = _groups()
    if kind == "rl":
        o = RLObjective(_reward)
    elif kind == "sft":
        o = SFTObjective(Teacher(student()))
        o.teacher = _Fixed(_SFT_ROWS)
    elif kind == "opd-pg":
        o = OPDPGObjective(Teacher(student()))
        o.teacher = _Fixed(_SFT_ROWS)  # -inf rows: infinite groups
    else:  # opd-full: a near teacher for four groups, a teacher banning token 3 for two
        near, banned = OPDFullObjective(Teacher(teacher("near"))), OPDFullObjective(Teacher(teacher("banned")))
        ctx = _ctx()
        for x in (near, banned):
            x.prepare(ctx, [])
        return near, [(banned if i in (1, 5) else near).signals(g, ctx) for i, g in enumerate(groups)]
    return o, [o.signals(g, _ctx()) for g in groups]


def _ctx() -> Context:
    return Context(student(), TinyTokenizer(VOCAB))


def _stats(o, signals) -> Statistics:
    s = o.new_statistics()
    for x in signals:
        s.add(x)
    return s


def _text(stats: Statistics) -> str:
    """Canonical JSON (inf and nan spelled out), so comparisons treat nan == nan."""
    return json.dumps(stats.to_dict(), sort_keys=True)


KINDS = ["rl", "sft", "opd-pg", "opd-full"]


@pytest.mark.parametrize("kind", KINDS)
def test_merge_is_associative_and_equals_the_statistics_of_all_groups(kind):
    o, signals = _signals(kind)
    whole = _stats(o, signals)
    a, b, c = _stats(o, signals[:2]), _stats(o, signals[2:3]), _stats(o, signals[3:])
    before = [_text(x) for x in (a, b, c)]
    left, right = a.merge(b).merge(c), a.merge(b.merge(c))
    assert _text(left) == _text(right) == _text(whole)
    assert [_text(x) for x in (a, b, c)] == before  # merge changes neither input
    assert _text(o.new_statistics().merge(whole)) == _text(whole)  # empty statistics are the identity
    assert json.dumps(o.summary(left), sort_keys=True) == json.dumps(o.summary(whole), sort_keys=True)
    assert o.signal_scale(left) == o.signal_scale(whole)
    assert len(whole.terms) == len(RESPONSES)


def test_the_statistics_record_what_the_summaries_report():
    """Not vacuous: the six groups exercise zero, infinite and clipped terms."""
    rl = _stats(*_signals("rl"))
    assert rl.zero_groups == 2
    sft = _stats(*_signals("sft"))
    assert sft.clipped == 1 and math.isinf(max(sft.terms)) and sft.prompt_index == [0, 1, 0, 1, 0, 1]
    pg = _stats(*_signals("opd-pg"))
    assert pg.infinite_groups == 2 and len(pg.sigma_means) == 4
    full = _stats(*_signals("opd-full"))
    assert full.infinite_groups == 2 and math.isinf(full.sampled_terms[1]) and math.isfinite(full.sampled_terms[0])


@pytest.mark.parametrize("kind", KINDS)
def test_to_dict_from_dict_round_trip_also_through_json(kind):
    o, signals = _signals(kind)
    stats = _stats(o, signals)
    again = type(stats).from_dict(stats.to_dict())
    assert type(again) is type(stats) and _text(again) == _text(stats)
    via_json = type(stats).from_dict(json.loads(json.dumps(stats.to_dict())))
    assert _text(via_json) == _text(stats)
    assert json.dumps(o.summary(via_json), sort_keys=True) == json.dumps(o.summary(stats), sort_keys=True)
    stats.to_dict()["terms"].append(1.0)  # a copy: changing it leaves the statistics alone
    assert len(stats.terms) == len(RESPONSES)


def test_from_dict_and_merge_refuse_mismatches():
    rl, sft = _stats(*_signals("rl")), _stats(*_signals("sft"))
    data = rl.to_dict()
    with pytest.raises(ValueError, match="expected keys"):
        type(sft).from_dict(data)  # SFT statistics need their log-weights
    with pytest.raises(ValueError, match="expected keys"):
        Statistics.from_dict({**data, "extra": 1})
    with pytest.raises(TypeError, match="cannot merge"):
        rl.merge(sft)


def _calibration(objectives, tok):
    return calibrate(student(), tok, records(), objectives, samples_per_prompt=4, max_new_tokens=MAX_NEW,
                     seed=3, batch_size=8, progress=False, verify=False)


def _make(path):
    return [SFTObjective(Teacher(teacher("near"))), RLObjective(_reward, name="rl"),
            OPDFullObjective(Teacher(teacher("near")), name="full"),
            SFTDemonstrationsObjective(path, name="demos")]


def test_an_objective_instance_reused_in_two_calibrations_gives_identical_results(tmp_path):
    path = _write_demos(tmp_path / "demos.jsonl", [{"prompt": "2 3", "response": "4 4"},
                                                   {"prompt": "4 2 0", "response": "3 2"}])
    tok = DemoTokenizer(VOCAB)
    reused = _make(path)  # fresh instances in the first run: the second must repeat it exactly
    runs = [_calibration(reused, tok), _calibration(reused, tok)]
    first = runs[0]
    assert first.token_fisher is not None and first.objective("demos").summary["demonstrations"]["pairs"] == 2
    for cal in runs[1:]:
        for n in first.fisher:
            assert torch.equal(cal.fisher[n], first.fisher[n]) and torch.equal(cal.token_fisher[n], first.token_fisher[n])
        for r, r0 in zip(cal.objectives, first.objectives):
            assert json.dumps(r.summary, sort_keys=True) == json.dumps(r0.summary, sort_keys=True), r.name
            assert all(torch.equal(r.grad_estimate[n], r0.grad_estimate[n]) for n in r0.grad_estimate), r.name
        assert cal.samples == first.samples
    # the per-prompt weight table has one entry per prompt: nothing carried over from the first run
    assert len(runs[1].objectives[0].summary["weights"]["per_prompt"]) == len(PROMPTS)
