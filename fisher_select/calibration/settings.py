"""The calibration settings ``calibrate()`` takes and a recipe sets: defaults and help, once.

``RecipeConfig`` inherits these fields (a recipe's top-level keys), ``calibrate`` takes the config
whole, and the CLI's flags are generated from the same fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fisher_select.errors import FisherSelectError
from fisher_select.fields import build_dataclass


@dataclass
class CalibrationConfig:
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
    max_batch_tokens: int | None = field(default=None, metadata={
        "help": "most tokens (rows x padded length) one scoring forward+backward holds; a longer batch is scored in "
                "micro-batches of rows of similar length (same sums up to fp32 rounding; batch_size stays the most "
                "rows); default: auto, about 2 GiB of activations on CPU and 16 GiB on CUDA, from the model's layer "
                "widths (docs/SCALING.md)",
        "min": 1,
    })
    compile: bool = field(default=False, metadata={
        "help": "reduce each per-sample gradient piece (squares, score sums, signal sums) in one torch.compile'd "
                "kernel that reads it once; compiles on the first batch (~20 s on a small CPU), pays off on long "
                "runs (bench/bench_engine.py --modes compiled measures it)",
    })
    shard: str = field(default="none", metadata={
        "help": "fsdp: under torchrun, shard the weights (each decoder layer, FSDP2) and the accumulators over the "
                "ranks; every rank samples every prompt in step, the ranks split the scoring, rank 0 writes the run "
                "(same result as one process, split halves and checkpoints included; sequence-level objectives only, "
                "no --accumulate-on cpu); "
                "none: each rank holds the whole model (data parallel under torchrun)",
        "choices": ("none", "fsdp"),
    })
    truncate_prompts: bool = field(default=False, metadata={
        "help": "cut prompts that do not fit the model's context with max_new_tokens to their last tokens "
                "(counted in the report); default: refuse them before any sampling",
    })
    accumulators: str = field(default="full", metadata={
        "help": "which fp32 accumulators the scoring keeps (each 4 bytes per parameter): full = squares F + "
                "one signal sum g per objective + score sums (score-mean and autograd checks); gradient = F + g; "
                "fisher = F alone (bounds need only F and S; no gradient estimate, no checks that need score sums)",
        "choices": ("full", "gradient", "fisher"),
    })
    modules: str | None = field(default=None, metadata={
        "help": "regular expression searched in each parameter name (as model.named_parameters() gives it): "
                "accumulate F only for the matching parameters, e.g. 'layers\\.(1[6-9]|2[0-9])\\.' or "
                "'q_proj|v_proj'; layers holding none are not hooked (default: every parameter)",
    })
    accumulate_on: str = field(default="device", metadata={
        "help": "where the accumulators live: device (beside the weights) or cpu (host memory, pinned with CUDA; "
                "for models whose fp32 accumulators do not fit beside the weights, at the cost of a copy per piece)",
        "choices": ("device", "cpu"),
    })
    stability: bool = field(default=True, metadata={
        "help": "keep the split-half and per-batch diagnostics of the report (stability of the module ranking, "
                "standard errors of F mass): one more fp32 accumulator, 4 bytes per parameter; turn off for big "
                "models where every accumulator counts",
    })

    @classmethod
    def with_fields(cls, config: "CalibrationConfig | None", fields: dict) -> "CalibrationConfig":
        """``config`` (default: the defaults) with ``fields`` replaced, every field checked; one error
        lists every problem (unknown names, wrong types, values out of range)."""
        base = config if config is not None else cls()
        own = {f.name for f in dataclasses.fields(cls)}
        data = {name: getattr(base, name) for name in own} | fields
        errors: list[str] = []
        built = build_dataclass(cls, data, "", errors)
        if errors:
            raise FisherSelectError("invalid calibration settings: " + "; ".join(errors))
        return built

    def calibration_config(self) -> "CalibrationConfig":
        """Just the calibration fields (of a ``RecipeConfig``, say)."""
        return CalibrationConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(CalibrationConfig)})

