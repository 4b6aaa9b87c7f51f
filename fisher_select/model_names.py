"""The names a recipe and the CLI give a model's loading: the default model, dtypes, quantizations.

Plain strings, without torch: a recipe is checked against them by name (``recipes``, ``recipes
show``, flag errors answer without loading torch); ``models`` maps them to what it loads.
"""

EMBEDDED_DEFAULT = "smollm2-135m-instruct"
# The allowed --dtype / --quantization values: recipes validate against these tables too.
DTYPE_NAMES = ("float32", "bfloat16", "float16", "auto")  # "auto": the checkpoint's own dtype
QUANTIZATIONS = ("nf4", "fp4", "int8")  # bitsandbytes: 4-bit NormalFloat / FP4, or LLM.int8()
