"""The recipe side of every objective type: its keys and what it is in words, without torch.

Each type has a config dataclass (the keys of its entry in a recipe's ``objectives``, checked by
``problems``) whose ``about()`` says what the objective it builds is: its signal and scale
formulas, data needs, caveats and sample needs (an ``About``). The objective classes (``rl``,
``distill``, ``sft``) take their words from the same ``About`` constants, so ``recipes``,
``recipes show`` and recipe validation read them here without loading torch.
"""

from __future__ import annotations

import math

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from fisher_select.calibration.prompts import load_demonstrations
from fisher_select.calibration.rewards import make_reward
from fisher_select.calibration.config import TeacherConfig
from fisher_select.errors import FisherSelectError
from fisher_select.fields import build_dataclass


@dataclass(frozen=True)
class About:
    """An objective in words (MATH.md): its signal a(x, y), its scale S, the data it needs, its caveats."""

    kind: str  # the recipe type
    signal_formula: str
    scale_formula: str
    data_needs: str
    caveats: tuple[str, ...] = ()
    min_samples_per_prompt: int = 1
    #: Token-level objectives fill ``GroupSignal.token_signal`` and are bounded with the
    #: token-level Fisher.
    token_level: bool = False

    def describe(self, name: str | None) -> dict:
        """The report fields of an objective called ``name`` (default: the type)."""
        return {
            "name": name or self.kind,
            "type": self.kind,
            "signal": self.signal_formula,
            "scale": self.scale_formula,
            "data": self.data_needs,
            "caveats": list(self.caveats),
            "token_level": self.token_level,
        }


NAME_HELP = "name in reports (default: the type)"


# ---------------------------------------------------------------------------
# rl: on-policy RL (objectives.rl)

RL = About(
    kind="rl",
    signal_formula="r - mean_{j!=k} r_j  (leave-one-out centred reward)",
    scale_formula="E_x Var_pi(r|x)  (unbiased within-prompt variance, divisor K-1)",
    data_needs="prompts and a reward: built-in numeric/regex match or a user callable module:function",
    caveats=(
        "S is estimated from K samples per prompt; with few samples or rare rewards it is noisy.",
        "Prompts whose sampled rewards are all equal contribute no signal (counted in the report).",
    ),
    min_samples_per_prompt=2,
)
RL_GRPO = dataclasses.replace(  # normalize: grpo
    RL,
    signal_formula="(r - mean_{j!=k} r_j) / std(r|x)  (leave-one-out, GRPO std-normalised)",
    scale_formula="E_x[Var(r|x) / std(r|x)^2] = fraction of prompts whose rewards vary",
)


@dataclass
class RLConfig:
    """Recipe keys of an ``rl`` objective."""

    reward: dict = field(metadata={"help": 'the reward: {"type": "numeric_match" | "regex" | "callable", ...}; '
                                           'callable: "function": "module:function" (runs that code) and '
                                           '"timeout": seconds per call (default 60)'})
    normalize: str = field(default="none", metadata={
        "help": '"none" (a = r - rbar) or "grpo" (advantages divided by the group\'s reward std)'})
    unfinished_reward: float | None = field(default=None, metadata={
        "help": "the reward of a response cut at max_new_tokens, in place of the reward function's (e.g. 0: "
                "a policy gains nothing by running to the limit); unset: a cut response is scored like any other. "
                "A rollout file's rewards are used as given"})
    name: str | None = field(default=None, metadata={"help": NAME_HELP})

    def problems(self) -> list[str]:
        out = []
        if self.normalize not in ("none", "grpo"):
            out.append(f"normalize: expected 'none' or 'grpo', got {self.normalize!r}")
        u = self.unfinished_reward
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not math.isfinite(u)):
            out.append(f"unfinished_reward: expected a finite number (e.g. 0) or no value, got {u!r}")
        try:
            make_reward(self.reward)
        except FisherSelectError as exc:
            out.append(f"reward: {exc}")
        return out

    def about(self) -> About:
        return RL_GRPO if self.normalize == "grpo" else RL


# ---------------------------------------------------------------------------
# opd-pg, opd-full: on-policy distillation from a teacher (objectives.distill)

OPD_PG = About(
    kind="opd-pg",
    signal_formula="sigma - mean_{j!=k} sigma_j,  sigma = log T(y|x) - log pi(y|x)  (leave-one-out)",
    scale_formula="E_x Var_pi(sigma|x)  (unbiased within-prompt variance, divisor K-1)",
    data_needs=("prompts and a teacher with the model's tokenizer: another model, or the model itself "
                "with privileged context (e.g. the reference answer from the prompt's fields)"),
    caveats=(
        "S is estimated from K samples per prompt; sequence log-ratios are heavy-tailed, so few samples "
        "give a noisy S.",
        "A teacher that gives some sampled response probability 0 makes S infinite (no bound).",
    ),
    min_samples_per_prompt=2,
)
OPD_FULL = About(
    kind="opd-full",
    signal_formula="A_t = log pi(y_t|s_t) - log T(y_t|s_t) - KL_t,  KL_t = KL(pi(.|s_t) || T(.|s_t))  (per token)",
    scale_formula=("S_tok = E_y sum_t Var_{v~pi(.|s_t)}(log pi(v|s_t) - log T(v|s_t))  (exact over the vocabulary; "
                   "sampled-token estimate E_y sum_t A_t^2 also reported); bound uses the token-level Fisher F^tok"),
    data_needs=("prompts and a teacher with the model's tokenizer and vocabulary size; both models' full "
                "next-token distributions at every visited state"),
    caveats=(
        "The bound uses the token-level Fisher F^tok = E sum_t h_t^2 (Rademacher-sign estimate; its noise "
        "falls with sign_draws). Under the model's own sampling its expectation equals the sequence Fisher F "
        "(cross-token terms vanish), so the two estimates differ only by noise.",
        "A teacher with probability 0 for a token the model can produce makes KL and S infinite (no bound).",
    ),
    token_level=True,
)

