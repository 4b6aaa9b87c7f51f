"""``fisher-select select``: coordinate masks from a run, written as safetensors + JSON sidecar."""

from __future__ import annotations

from fisher_select.commands import HELP

import argparse
from pathlib import Path

from fisher_select.caveats import MASK_CAVEAT
from fisher_select.outputs.config import SCORES

SUMMARY_MODULES = 15  # modules the summary lists without --all

STRUCTURES = ("rows", "columns")


def register(subparsers) -> None:
    p = subparsers.add_parser("select", help=HELP["select"],
                              description="Select coordinates of a calibration run by one rule and write bool masks "
                                          "(True = selected) as safetensors, with a JSON sidecar <out>.json.")
    p.add_argument("run", help="run directory written by `fisher-select calibrate`")
    rule = p.add_mutually_exclusive_group(required=True)
    rule.add_argument("--top", type=float, metavar="F",
                      help="fraction in (0,1] of coordinates with the largest bound")
    rule.add_argument("--fisher-mass", type=float, metavar="Q",
                      help="smallest set of coordinates holding fraction Q of the Fisher mass (sum of F)")
    rule.add_argument("--bound-mass", type=float, metavar="Q",
                      help="smallest set of coordinates holding fraction Q of the bound mass (sum of sqrt(F))")
    rule.add_argument("--threshold", type=float, metavar="TAU",
                      help="coordinates whose bound sqrt(F*S) exceeds TAU (needs a known S)")
    p.add_argument("--per-module", action="store_true",
                   help="apply the --top / --fisher-mass / --bound-mass budget within each parameter tensor "
                        "(within each expert's slice of a fused MoE expert tensor)")
    p.add_argument("--structured", choices=STRUCTURES,
                   help="select whole rows/columns of 2-D weights (other parameters: coordinates)")
    p.add_argument("--objective", metavar="NAME", help="objective whose S sets the bound (default: primary)")
    p.add_argument("--score", choices=SCORES, default=SCORES[0],
                   help="what --top ranks by: the bound sqrt(F S) (default) or |g_hat|, the calibration's own "
                        "gradient estimate (docs/OUTCOMES.md compares the two rules per kind and budget)")
    p.add_argument("--out", required=True, metavar="FILE", help="mask file to write (.safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing mask file")
    p.add_argument("--all", dest="all_modules", action="store_true",
                   help=f"list every module (default: the {SUMMARY_MODULES} with the most selected coordinates)")
    p.set_defaults(func=run_select)


def run_select(args: argparse.Namespace) -> int:
    from fisher_select.atomic import refuse_existing
    from fisher_select.outputs.masks import save_masks, select_masks
    from fisher_select.run.load import load_run
    from fisher_select.run.names import sidecar_path

    out = Path(args.out)
    refuse_existing([out, sidecar_path(out)], args.overwrite)  # before the (possibly long) selection
    run = load_run(args.run)  # once: the selection and the lr line both read it
    maskset = select_masks(
        run,
        top=args.top,
        fisher_mass=args.fisher_mass,
        bound_mass=args.bound_mass,
        threshold=args.threshold,
        per_module=args.per_module,
        structured=args.structured,
        objective=args.objective,
        score=args.score,
    )
    path = save_masks(maskset, out, overwrite=args.overwrite)
    _print_counts(maskset.meta, None if args.all_modules else SUMMARY_MODULES)
    for warning in maskset.meta["warnings"]:
        print(f"warning: {warning}")
    print(f"wrote {path} and {sidecar_path(path).name}")
    print(lr_line(run, maskset.masks, args.objective))
    print(finding(run, args.objective))
    print(MASK_CAVEAT)
    return 0


def finding(run, objective: str | None) -> str:
    """What the outcome study measured for the run's kind: the bound's mask against the other rules, per budget."""
    from fisher_select.report.study_advice import finding_line

    return finding_line(run.objective(objective).type)


def lr_line(run, masks: dict, objective: str | None) -> str:
    """The suggested lr for the mask (``report.study_advice``) on the loaded ``run``, or why there is none."""
    from fisher_select.errors import FisherSelectError
    from fisher_select.report.study_advice import advice_line

    kind = run.objective(objective).type
    try:
        grad = run.grad_estimate_of(objective)
    except FisherSelectError:
        return "no suggested lr: the run keeps no gradient estimate g_hat (calibrated with --accumulators fisher)"
    return advice_line(kind, masks, grad)


def _print_counts(meta: dict, limit: int | None) -> None:
    """One line per module (selected / numel / density), the most selected first, then the total;
    only the first ``limit`` modules unless ``limit`` is None."""
    modules = sorted(meta["modules"], key=lambda m: (-m["selected"], m["name"]))
    shown = modules if limit is None else modules[:limit]
    rows = [(m["name"], m["selected"], m["numel"], m["density"]) for m in shown]
    rows.append(("total", meta["selected"], meta["numel"], meta["density"]))
    width = max(len(r[0]) for r in rows)
    print(f"{'module':<{width}}  {'selected':>12}  {'numel':>12}  density")
    for name, selected, numel, density in rows[:-1]:
        print(f"{name:<{width}}  {selected:>12,}  {numel:>12,}  {density:8.4f}")
    if len(shown) < len(modules):
        print(f"... {len(modules) - len(shown)} more modules (--all lists every one)")
    name, selected, numel, density = rows[-1]
    print(f"{name:<{width}}  {selected:>12,}  {numel:>12,}  {density:8.4f}")
