"""The calibration configs ``calibrate()`` takes and a recipe sets: defaults and help, once.

``RecipeConfig`` inherits these fields (a recipe's top-level keys), ``calibrate`` takes the config
whole, and the CLI's flags are generated from the same fields. The sampling keys
(``SamplingConfig``) and a teacher's or demonstrator's keys (``TeacherConfig``) live here too.
Nothing here needs torch, so a recipe is read, checked and explained without loading it.
"""

from __future__ import annotations

import dataclasses
import string
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
                "ranks; each rank samples and scores its own prompts with its own seed stream, forwards in lockstep, "
                "rank 0 writes the run (same result as data parallel on as many ranks; checkpoints resume on as many "
                "ranks; sequence-level objectives only, no --accumulate-on cpu); "
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


@dataclass
class SamplingConfig:
    """Sampling settings. Only the plain setting estimates the model Fisher; others are refused."""

    temperature: float = field(default=1.0, metadata={"help": "softmax temperature; only 1 is accepted"})
    top_k: int | None = field(default=None, metadata={"help": "keep the k likeliest tokens; only unset or 0 is accepted"})
    top_p: float | None = field(default=None, metadata={"help": "nucleus sampling; only unset or 1 is accepted"})
    min_p: float | None = field(default=None, metadata={"help": "min-p truncation; only unset or 0 is accepted"})
    typical_p: float | None = field(default=None, metadata={"help": "typical sampling; only unset or 1 is accepted"})
    repetition_penalty: float | None = field(default=None, metadata={
        "help": "repetition penalty; only unset or 1 is accepted"})

    def problems(self) -> list[str]:
        """Why this setting is not plain ancestral sampling (empty when it is)."""
        plain = {"temperature": 1.0, "top_k": (None, 0), "top_p": (None, 1.0), "min_p": (None, 0.0),
                 "typical_p": (None, 1.0), "repetition_penalty": (None, 1.0)}
        out = []
        for f in dataclasses.fields(self):
            value, ok = getattr(self, f.name), plain[f.name]
            if value not in (ok if isinstance(ok, tuple) else (ok,)):
                out.append(
                    f"sampling.{f.name}={value!r} is not plain sampling: the Fisher is an expectation under "
                    "the model's own distribution, so responses must be drawn at temperature 1 with no "
                    "truncation or penalty; remove the setting"
                )
        return out

    def describe(self) -> dict:
        return {"method": "ancestral", "temperature": 1.0, "top_k": None, "top_p": None, "min_p": None,
                "typical_p": None, "repetition_penalty": None}


SELF = "self"  # TeacherConfig.model value: the model being calibrated, under another context


@dataclass
class TeacherConfig:
    """Recipe keys of a teacher (distillation) or demonstrator (SFT)."""

    model: str = field(default=SELF, metadata={
        "help": "'self' (the calibrated model under another context), or a model directory, .gguf file, "
                "cached hub id or embedded name"})
    system_prompt: str | None = field(default=None, metadata={
        "help": "the teacher's system message (plain text before the prompt when the tokenizer has no chat template)"})
    user_template: str | None = field(default=None, metadata={
        "help": "the teacher's user message: {prompt} is the model's prompt, {name} any field of the prompt record"})

    def problems(self) -> list[str]:
        out = []
        if not self.model.strip():
            out.append("model: give 'self' or a model path / name")
        if self.model == SELF and self.system_prompt is None and self.user_template is None:
            out.append(
                "the teacher is the model itself under the same context, so its signal is zero; "
                "set system_prompt or user_template, or give another model"
            )
        if self.user_template is not None:
            try:
                list(string.Formatter().parse(self.user_template))
            except ValueError as exc:
                out.append(f"user_template: not a valid format string ({exc}); "
                           "write {prompt} and {field} placeholders")
        return out
