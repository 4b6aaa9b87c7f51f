"""`fisher-select calibrate`: run a recipe and write a run directory."""

from __future__ import annotations

from fisher_select.config import apply_overrides, find_recipe, load_recipe
from fisher_select.calibration.distributed import rank_world
from fisher_select.pipeline import run_recipe
from fisher_select.report.build import summary_lines

# flag -> recipe field; flags override the recipe
_OVERRIDES = {
    "model": str, "prompts": str, "num_prompts": int, "samples_per_prompt": int, "max_new_tokens": int,
    "seed": int, "device": str, "dtype": str, "batch_size": int, "quantization": str,
}


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="sample from the model, estimate Fisher, signal scales and bounds")
    p.add_argument("--recipe", default="rl-arithmetic", help="recipe file or shipped recipe name (default: rl-arithmetic)")
    p.add_argument("--out", required=True, help="run directory to write (atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    for name, kind in _OVERRIDES.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                       help=f"override the recipe's {name}")
    p.set_defaults(func=run)


def run(args) -> int:
    path = find_recipe(args.recipe)
    recipe = load_recipe(path)
    recipe = apply_overrides(recipe, {k: getattr(args, k) for k in _OVERRIDES}, f"{path} + command line")
    result = run_recipe(recipe, args.out, overwrite=args.overwrite, progress=not args.no_progress,
                        recipe_name=path.stem)
    if rank_world()[0] != 0:  # under torchrun / accelerate, rank 0 writes and reports
        return 0
    for line in summary_lines(result.report):
        print(line)
    print(f"wrote {result.out}")
    return 0
