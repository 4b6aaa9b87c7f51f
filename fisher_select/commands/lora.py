"""``fisher-select lora``: LoRA target modules and ranks from a run, as an adapter_config-style JSON."""

from __future__ import annotations

import argparse
from pathlib import Path

from fisher_select.atomic import refuse_existing
from fisher_select.outputs.hint_settings import LoraHintSettings
from fisher_select.outputs.selection import CAVEAT
from fisher_select.validation import add_dataclass_arguments

SNIPPET = """\
# apply in Python (load_lora_config refuses a model other than the calibrated one):
from peft import get_peft_model
from fisher_select.outputs.peft_hints import load_lora_config
config = load_lora_config({path!r}, model)
model = get_peft_model(model, config)"""
_RANK_FLAGS = ("total_rank", "mean_rank", "rank_step", "min_rank", "max_rank", "alpha_ratio")  # LoraHintSettings fields


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
    pick = p.add_mutually_exclusive_group()  # None for both: lora_hints applies the coverage default
    add_dataclass_arguments(pick, LoraHintSettings, include=("coverage", "top_n"))
    add_dataclass_arguments(p, LoraHintSettings, include=_RANK_FLAGS, keep_defaults=True)
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
    refuse_existing([out], args.overwrite)  # before the selection, not after it
    settings = {name: getattr(args, name) for name in ("coverage", "top_n", *_RANK_FLAGS)}
    hints = lora_hints(args.run, **settings, layers_to_transform=args.layers, modules=args.modules)
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
