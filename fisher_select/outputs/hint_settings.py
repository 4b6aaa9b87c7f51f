"""Defaults and help of the LoRA hint settings, once: ``lora_hints`` and ``fisher-select lora`` read them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraHintSettings:
    """How LoRA targets are chosen and a rank budget is split among them."""

    coverage: float = field(default=0.9, metadata={
        "help": "the fewest modules holding this fraction of the eligible Fisher mass (used when top_n is not given)"})
    top_n: int | None = field(default=None, metadata={"help": "the N modules with the most Fisher mass"})
    mean_rank: int = field(default=8, metadata={
        "help": "rank per target when no total_rank is given (total_rank = mean_rank * targets)", "min": 1})
    total_rank: int | None = field(default=None, metadata={
        "help": "sum of all ranks, split in proportion to Fisher mass (default mean_rank per target)", "min": 1})
    rank_step: int = field(default=4, metadata={"help": "ranks are multiples of this step", "min": 1})
    min_rank: int | None = field(default=None, metadata={"help": "smallest rank (default the rank step)", "min": 1})
    max_rank: int | None = field(default=None, metadata={
        "help": "largest rank (default min(out, in) per module)", "min": 1})
    alpha_ratio: float = field(default=2.0, metadata={"help": "lora_alpha = alpha_ratio * r for every module"})
