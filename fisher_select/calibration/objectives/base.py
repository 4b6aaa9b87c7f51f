"""Objectives: how to get the signal a(x, y) for sampled responses and estimate its scale S.

Every objective sees the same groups of K responses per prompt sampled from the model, so
the model Fisher is shared and only the signal differs (MATH.md). An objective instance is
configuration plus pure methods (reusable across calibrations):

- ``signals(group, ctx) -> GroupSignal``: one group's per-sample signal a_n (the gradient estimate
  is ``mean_n a_n h_n``), its scale term (this prompt's estimate of ``E[a^2 | x]``) and, for
  token-level objectives, per-token signals;
- ``statistics_type``: a ``Statistics`` dataclass the *calibrator* holds, folding group signals in
  with ``add`` and combining ranks or resumed runs with ``merge``;
- ``signal_scale(stats)``, ``scale_stderr(stats)``, ``summary(stats)``: results from statistics;
- optionally ``extra_rows(ctx)`` + ``extra_result(mean_score, fisher)``: rows the calibrator scores
  with its own scoring path (SFT from demonstrations), and what their mean score gives.

What an objective is in words (formulas, data needs, caveats) is its ``about``, an ``About`` from
``config``, beside its config dataclass: both without torch, so a recipe is read and explained
without loading it. A new objective: a subclass, its Statistics (if it needs more than the scale
terms), an ``About`` and a config dataclass whose ``about()`` returns it, and an entry in
``registry.OBJECTIVE_TYPES``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

import torch

from fisher_select.calibration.objectives.config import About


@dataclass
class Group:
    """K responses to one prompt, sampled from the model itself."""

    record: object  # prompts.PromptRecord
    prompt_ids: list[int]
    responses: list[list[int]]
    texts: list[str]
    logprobs: list[float]  # log pi(y|x), fp32 summed, from sampling
    ended: list[bool] = field(default_factory=list)  # False: truncated at max_new_tokens
    rollout: list = field(default_factory=list)  # from a rollout file: per response its rollouts.RolloutRow


@dataclass
class GroupSignal:
    """One group's signals (K,) and its contribution to the scale estimate."""

    signal: torch.Tensor  # (K,) float64 sequence-level signal (zeros for token-level objectives)
    scale_term: float  # this group's estimate of E[a^2 | x]
    values: list[float] = field(default_factory=list)  # raw per-sample value (reward, sigma, ...)
    token_signal: list[torch.Tensor] | None = None  # token-level objectives: per response (L_k,) float64
    prompt_index: int | None = None  # the group's PromptRecord.index, for per-prompt diagnostics


