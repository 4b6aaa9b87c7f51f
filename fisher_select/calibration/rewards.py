"""Reward functions: ``fn(record, response_text) -> float``.

Built-ins cover the common checks (last number equals the answer, or how close it is; a regex
matches);
anything else is a user callable named ``module:function``.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import re
import signal
import sys
import threading
from typing import Callable

from fisher_select.errors import FisherSelectError
from fisher_select.calibration.prompts import PromptRecord

RewardFn = Callable[[PromptRecord, str], float]

# A number: optional sign (only where it cannot be a minus between two operands, e.g.
# "3-5"), digits with optional comma thousands groups, optional decimals.
_NUMBER = re.compile(
    r"(?:(?<![\w.])[-\u2212])?(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d,]*\d)"
)
_PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)\}")
DEFAULT_TIMEOUT = 60.0  # seconds one call of a user reward may take before the calibration stops


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (commas as thousands separators), or None."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return float(matches[-1].replace(",", "").replace("\u2212", "-"))


def numeric_match(answer_field: str = "answer") -> RewardFn:
    """1.0 if the response's last number equals ``record.fields[answer_field]``, else 0.0."""

    def reward(record: PromptRecord, text: str) -> float:
        expected = _numeric_answer(record, answer_field)
        got = last_number(text)
        return float(got is not None and math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9))

    reward.__name__ = f"numeric_match[{answer_field}]"
    return reward


def numeric_closeness(answer_field: str = "answer") -> RewardFn:
    """``1 / (1 + |n - answer|)`` for the response's last number n, 0.0 when it has none.

    A graded reward: 1 for the right answer, 1/2 for one off, 1/11 for ten off. A small model that
    is rarely exactly right still gets rewards that vary within a prompt's samples, so almost every
    prompt carries an RL signal (with ``numeric_match`` most prompts' rewards are all 0).
    """

    def reward(record: PromptRecord, text: str) -> float:
        expected = _numeric_answer(record, answer_field, "numeric_closeness")
        got = last_number(text)
        return 0.0 if got is None else 1.0 / (1.0 + abs(got - expected))

    reward.__name__ = f"numeric_closeness[{answer_field}]"
    return reward


def _required_field(record: PromptRecord, name: str, reward: str):
    """The prompt's field ``name``, which the reward compares with; every line needs it."""
    if name not in record.fields:
        raise FisherSelectError(f'{record.describe()} has no "{name}" field for {reward}; add it to every line')
    return record.fields[name]


def _numeric_answer(record: PromptRecord, field: str, reward: str = "numeric_match") -> float:
    value = _required_field(record, field, reward)
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value.replace(",", "") if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise FisherSelectError(
            f'{record.describe()}: "{field}" is {value!r}, not a number; give a numeric answer'
        ) from None


def regex_match(pattern: str, field: str | None = None) -> RewardFn:
    """1.0 if ``re.search`` finds ``pattern`` in the response, else 0.0.

    ``{name}`` placeholders in the pattern are filled with ``record.fields[name]``,
    escaped, so the match is literal (``r"\\b{answer}\\b"``). Regex quantifiers such as
    ``{3}`` are not placeholders. ``field``, if given, must be a placeholder in the
    pattern: it states which field the pattern compares with and is checked up front.
    """
    names = set(_PLACEHOLDER.findall(pattern))
    if field is not None and field not in names:
        raise FisherSelectError(
            f"regex reward pattern {pattern!r} has no {{{field}}} placeholder; add it or drop field"
        )
    _compile(_PLACEHOLDER.sub("x", pattern), pattern)  # report a bad regex now, not per sample

    def reward(record: PromptRecord, text: str) -> float:
        filled = _PLACEHOLDER.sub(lambda m: _field_text(record, m.group(1)), pattern)
        return float(_compile(filled, pattern).search(text) is not None)

    reward.__name__ = f"regex_match[{pattern}]"
    return reward


def _field_text(record: PromptRecord, name: str) -> str:
    return re.escape(str(_required_field(record, name, "the regex reward")))


def _compile(regex: str, pattern: str) -> re.Pattern:
    try:
        return re.compile(regex)
    except re.error as err:
        raise FisherSelectError(f"regex reward pattern {pattern!r} is invalid: {err}; fix it") from None