TEACHER_HELP = 'the teacher, as keys: model ("self" or a model spec), system_prompt, user_template'


@dataclass
class OPDPGConfig:
    """Recipe keys of an ``opd-pg`` objective."""

    teacher: dict = field(metadata={"help": TEACHER_HELP})
    name: str | None = field(default=None, metadata={"help": NAME_HELP})

    def problems(self) -> list[str]:
        return _teacher_problems(self.teacher)

    def about(self) -> About:
        return OPD_PG


@dataclass
class OPDFullConfig:
    """Recipe keys of an ``opd-full`` objective."""

    teacher: dict = field(metadata={"help": TEACHER_HELP})
    sign_draws: int = field(default=1, metadata={
        "help": "Rademacher sign draws per sample for the token-level Fisher (more: less noise, more backwards)"})
    name: str | None = field(default=None, metadata={"help": NAME_HELP})

    def problems(self) -> list[str]:
        out = _teacher_problems(self.teacher)
        if self.sign_draws < 1:
            out.append(f"sign_draws: must be at least 1, got {self.sign_draws}")
        return out

    def about(self) -> About:
        return OPD_FULL


def _teacher_problems(data: dict, key: str = "teacher") -> list[str]:
    errors: list[str] = []
    cfg = build_dataclass(TeacherConfig, data, key, errors)
    return errors + [f"{key}: {p}" for p in (cfg.problems() if cfg else [])]


# ---------------------------------------------------------------------------
# sft: SFT toward a demonstrator density or from demonstrations (objectives.sft)

SFT = About(
    kind="sft",
    signal_formula="w - 1,  w = nu(y|x) / pi(y|x)  (log w in fp64)",
    scale_formula="E_pi[(w - 1)^2] = chi-square(nu || pi)",
    data_needs=("prompts and a demonstrator density nu: another model with the same tokenizer, "
                "or the model itself under another context (system prompt, privileged fields)"),
    caveats=(
        "S is an importance-weighted estimate: when a few samples carry most of the weight (small "
        "effective sample size) it is unreliable and usually too small; see the weight diagnostics.",
        "Where nu puts mass on responses the model almost never samples, chi-square is large and the "
        "bound loose (or vacuous).",
    ),
)
SFT_DEMONSTRATIONS = About(
    kind="sft",
    signal_formula="w - 1 (not computable: no density for the demonstrations)",
    scale_formula="chi-square(nu || pi): unknown; reported: noisy lower bound max_i (E_nu h_i)^2 / F_i",
    data_needs=("prompts and a demonstrations JSONL file: one line per demonstration with the "
                "\"prompt\" (or \"messages\") of a prompts-file line and a \"response\" string"),
    caveats=(
        "S is unknown: bounds are sqrt(F) (same ranking, no absolute scale); thresholds on |g| need S.",
        "The chi-square lower bound is a max over all coordinates of noisy ratios: biased upwards by "
        "noise, and only a lower bound even when exact.",
        "F comes from the model's own samples: coordinates the demonstrations touch but the samples "
        "rarely do (e.g. embedding rows of unusual tokens) get an underestimated F.",
    ),
)


@dataclass
class SFTConfig:
    """Recipe keys of an ``sft`` objective: exactly one of ``demonstrator`` and ``demonstrations``."""

    demonstrator: dict | None = field(default=None, metadata={
        "help": 'a density nu, as teacher keys: model ("self" or a model spec), system_prompt, user_template'})
    demonstrations: str | None = field(default=None, metadata={
        "help": "JSONL file of prompt + response lines (no density), relative to the recipe"})
    append_eos: bool = field(default=True, metadata={
        "help": "end each demonstration with EOS, as a finished model sample does"})
    name: str | None = field(default=None, metadata={"help": NAME_HELP})

    def resolve_paths(self, base_dir: Path) -> None:
        """config.parse_recipe: a relative demonstrations file is relative to the recipe file."""
        if self.demonstrations is not None and not Path(self.demonstrations).is_absolute():
            self.demonstrations = str((Path(base_dir) / self.demonstrations).resolve())

    def problems(self) -> list[str]:
        if (self.demonstrator is None) == (self.demonstrations is None):
            return ["give exactly one of 'demonstrator' (a density) and 'demonstrations' (a file)"]
        return [] if self.demonstrator is None else _teacher_problems(self.demonstrator, "demonstrator")

    def check_files(self) -> None:
        """Read the demonstrations file as the objective will (raises FisherSelectError naming the problem)."""
        if self.demonstrations is not None:
            load_demonstrations(Path(self.demonstrations))

    def about(self) -> About:
        return SFT if self.demonstrator is not None else SFT_DEMONSTRATIONS
