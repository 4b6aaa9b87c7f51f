"""``fisher-select export RUN --format axolotl|peft|sparse-delta``: a run as another trainer's config.

A thin layer over ``fisher_select.outputs``: axolotl's ``unfrozen_parameters`` YAML (the list
Spectrum writes), a PEFT adapter-config directory (the same as ``fisher-select lora``), or a
sparse delta directory with every selected coordinate's delta at 0, which
``load_sparse_delta(model, DIR)`` turns into sparse-delta fine-tuning of those coordinates.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fisher_select.commands import HELP, add_command
from fisher_select.commands.lora import PICK_FLAGS, RANK_FLAGS, add_lora_arguments, hint_kwargs, write_lora
from fisher_select.errors import FisherSelectError
from fisher_select.fields import add_dataclass_arguments
from fisher_select.outputs.config import UnfreezeConfig

FORMATS = ("axolotl", "peft", "sparse-delta")
AXOLOTL_FLAGS = ("bound_mass", "top_modules", "objective")
PEFT_FLAGS = (*PICK_FLAGS, *RANK_FLAGS, "layers", "modules")
SPARSE_FLAGS = ("mask", "top")
FLAGS = {"axolotl": AXOLOTL_FLAGS, "peft": PEFT_FLAGS, "sparse-delta": SPARSE_FLAGS}


def register(subparsers) -> None:
    p = add_command(
        subparsers, "export", main,
        help=HELP["export"],
        description=(
            "--format axolotl: the unfrozen_parameters list axolotl reads (as Spectrum writes it), one "
            "^name$ pattern per parameter of the modules with the most bound mass (sum of sqrt(F)), "
            "by --bound-mass share or --top-modules. --format peft: adapter_config.json + "
            "fisher_select_provenance.json in --out (as `fisher-select lora`). Every pattern / target is "
            "checked to match parameters / modules of the run; trainable counts are printed. "
            "--format sparse-delta: the coordinates of --mask FILE (or --top F) as a sparse delta directory "
            "(indices + zero fp32 deltas + the model's fingerprint) that load_sparse_delta(model, DIR) trains."
        ),
        run_help="run directory written by `fisher-select calibrate`")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="axolotl (a YAML file), peft or sparse-delta (a directory)")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="axolotl: YAML file to write; peft, sparse-delta: directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    axolotl = p.add_argument_group("axolotl")
    pick = axolotl.add_mutually_exclusive_group()
    add_dataclass_arguments(pick, UnfreezeConfig)
    axolotl.add_argument("--objective", metavar="NAME", help="objective whose Fisher ranks modules (default: primary)")
    add_lora_arguments(p.add_argument_group("peft (as `fisher-select lora`)"))
    sparse = p.add_argument_group("sparse-delta").add_mutually_exclusive_group()
    sparse.add_argument("--mask", metavar="FILE", help="mask file of this run (`fisher-select select --out`)")
    sparse.add_argument("--top", type=float, metavar="F", help="select the top fraction F by F (as select --top)")


def main(args: argparse.Namespace) -> int:
    _refuse_other_format_flags(args)
    if args.format == "peft":
        return write_lora(args.run, hint_kwargs(args), Path(args.out), args.overwrite)
    if args.format == "sparse-delta":
        return _write_sparse_delta(args)
    from fisher_select.atomic import refuse_existing
    from fisher_select.outputs.axolotl import save_unfrozen_parameters, unfrozen_parameters

    out = Path(args.out)
    refuse_existing([out], args.overwrite)  # before the selection, not after it
    result = unfrozen_parameters(args.run, bound_mass=args.bound_mass, top_modules=args.top_modules,
                                 objective=args.objective)
    path = save_unfrozen_parameters(result, out, overwrite=args.overwrite)
    _print_modules(result)
    print(f"wrote {path}: paste its unfrozen_parameters list into the axolotl config")
    print(result.provenance["caveat"])
    return 0


def _refuse_other_format_flags(args: argparse.Namespace) -> None:
    for owner, flags in FLAGS.items():
        if owner == args.format:
            continue
        given = ["--" + name.replace("_", "-") for name in flags if getattr(args, name, None) is not None]
        if given:
            raise FisherSelectError(f"--format {args.format} takes no {', '.join(given)} (options of --format {owner}); "
                                    "drop them (see fisher-select export --help)")


def _write_sparse_delta(args: argparse.Namespace) -> int:
    """The selected coordinates as a sparse delta directory (zero deltas) for ``load_sparse_delta``."""
    from fisher_select.atomic import check_dir_target
    from fisher_select.outputs.masks import MaskSet, load_masks, select_masks
    from fisher_select.training.sparse import empty_delta
    from fisher_select.run.load import load_run

    if (args.mask is None) == (args.top is None):
        raise FisherSelectError("--format sparse-delta needs exactly one of --mask FILE (from `fisher-select select`) "
                                "or --top F")
    out = Path(args.out)
    check_dir_target(out, args.overwrite)  # before the selection, not after it
    run = load_run(args.run)
    if args.mask is not None:
        masks, meta = load_masks(args.mask)
        if meta["run_id"] != run.run_id:
            raise FisherSelectError(f"mask file {args.mask} was selected from run {meta['run_id']}, not from "
                                    f"{run.run_id}; pass a mask of this run, or --top F")
        maskset = MaskSet(masks, meta)
    else:
        maskset = select_masks(run, top=args.top)
    path = empty_delta(maskset, out, overwrite=args.overwrite)
    print(f"wrote {path}: {maskset.selected:,} of {maskset.numel:,} coordinates ({maskset.density:.2%}); "
          "train them with fisher_select.load_sparse_delta(model, DIR)")
    print(maskset.meta["caveat"])
    return 0


def _print_modules(result) -> None:
    width = max(len(m["name"]) for m in result.modules)
    print(f"{'module':<{width}}  {'bound share':>11}  {'parameters':>12}")
    for m in result.modules:
        print(f"{m['name']:<{width}}  {m['bound_share']:11.4f}  {m['numel']:>12,}")
    print(f"{len(result.modules)} modules, {result.covered:.1%} of the bound mass, {len(result.patterns)} patterns "
          f"(each matches one parameter); trainable {result.trainable:,} of {result.numel:,} "
          f"({result.trainable / result.numel:.2%})")
