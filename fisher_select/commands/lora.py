"""``fisher-select lora``: LoRA target modules and ranks from a run, as a PEFT adapter-config directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from fisher_select.outputs.hint_settings import LoraHintSettings
from fisher_select.outputs.selection import CAVEAT
from fisher_select.validation import add_dataclass_arguments

SNIPPET = """\
# apply in Python: plain PEFT reads the directory as any adapter config ...
from peft import LoraConfig, get_peft_model
config = LoraConfig.from_pretrained({path!r})
# ... or check first that `model` is the calibrated one (reads {provenance}):
from fisher_select.outputs.peft_hints import load_lora_config
config = load_lora_config({path!r}, model)
model = get_peft_model(model, config)  # or TRL: GRPOTrainer(..., peft_config=config)"""
RANK_FLAGS = ("total_rank", "mean_rank", "rank_step", "min_rank", "max_rank", "alpha_ratio")  # LoraHintSettings fields


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "lora",
        help="LoRA target modules and per-module ranks by Fisher mass (a PEFT adapter-config directory)",
        description=(
            "Choose LoRA target modules (full names) by Fisher-mass coverage or top-N and split a "
            "rank budget in proportion to mass; write a directory with adapter_config.json (PEFT "
            "LoraConfig fields) and fisher_select_provenance.json. Same as `export --format peft`."
        ),
    )
    p.add_argument("run", help="run directory written by `fisher-select calibrate`")
    add_lora_arguments(p, keep_defaults=True)
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (adapter_config.json inside)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    p.set_defaults(func=main)


def add_lora_arguments(p, *, keep_defaults: bool) -> None:
    """The hint flags (``LoraHintSettings``), shared with ``export --format peft``."""
    pick = p.add_mutually_exclusive_group()  # None for both: lora_hints applies the coverage default
    add_dataclass_arguments(pick, LoraHintSettings, include=("coverage", "top_n"))
    add_dataclass_arguments(p, LoraHintSettings, include=RANK_FLAGS, keep_defaults=keep_defaults)
    p.add_argument("--layers", type=_int_list, metavar="I,J,...",
                   help="only modules of these layer indices (PEFT layers_to_transform)")
    p.add_argument("--modules", nargs="+", metavar="NAME",
                   help="only these modules (full names or suffixes such as q_proj v_proj)")


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def hint_kwargs(args: argparse.Namespace) -> dict:
    """``lora_hints`` keyword arguments from the flags; a flag left at None keeps lora_hints' default."""
    kwargs = {name: getattr(args, name) for name in ("coverage", "top_n", *RANK_FLAGS)}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return {**kwargs, "layers_to_transform": args.layers, "modules": args.modules}


def main(args: argparse.Namespace) -> int:
    return write_lora(args.run, hint_kwargs(args), Path(args.out), args.overwrite)


def write_lora(run, kwargs: dict, out: Path, overwrite: bool) -> int:
    # Imported here: PEFT (and through it bitsandbytes) is slow to import for other commands.
    from fisher_select.outputs.export import lora_export
    from fisher_select.outputs.peft_hints import PROVENANCE_FILE, check_lora_out, save_lora_config

    check_lora_out(out, overwrite)  # before the selection, not after it
    export = lora_export(run, **kwargs)
    path = save_lora_config(export.hints, out, overwrite=overwrite)
    print_targets(export)
    print(f"wrote {path}/ (adapter_config.json, {PROVENANCE_FILE})")
    print(SNIPPET.format(path=str(path), provenance=PROVENANCE_FILE))
    print(CAVEAT)
    return 0


def print_targets(export) -> None:
    """One line per target (mass share, rank, alpha), then coverage and trainable counts."""
    meta = export.hints["fisher_select"]
    targets = meta["targets"]
    width = max(len(t["name"]) for t in targets)
    print(f"{'module':<{width}}  {'mass share':>10}  {'rank':>5}  {'alpha':>6}")
    for t in targets:
        print(f"{t['name']:<{width}}  {t['share']:10.4f}  {t['rank']:>5}  {t['alpha']:>6}")
    covered = meta["selection"]["covered"]
    print(f"{len(targets)} modules, {covered:.1%} of the eligible Fisher mass, total rank {meta['total_rank']}")
    print(f"LoRA adapters: {export.trainable:,} trainable parameters "
          f"({export.trainable / export.numel:.2%} of the model's {export.numel:,}); base weights frozen")
