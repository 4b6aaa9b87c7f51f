"""The calibration settings ``calibrate()`` takes and a recipe sets: defaults and help, once."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CalibrationSettings:
    """How many responses are drawn, how long they may be, the seed, and the batch size."""

    samples_per_prompt: int = field(default=4, metadata={
        "help": "responses K sampled per prompt (RL and other centred signals need at least 2)",
        "min": 1,
    })
    max_new_tokens: int = field(default=64, metadata={
        "help": "longest response in tokens; a response cut here has no EOS (the report counts them)",
        "min": 1,
    })
    seed: int = field(default=0, metadata={
        "help": "seed of the sampling: same seed and batch size, same responses",
    })
    batch_size: int = field(default=8, metadata={
        "help": "responses per sampling and backward batch, whole prompts of K at a time; trades memory for speed",
        "min": 1,
    })
