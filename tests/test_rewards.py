import math
import uuid

import numpy as np
import pytest

from fisher_select.errors import FisherSelectError
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.calibration.rewards import (
    evaluate_reward,
    last_number,
    load_callable,
    make_reward,
    numeric_closeness,
    numeric_match,
    regex_match,
)


def rec(**fields) -> PromptRecord:
    fields.setdefault("prompt", "What is 6 times 7? Answer with the number only.")
    return PromptRecord(index=4, prompt=fields["prompt"], messages=None, fields=fields)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write a module into a fresh cwd and return its (unique) name."""
    monkeypatch.chdir(tmp_path)
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"

    def write(source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        return name

    return write


# --- last_number / numeric_match -------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", 42.0),
        ("The answer is 42.", 42.0),
        ("first 3 then 17", 17.0),
        ("It is -5", -5.0),
        ("x=-5", -5.0),
        ("10-3=7", 7.0),
        ("3-5", 5.0),
        ("about 3.25 kg", 3.25),
        ("1,234,567 people", 1234567.0),
        ("$1,234.50", 1234.5),
        ("list 1,2,3", 3.0),
        ("minus \u22128", -8.0),
        ("model v2 says 9", 9.0),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


@pytest.mark.parametrize("text", ["", "no digits here", "SmolLM2"])
def test_last_number_none(text):
    assert last_number(text) is None


def test_numeric_match():
    reward = numeric_match()
    assert reward(rec(answer=42), "6*7 = 42") == 1.0
    assert reward(rec(answer=42), "42 or maybe 41") == 0.0
    assert reward(rec(answer=42), "no idea") == 0.0
    assert reward(rec(answer="1,200"), "It is 1200.") == 1.0
    assert reward(rec(answer=2.5), "2.50") == 1.0
    assert reward(rec(answer=-3), "-3") == 1.0
    assert numeric_match("target")(rec(target=7), "7") == 1.0


def test_numeric_match_reports_missing_or_bad_answer():
    with pytest.raises(FisherSelectError, match='prompt 4 .* no "answer" field'):
        numeric_match()(rec(), "42")
    with pytest.raises(FisherSelectError, match='"answer" is \'many\', not a number'):
        numeric_match()(rec(answer="many"), "42")
    with pytest.raises(FisherSelectError, match="not a number"):
        numeric_match()(rec(answer=True), "1")


@pytest.mark.parametrize("answer,text,expected", [
    (14, "14", 1.0),                      # right
    (14, "7 + 7 = 15", 0.5),              # the last number counts: one off
    (3, "Gus has 11 and gives 8: 13", 1 / 11),
    (20, "twenty", 0.0),                  # no number written
    (-3, "-5", 1 / 3),
    (2.5, "It is 3.", 1 / 1.5),
])
def test_numeric_closeness_on_hand_checked_responses(answer, text, expected):
    assert numeric_closeness()(rec(answer=answer), text) == pytest.approx(expected, rel=1e-12)


def test_numeric_closeness_from_a_spec_and_its_errors():
    reward = make_reward({"type": "numeric_closeness", "answer_field": "target"})
    assert reward(rec(target=10), "I think 8") == pytest.approx(1 / 3)
    with pytest.raises(FisherSelectError, match='no "answer" field for numeric_closeness'):
        numeric_closeness()(rec(), "42")
    with pytest.raises(FisherSelectError, match="unknown keys"):
        make_reward({"type": "numeric_closeness", "pattern": "x"})


# --- regex_match -----------------------------------------------------------------------


def test_regex_match_plain_pattern():
    reward = regex_match(r"\bParis\b")
    assert reward(rec(), "It is Paris.") == 1.0
    assert reward(rec(), "Parisian") == 0.0


def test_regex_match_fills_placeholders_literally():
    reward = regex_match(r"^\s*{answer}\s*$", field="answer")
    assert reward(rec(answer="1+1"), " 1+1 ") == 1.0
    assert reward(rec(answer="1+1"), "11") == 0.0  # "+" was escaped, not a quantifier
    assert regex_match(r"\d{2} {unit}")(rec(unit="km"), "it is 42 km") == 1.0


def test_regex_match_errors():
    with pytest.raises(FisherSelectError, match="invalid"):
        regex_match(r"(unclosed")
    with pytest.raises(FisherSelectError, match=r"no \{answer\} placeholder"):
        regex_match(r"\d+", field="answer")
    with pytest.raises(FisherSelectError, match='no "answer" field'):
        regex_match(r"{answer}")(rec(), "x")


# --- load_callable / make_reward -------------------------------------------------------


def test_load_callable_from_cwd(user_module):
    name = user_module("def score(record, text):\n    return float(len(text))\n")
    fn = load_callable(f"{name}:score")
    assert fn(rec(), "abc") == 3.0


@pytest.mark.parametrize("spec", ["nocolon", ":fn", "mod:"])
def test_load_callable_bad_spec(spec):
    with pytest.raises(FisherSelectError, match="module:function"):
        load_callable(spec)


def test_load_callable_errors(user_module):
    name = user_module("VALUE = 3\n")
    with pytest.raises(FisherSelectError, match="has no attribute 'missing'"):
        load_callable(f"{name}:missing")
    with pytest.raises(FisherSelectError, match="is a int, not a function"):
        load_callable(f"{name}:VALUE")
    with pytest.raises(FisherSelectError, match="cannot import module 'no_such_mod_xyz'"):
        load_callable("no_such_mod_xyz:fn")


def test_load_callable_reports_failing_import(user_module):
    name = user_module("raise RuntimeError('boom at import')\n")
    with pytest.raises(FisherSelectError, match="RuntimeError: boom at import"):
        load_callable(f"{name}:fn")


def test_make_reward_builds_each_type(user_module):
    name = user_module("def score(record, text):\n    return 0.5\n")
    assert make_reward({"type": "numeric_match"})(rec(answer=3), "3") == 1.0
    assert make_reward({"type": "numeric_match", "answer_field": "y"})(rec(y=3), "3") == 1.0
    assert make_reward({"type": "regex", "pattern": "{answer}!"})(rec(answer=3), "3!") == 1.0
    assert make_reward({"type": "callable", "function": f"{name}:score"})(rec(), "") == 0.5


@pytest.mark.parametrize(
    "spec, message",
    [
        ({}, 'needs a "type"'),
        ("numeric_match", 'needs a "type"'),
        ({"type": "bleu"}, "reward type 'bleu' is unknown"),
        ({"type": "regex"}, "needs a string 'pattern'"),
        ({"type": "numeric_match", "answer_feild": "a"}, r"unknown keys \['answer_feild'\]"),
    ],
)
def test_make_reward_errors(spec, message):
    with pytest.raises(FisherSelectError, match=message):
        make_reward(spec)


# --- evaluate_reward -------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [(1, 1.0), (0.25, 0.25), (True, 1.0), (np.float32(0.5), 0.5)])
def test_evaluate_reward_accepts_numbers(value, expected):
    got = evaluate_reward(lambda r, t: value, rec(), "text")
    assert got == expected and type(got) is float


@pytest.mark.parametrize("value", [None, "1.0", math.nan, math.inf, -math.inf, [1.0]])
def test_evaluate_reward_rejects_non_finite_or_non_numbers(value):
    def fn(record, text):
        return value

    with pytest.raises(FisherSelectError) as err:
        evaluate_reward(fn, rec(), "text")
    message = str(err.value)
    assert "reward fn returned" in message and repr(value) in message
    assert "prompt 4" in message and "What is 6 times 7? Answer with the num" in message


def test_evaluate_reward_wraps_exceptions():
    def fn(record, text):
        return record.fields["missing"]

    with pytest.raises(FisherSelectError, match=r"reward fn raised KeyError: 'missing' on prompt 4 \(line 5"):
        evaluate_reward(fn, rec(), "text")


def test_evaluate_reward_keeps_own_errors():
    with pytest.raises(FisherSelectError, match='no "answer" field') as err:
        evaluate_reward(numeric_match(), rec(), "42")
    assert "raised" not in str(err.value)
