"""On-policy RL: signal ``r - rbar(x)``, scale ``E_x Var_pi(r | x)``; GRPO's std-normalised variant."""

from __future__ import annotations

import torch

from fisher_select.calibration.objectives.config import RL, RL_GRPO, RLConfig
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

    about = RL

    def __init__(self, reward, normalize: str = "none", name: str | None = None, reward_spec: dict | None = None,
                 unfinished_reward: float | None = None):
        self.about = RL_GRPO if normalize == "grpo" else RL
        super().__init__(name)
        self.reward, self.normalize = reward, normalize
        self.reward_spec = reward_spec or {}
        self.unfinished_reward = None if unfinished_reward is None else float(unfinished_reward)

    def signals(self, group: Group, ctx: Context) -> GroupSignal:
        given = given_values(group, "reward", self.name)  # a rollout file's rewards win over the reward function
        rewards = torch.tensor(given if given is not None else self._rewards(group), dtype=torch.float64)
        var = unbiased_variance(rewards)
        signal = leave_one_out(rewards)
        scale_term = var
        if self.normalize == "grpo":
            std = var**0.5
            signal = signal / std if std > 0 else torch.zeros_like(signal)
            scale_term = 1.0 if std > 0 else 0.0
        return GroupSignal(signal, scale_term, rewards.tolist())

    def _rewards(self, group: Group) -> list[float]:
        """Each response's reward; a cut one (``ended`` False) gets ``unfinished_reward`` when it is set. The
        reward is then still a function of (x, y), so the bound holds for it unchanged."""
        ended = group.ended or [True] * len(group.texts)
        return [evaluate_reward(self.reward, group.record, t) if done or self.unfinished_reward is None
                else self.unfinished_reward for t, done in zip(group.texts, ended)]

    def describe(self) -> dict:
        out = {**super().describe(), "normalize": self.normalize, "reward": self.reward_spec}
        if self.unfinished_reward is not None:
            out["unfinished_reward"] = self.unfinished_reward
        return out


def build_rl(cfg: RLConfig, base_dir=None) -> RLObjective:
    return RLObjective(make_reward(cfg.reward), cfg.normalize, cfg.name, reward_spec=cfg.reward,
                       unfinished_reward=cfg.unfinished_reward)
