"""What the bound does not say: MATH.md's last section in the project's own words.

Every report, CLI summary, mask sidecar and PEFT hint carries these.
"""

CAVEATS = [
    "Single step, in expectation: the bound limits the EXPECTED gradient of one objective at the "
    "calibration parameters, for one step. It says nothing about individual sampled gradients.",
    "No accumulation: parameters change during training, so movement summed over many steps is not bounded.",
    "Adaptive optimizers: Adam/AdamW divide by a running RMS, so a tiny but consistent gradient can still "
    "move a coordinate at the full learning rate; weight decay moves every coordinate.",
    "Scale matters: a small Fisher implies a small expected gradient only when the signal scale S is "
    "controlled; a large S loosens the bound, an unknown S leaves only the ranking.",
    "Advisory: masks and target lists built from this run are hints, not guarantees.",
]
CAVEAT_LINE = (
    "Caveat: bounds are on the expected gradient of one objective for a single step; they do not bound "
    "movement over many steps, under Adam, or under weight decay. Masks and targets are advisory."
)
MASK_CAVEAT = CAVEAT_LINE + " A mask holds during training only when enforced (fisher_select.apply_masks)."
# S = 0: said by the report (report.warnings) and, for Python callers who never read one, by calibrate itself
ZERO_SCALE_WARNING = ("signal scale S = 0: no sampled response carried signal (e.g. every reward of a prompt was "
                      "equal), so every bound is 0; use prompts whose rewards vary, or more samples per prompt")
