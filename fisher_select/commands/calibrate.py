"""`fisher-select calibrate`: run a recipe and write a run directory."""

from __future__ import annotations

import sys

from fisher_select.commands import HELP

from fisher_select.recipe import RecipeConfig, find_recipe, load_recipe
from fisher_select.fields import add_dataclass_arguments


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help=HELP["calibrate"],
        description="Run a recipe. Every top-level scalar recipe key is also a flag, which overrides the "
                    "recipe's value (the default applies when neither sets it); see docs/RECIPES.md.")
    p.add_argument("--recipe", default="rl-arithmetic", help="recipe file or shipped recipe name (default: rl-arithmetic)")
    p.add_argument("--out", required=True, help="run directory to write (atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run from OUT.checkpoint/ (written every --checkpoint-every "
                        "batches); starts from the beginning when there is none; same recipe and flags")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars: one line per phase on stderr instead (model loaded, sampling, scoring, "
                        "checks, written)")
    p.add_argument("--all", dest="all_modules", action="store_true",
                   help="list every module in the summary (default: the top 15 by bound mass, the sum of sqrt(F))")
    overrides = add_dataclass_arguments(p.add_argument_group("recipe overrides"), RecipeConfig)
    p.set_defaults(func=main, overrides=tuple(overrides))


def main(args) -> int:
    # imported here, not above: they load torch, which `calibrate --help` and a bad flag do not need
    from fisher_select.distributed import rank_world
    from fisher_select.pipeline import run_recipe
    from fisher_select.report.text import run_summary_lines

    path = find_recipe(args.recipe)
    recipe = load_recipe(path, {name: getattr(args, name) for name in args.overrides})
    result = run_recipe(recipe, args.out, overwrite=args.overwrite, progress=not args.no_progress,
                        recipe_name=path.stem, command_line=getattr(args, "command_line", None),
                        resume=args.resume, log=_stderr_line if args.no_progress else None)
    if rank_world()[0] != 0:  # under torchrun / accelerate, rank 0 writes and reports
        return 0
    for line in run_summary_lines(result.report, top=None if args.all_modules else 15):
        print(line)
    print(f"wrote {result.out}")
    return 0


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
