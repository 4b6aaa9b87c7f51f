"""Objectives: how to get the signal a(x, y) for sampled responses and estimate its scale S.

Every objective sees the same groups of K responses per prompt sampled from the model, so
the model Fisher is shared and only the signal differs (MATH.md). An objective's ``signals``
returns, for one group, the per-sample signal used for the gradient estimate
``g_hat = mean_n a_n h_n`` and a per-group contribution to the scale ``S = E[a^2]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Group:
    """K responses to one prompt, sampled from the model itself."""

    record: object  # prompts.PromptRecord
    prompt_ids: list[int]
    responses: list[list[int]]
    texts: list[str]
    logprobs: list[float]  # log pi(y|x), fp32 summed, from sampling
    ended: list[bool] = field(default_factory=list)  # False: truncated at max_new_tokens
    signals: dict = field(default_factory=dict)  # objective name -> (K,) signal
    values: dict = field(default_factory=dict)  # objective name -> GroupSignal


@dataclass
class GroupSignal:
    """One group's signals (K,) and its contribution to the scale estimate."""

    signal: torch.Tensor  # (K,) float64
    scale_term: float  # this group's estimate of E[a^2 | x]
    values: list[float] = field(default_factory=list)  # raw per-sample value (reward, sigma, ...)
    extra: dict = field(default_factory=dict)


@dataclass
class Context:
    """What objectives may need beyond the groups: the model, its tokenizer, the device."""

    model: object
    tokenizer: object
    device: object = "cpu"


class Objective:
    """Base class. Subclasses set the descriptive fields and implement ``group_signal``."""

    kind = "objective"
    signal_formula = ""
    scale_formula = ""
    data_needs = ""
    caveats: tuple[str, ...] = ()
    min_samples_per_prompt = 1
    #: Token-level objectives put per-token signals in ``GroupSignal.extra["token_signal"]``
    #: (a list of (L_k,) tensors) and are bounded with the token-level Fisher.
    token_level = False
    sign_draws = 1
    #: Attributes holding per-group statistics. When the ranks of a distributed calibration
    #: merge, lists are concatenated (in rank order) and counters summed.
    statistics: tuple[str, ...] = ("_terms", "_zero_groups")

    def __init__(self, name: str | None = None):
        self.name = name or self.kind
        self._terms: list[float] = []
        self._zero_groups = 0

    def prepare(self, ctx: Context, prompts: list) -> None:
        """Before sampling: load a teacher, check data against the prompts (raise FisherSelectError)."""

    def finish(self, cal, ctx: Context) -> dict:
        """After calibration: extra summary fields (may replace this objective's grad_estimate)."""
        return {}

    def group_signal(self, group: Group, ctx: Context) -> GroupSignal:
        raise NotImplementedError

    def signals(self, group: Group, ctx: Context) -> GroupSignal:
        """Signals for one group; also records the group's scale term."""
        out = self.group_signal(group, ctx)
        self._terms.append(out.scale_term)
        self._zero_groups += int(out.scale_term == 0.0)
        return out

    def statistics_state(self) -> dict:
        return {name: getattr(self, name) for name in self.statistics}

    def merge_statistics(self, states: list[dict]) -> None:
        """Replace this rank's statistics by the merge of every rank's ``statistics_state()``."""
        for name in self.statistics:
            values = [state[name] for state in states]
            setattr(self, name, [v for part in values for v in part] if isinstance(values[0], list) else sum(values))

    @property
    def used(self) -> bool:
        """True once a calibration recorded statistics here (instances are single-use)."""
        return bool(self._terms)

    @property
    def signal_scale(self) -> float | None:
        """S estimate: mean over prompts of the per-prompt terms (None if no group was seen)."""
        return float(sum(self._terms) / len(self._terms)) if self._terms else None

    def scale_stderr(self) -> float | None:
        """Standard error of the S estimate across prompts."""
        n = len(self._terms)
        if n < 2:
            return None
        t = torch.tensor(self._terms, dtype=torch.float64)
        return float(t.std(unbiased=True) / n**0.5)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "type": self.kind,
            "signal": self.signal_formula,
            "scale": self.scale_formula,
            "data": self.data_needs,
            "caveats": list(self.caveats),
            "token_level": self.token_level,
        }

    def summary(self) -> dict:
        """Report fields after calibration."""
        return {
            **self.describe(),
            "signal_scale": self.signal_scale,
            "signal_scale_stderr": self.scale_stderr(),
            "prompts_without_signal": self._zero_groups,
        }


def leave_one_out(values: torch.Tensor) -> torch.Tensor:
    """a_k = v_k - mean_{j != k} v_j for one prompt's K values (unbiased centring, K >= 2)."""
    k = values.numel()
    return (values - (values.sum() - values) / (k - 1)).double()


def unbiased_variance(values: torch.Tensor) -> float:
    """Within-prompt variance with the K - 1 divisor."""
    return float(values.double().var(unbiased=True))