@dataclass
class Statistics:
    """What an objective needs from the groups seen so far: plain lists and counts (serialisable).

    Every field is a list of per-group entries or a count. ``merge`` concatenates lists (self's
    groups first) and sums counts, so it is associative and the merge of two parts' statistics
    equals the statistics of their groups in sequence (ranks in rank order; a resumed run after
    its checkpoint). Subclasses add fields and extend ``add``; they must keep to lists and counts.
    """

    terms: list[float] = field(default_factory=list)  # per group: estimate of E[a^2 | x]
    zero_groups: int = 0  # groups whose scale term is exactly 0 (no signal)

    def add(self, signal: GroupSignal) -> None:
        """Fold one group in (in place: the calibrator owns this object)."""
        self.terms.append(signal.scale_term)
        self.zero_groups += int(signal.scale_term == 0.0)

    def merge(self, other: "Statistics") -> "Statistics":
        """A new Statistics of self's groups followed by other's (neither is changed)."""
        if type(other) is not type(self):
            raise TypeError(f"cannot merge {type(self).__name__} with {type(other).__name__}")
        # list + list concatenates, int + int sums: the two kinds of field allowed here
        return type(self)(**{f.name: copy.deepcopy(getattr(self, f.name) + getattr(other, f.name))
                             for f in fields(self)})

    def to_dict(self) -> dict:
        """Plain lists and ints (JSON-able with allow_nan: scale terms may be inf or nan)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "Statistics":
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise ValueError(f"{cls.__name__}: expected keys {sorted(names)}, got {sorted(data)}")
        return cls(**copy.deepcopy(data))


@dataclass
class ScoringRow:
    """A prompt + response row to score without a signal: ``ids[start:]`` is the response."""

    ids: list[int]
    start: int


@dataclass
class ExtraResult:
    """What an objective makes of the mean score of its extra rows."""

    grad_estimate: dict[str, torch.Tensor] | None  # replaces the objective's gradient estimate when set
    summary: dict  # fields added to the objective's summary


@dataclass
class Context:
    """What objectives may need beyond the groups: the model, its tokenizer, the device."""

    model: object
    tokenizer: object
    device: object = "cpu"


def _about(name: str) -> property:
    """An ``About`` field read through the objective (``o.kind``, ``o.token_level``)."""
    return property(lambda self: getattr(self.about, name), doc=f"``about.{name}``")


class Objective:
    """Base class. Subclasses set ``about`` (what they are, in words) and implement ``signals``."""

    about = About(kind="objective", signal_formula="", scale_formula="", data_needs="")
    kind = _about("kind")
    signal_formula = _about("signal_formula")
    scale_formula = _about("scale_formula")
    data_needs = _about("data_needs")
    caveats = _about("caveats")
    min_samples_per_prompt = _about("min_samples_per_prompt")
    token_level = _about("token_level")
    sign_draws = 1
    statistics_type: type[Statistics] = Statistics

    def __init__(self, name: str | None = None):
        self.name = name or self.kind

    def prepare(self, ctx: Context, prompts: list) -> None:
        """Before sampling, in every calibration: load a teacher, check data against the prompts
        (raise FisherSelectError). Resolves resources only; it must not depend on earlier runs."""

    def signals(self, group: Group, ctx: Context) -> GroupSignal:
        raise NotImplementedError

    def new_statistics(self) -> Statistics:
        return self.statistics_type()

    def extra_rows(self, ctx: Context) -> list[ScoringRow] | None:
        """Rows the calibrator should score (plain scores, no signal) after sampling; None: none."""
        return None

    def extra_result(self, mean_score: dict[str, torch.Tensor], fisher: dict[str, torch.Tensor]) -> ExtraResult:
        """From the mean score of ``extra_rows`` and the model Fisher: gradient estimate and summary fields."""
        raise NotImplementedError(f"{type(self).__name__} declares no extra rows")

    def signal_scale(self, stats: Statistics) -> float | None:
        """S estimate: mean over prompts of the per-prompt terms (None if no group was seen)."""
        return float(sum(stats.terms) / len(stats.terms)) if stats.terms else None

    def scale_stderr(self, stats: Statistics) -> float | None:
        """Standard error of the S estimate across prompts."""
        n = len(stats.terms)
        if n < 2:
            return None
        t = torch.tensor(stats.terms, dtype=torch.float64)
        return float(t.std(unbiased=True) / n**0.5)

    def describe(self) -> dict:
        return self.about.describe(self.name)

    def summary(self, stats: Statistics) -> dict:
        """Report fields after calibration."""
        return {
            **self.describe(),
            "signal_scale": self.signal_scale(stats),
            "signal_scale_stderr": self.scale_stderr(stats),
            "prompts_without_signal": stats.zero_groups,
        }


def leave_one_out(values: torch.Tensor) -> torch.Tensor:
    """a_k = v_k - mean_{j != k} v_j for one prompt's K values (unbiased centring, K >= 2)."""
    k = values.numel()
    return (values - (values.sum() - values) / (k - 1)).double()


def unbiased_variance(values: torch.Tensor) -> float:
    """Within-prompt variance with the K - 1 divisor."""
    return float(values.double().var(unbiased=True))
