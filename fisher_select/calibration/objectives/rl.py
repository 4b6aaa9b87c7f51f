"""On-policy RL: signal ``r - rbar(x)``, scale ``E_x Var_pi(r | x)``; GRPO's std-normalised variant."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fisher_select.calibration.objectives.registry import register_objective
from fisher_select.errors import FisherSelectError
from fisher_select.calibration.rewards import evaluate_reward, make_reward
from fisher_select.calibration.rollouts import given_values
from fisher_select.calibration.objectives.base import Context, Group, GroupSignal, Objective, leave_one_out, unbiased_variance


class RLObjective(Objective):
    """Reward-driven on-policy RL (REINFORCE / PPO-style first step, or GRPO with ``normalize``).

    ``normalize="none"``: a = r - rbar(x), S = E_x Var(r|x) (unbiased within-prompt variance).
    ``normalize="grpo"``: the trainer divides advantages by the group's reward std, so
    a = (r - rbar(x)) / std(r|x) and S = E_x[Var/std^2], i.e. the fraction of prompts whose
    rewards vary (prompts with constant rewards carry no signal either way).
    """

    kind = "rl"
    data_needs = "prompts and a reward: built-in numeric/regex match or a user callable module:function"
    min_samples_per_prompt = 2
    caveats = (
        "S is estimated from K samples per prompt; with few samples or rare rewards it is noisy.",
        "Prompts whose sampled rewards are all equal contribute no signal (counted in the report).",
    )

    def __init__(self, reward, normalize: str = "none", name: str | None = None, reward_spec: dict | None = None):
        super().__init__(name)
        self.reward, self.normalize = reward, normalize
        self.reward_spec = reward_spec or {}
        if normalize == "grpo":
            self.signal_formula = "(r - mean_{j!=k} r_j) / std(r|x)  (leave-one-out, GRPO std-normalised)"
            self.scale_formula = "E_x[Var(r|x) / std(r|x)^2] = fraction of prompts whose rewards vary"
        else:
            self.signal_formula = "r - mean_{j!=k} r_j  (leave-one-out centred reward)"
            self.scale_formula = "E_x Var_pi(r|x)  (unbiased within-prompt variance, divisor K-1)"

    def signals(self, group: Group, ctx: Context) -> GroupSignal:
        given = given_values(group, "reward", self.name)  # a rollout file's rewards win over the reward function
        rewards = torch.tensor(
            given if given is not None else [evaluate_reward(self.reward, group.record, t) for t in group.texts],
            dtype=torch.float64,
        )
        var = unbiased_variance(rewards)
        signal = leave_one_out(rewards)
        scale_term = var
        if self.normalize == "grpo":
            std = var**0.5
            signal = signal / std if std > 0 else torch.zeros_like(signal)
            scale_term = 1.0 if std > 0 else 0.0
        return GroupSignal(signal, scale_term, rewards.tolist())

    def describe(self) -> dict:
        return {**super().describe(), "normalize": self.normalize, "reward": self.reward_spec}


@dataclass
class RLConfig:
    """Recipe keys of an ``rl`` objective."""

    reward: dict = field(metadata={"help": 'the reward: {"type": "numeric_match" | "regex" | "callable", ...}; '
                                           'callable: "function": "module:function" (runs that code) and '
                                           '"timeout": seconds per call (default 60)'})
    normalize: str = field(default="none", metadata={
        "help": '"none" (a = r - rbar) or "grpo" (advantages divided by the group\'s reward std)'})
    name: str | None = field(default=None, metadata={"help": "name in reports (default: the type)"})

    def problems(self) -> list[str]:
        out = []
        if self.normalize not in ("none", "grpo"):
            out.append(f"normalize: expected 'none' or 'grpo', got {self.normalize!r}")
        try:
            make_reward(self.reward)
        except FisherSelectError as exc:
            out.append(f"reward: {exc}")
        return out


def build_rl(cfg: RLConfig, base_dir=None) -> RLObjective:
    return RLObjective(make_reward(cfg.reward), cfg.normalize, cfg.name, reward_spec=cfg.reward)


register_objective("rl", RLConfig, build_rl)
