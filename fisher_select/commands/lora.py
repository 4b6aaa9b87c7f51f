"""``fisher-select lora``: LoRA target modules and ranks from a run, as an adapter_config-style JSON."""

from __future__ import annotations

import argparse
from pathlib import Path

from fisher_select.errors import FisherSelectError
from fisher_select.outputs.selection import CAVEAT

SNIPPET = """\
# apply in Python (load_lora_config refuses a model other than the calibrated one):
from peft import get_peft_model
from fisher_select.outputs.peft_hints import load_lora_config
config = load_lora_config({path!r}, model)
model = get_peft_model(model, config)"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "lora",
        help="LoRA target modules and per-module ranks by Fisher mass (a PEFT config JSON)",
        description=(
            "Choose LoRA target modules (full names) by Fisher-mass coverage or top-N and split a "
            "rank budget in proportion to mass; write PEFT LoraConfig fields plus provenance."
        ),
    )
    p.add_argument("run", help="run directory written by `fisher-select calibrate`")
    pick = p.add_mutually_exclusive_group()
    pick.add_argument("--coverage", type=float, metavar="Q",
                      help="fewest modules holding fraction Q of the eligible Fisher mass (default 0.9)")
    pick.add_argument("--top-n", type=int, metavar="N", help="the N modules with the most Fisher mass")
    p.add_argument("--total-rank", type=int, metavar="R", help="sum of all ranks (default 8 per module)")
    p.add_argument("--rank-step", type=int, default=4, metavar="S",
                   help="ranks are multiples of S (default 4)")
    p.add_argument("--min-rank", type=int, metavar="R", help="smallest rank (default: the rank step)")
    p.add_argument("--max-rank", type=int, metavar="R",
                   help="largest rank (default: min(out, in) per module)")
    p.add_argument("--alpha-ratio", type=float, default=2.0, metavar="A",
                   help="lora_alpha = A * r for every module (default 2)")
    p.add_argument("--layers", type=_int_list, metavar="I,J,...",
                   help="only modules of these layer indices (PEFT layers_to_transform)")
    p.add_argument("--modules", nargs="+", metavar="NAME",
                   help="only these modules (full names or suffixes such as q_proj v_proj)")
    p.add_argument("--out", required=True, metavar="FILE", help="JSON file to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")
    p.set_defaults(func=run_lora)


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def run_lora(args: argparse.Namespace) -> int:
    # Imported here: PEFT (and through it bitsandbytes) is slow to import for other commands.
    from fisher_select.outputs.peft_hints import lora_hints, save_lora_config

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise FisherSelectError(f"{out} already exists; pass --overwrite or choose another --out")
    hints = lora_hints(
        args.run,
        coverage=args.coverage,
        top_n=args.top_n,
        total_rank=args.total_rank,
        rank_step=args.rank_step,
        min_rank=args.min_rank,
        max_rank=args.max_rank,
        alpha_ratio=args.alpha_ratio,
        layers_to_transform=args.layers,
        modules=args.modules,
    )
    path = save_lora_config(hints, out, overwrite=args.overwrite)
    _print_targets(hints)
    print(f"wrote {path}")
    print(SNIPPET.format(path=str(path)))
    print(CAVEAT)
    return 0


def _print_targets(hints: dict) -> None:
    meta = hints["fisher_select"]
    targets = meta["targets"]
    width = max(len(t["name"]) for t in targets)
    print(f"{'module':<{width}}  {'mass share':>10}  {'rank':>5}  {'alpha':>6}")
    for t in targets:
        print(f"{t['name']:<{width}}  {t['share']:10.4f}  {t['rank']:>5}  {t['alpha']:>6}")
    covered = meta["selection"]["covered"]
    print(f"{len(targets)} modules, {covered:.1%} of the eligible Fisher mass, "
          f"total rank {meta['total_rank']}")
