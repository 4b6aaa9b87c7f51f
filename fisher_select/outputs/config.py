"""The configs of the outputs a command's flags set: how LoRA targets and axolotl's modules are chosen.

Defaults and help once, in the fields (``fisher_select.fields``), and without torch or PEFT, so
the flags of ``lora`` and ``export`` (their help and their errors) answer without loading them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fisher_select.errors import FisherSelectError
from fisher_select.fields import build_dataclass

# The module masses targets rank by (outputs.targets): the bound mass, sum of sqrt(F), or the Fisher mass, sum of F.
RANKINGS = ("bound_mass", "fisher_mass")
DEFAULT_RANKING = "bound_mass"
DEFAULT_COVERAGE = 0.9
# What a mask's --top ranks coordinates by (outputs.masks). "bound": sqrt(F S), the default.
# "grad_estimate": |g_hat|, the calibration's own Monte-Carlo gradient of the objective; in the SFT
# outcome study at 1% density under AdamW it recovered slightly more of full fine-tuning's gain than
# the bound, which won at 0.01% and 0.1% (docs/OUTCOMES.md). It ranks single coordinates: --top only.
SCORES = ("bound", "grad_estimate")


@dataclass
class LoraHintConfig:
    """How LoRA targets are chosen and a rank budget is split among them."""

    coverage: float | None = field(default=None, metadata={
        "help": "the fewest modules holding this fraction of the eligible modules' mass (by --ranking); "
                f"default {DEFAULT_COVERAGE} when top_n is not given"})
    top_n: int | None = field(default=None, metadata={"help": "the N modules with the most mass (by --ranking)"})
    ranking: str = field(default=DEFAULT_RANKING, metadata={
        "help": "module mass that ranks targets and splits ranks: bound_mass = sum of sqrt(F) (tracks module "
                "movement), fisher_mass = sum of F", "choices": RANKINGS})
    mean_rank: int = field(default=8, metadata={
        "help": "rank per target when no total_rank is given (total_rank = mean_rank * targets)", "min": 1})
    total_rank: int | None = field(default=None, metadata={
        "help": "sum of all ranks, split in proportion to the ranking mass (default mean_rank per target)", "min": 1})
    rank_step: int = field(default=4, metadata={"help": "ranks are multiples of this step", "min": 1})
    min_rank: int | None = field(default=None, metadata={"help": "smallest rank (default the rank step)", "min": 1})
    max_rank: int | None = field(default=None, metadata={
        "help": "largest rank (default min(out, in) per module)", "min": 1})
    alpha_ratio: float = field(default=2.0, metadata={"help": "lora_alpha = alpha_ratio * r for every module"})

    @classmethod
    def with_fields(cls, config: "LoraHintConfig | None", fields: dict) -> "LoraHintConfig":
        """``config`` with ``fields`` replaced, every field checked (one error lists every problem)."""
        base = config if config is not None else cls()
        data = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls)} | fields
        errors: list[str] = []
        built = build_dataclass(cls, data, "", errors)
        if errors:
            raise FisherSelectError("invalid LoRA hint settings: " + "; ".join(errors))
        return built


@dataclass
class UnfreezeConfig:
    """How ``fisher-select export --format axolotl`` chooses the modules to train."""

    bound_mass: float | None = field(default=None, metadata={
        "help": "the fewest modules holding this share of the model's bound mass (sum of sqrt(F)); "
                "default 0.5 when --top-modules is not given"})
    top_modules: int | None = field(default=None, metadata={
        "help": "the N modules with the most bound mass", "min": 1})


DEFAULT_BOUND_MASS = 0.5