def load_callable(spec: str) -> Callable:
    """Import ``module:function`` (``module:obj.attr`` works too), searching the cwd first."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise FisherSelectError(
            f"reward function {spec!r} is not of the form module:function; e.g. my_rewards:score"
        )
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # so a rewards file next to the user's data imports
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:  # a user module may fail in any way while importing
        raise FisherSelectError(
            f"cannot import module {module_name!r} for reward {spec!r}: "
            f"{type(err).__name__}: {err}; check the module name and that it imports"
        ) from err
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise FisherSelectError(
                f"module {module_name!r} has no attribute {attr_path!r} (from {spec!r}); "
                "check the function name"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise FisherSelectError(f"reward {spec!r} is a {type(obj).__name__}, not a function")
    return obj


_SPEC_KEYS = {
    "numeric_match": ({"answer_field"}, lambda s: numeric_match(s.get("answer_field", "answer"))),
    "numeric_closeness": ({"answer_field"}, lambda s: numeric_closeness(s.get("answer_field", "answer"))),
    "regex": ({"pattern", "field"}, lambda s: regex_match(_required(s, "pattern"), s.get("field"))),
    "callable": ({"function", "timeout"},
                 lambda s: with_timeout(load_callable(_required(s, "function")), _timeout(s))),
}


def make_reward(spec: dict) -> RewardFn:
    """Build a reward from a spec such as ``{"type": "numeric_match", "answer_field": "answer"}``."""
    kinds = ", ".join(_SPEC_KEYS)
    if not isinstance(spec, dict) or "type" not in spec:
        raise FisherSelectError(f"reward spec {spec!r} needs a \"type\" (one of {kinds})")
    kind = spec["type"]
    if kind not in _SPEC_KEYS:
        raise FisherSelectError(f"reward type {kind!r} is unknown; use one of {kinds}")
    allowed, build = _SPEC_KEYS[kind]
    unknown = set(spec) - allowed - {"type"}
    if unknown:
        raise FisherSelectError(
            f"reward spec for {kind!r} has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}"
        )
    return build(spec)


def _timeout(spec: dict) -> float:
    value = spec.get("timeout", DEFAULT_TIMEOUT)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise FisherSelectError(f"reward spec {spec!r}: 'timeout' must be a positive number of seconds, got {value!r}")
    return float(value)


class RewardTimeout(Exception):
    """Raised inside a user reward that ran past its timeout (reported by ``evaluate_reward``)."""


def with_timeout(fn: Callable, seconds: float) -> Callable:
    """``fn`` stopped by SIGALRM after ``seconds`` per call (main thread on Unix; elsewhere unguarded).

    A reward that hangs (a network call, an endless loop) would otherwise hold the calibration
    forever; a thread could not be stopped, an alarm interrupts the Python code in the call.
    """
    def guarded(record, text):
        if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
            return fn(record, text)

        def expire(signum, frame):
            raise RewardTimeout(f"took longer than its timeout of {seconds:g} s")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn(record, text)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    guarded.__name__ = getattr(fn, "__name__", repr(fn))
    return guarded


def _required(spec: dict, key: str):
    if not isinstance(spec.get(key), str) or not spec[key]:
        raise FisherSelectError(f"reward spec {spec!r} needs a string {key!r}")
    return spec[key]


def evaluate_reward(fn: RewardFn, record: PromptRecord, text: str) -> float:
    """Call ``fn`` and insist on a finite number; anything else names the prompt."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        value = fn(record, text)
    except FisherSelectError:
        raise  # already says what is wrong and where
    except RewardTimeout as err:
        raise FisherSelectError(
            f"reward {name} {err} on {record.describe()}; make it faster, or raise the reward's "
            "'timeout' (seconds) in the recipe"
        ) from None
    except Exception as err:
        raise FisherSelectError(
            f"reward {name} raised {type(err).__name__}: {err} on {record.describe()}; "
            "fix the reward function or the prompt's fields"
        ) from err
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise FisherSelectError(
            f"reward {name} returned {value!r} on {record.describe()}; "
            "it must return a finite number (float)"
        )
    return float(value)
