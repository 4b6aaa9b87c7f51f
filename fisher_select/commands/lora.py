"""``fisher-select lora``: LoRA target modules and ranks from a run, as a PEFT adapter-config directory."""

from __future__ import annotations

from fisher_select.commands import HELP

import argparse
from pathlib import Path

from fisher_select.caveats import MASK_CAVEAT
from fisher_select.fields import add_dataclass_arguments
from fisher_select.outputs.config import LoraHintConfig

SNIPPET = """\
# apply in Python: plain PEFT reads the directory as any adapter config ...
from peft import LoraConfig, get_peft_model
config = LoraConfig.from_pretrained({path!r})
# ... or check first that `model` is the calibrated one (reads {provenance}):
from fisher_select import load_lora_config
config = load_lora_config({path!r}, model)
model = get_peft_model(model, config)  # or TRL: GRPOTrainer(..., peft_config=config)"""
PICK_FLAGS = ("coverage", "top_n")
RANK_FLAGS = ("ranking", "total_rank", "mean_rank", "rank_step", "min_rank", "max_rank", "alpha_ratio")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "lora",
        help=HELP["lora"],
        description=(
            "Choose LoRA target modules (full names) by module mass, coverage or top-N (bound mass, the sum "
            "of sqrt(F), by default; --ranking fisher_mass for the sum of F), and split a rank budget in "
            "proportion to the same mass; write a directory with adapter_config.json (PEFT LoraConfig "
            "fields) and fisher_select_provenance.json. Same as `export --format peft`."
        ),
    )
    p.add_argument("run", help="run directory written by `fisher-select calibrate`")
    add_lora_arguments(p)
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (adapter_config.json inside)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    p.set_defaults(func=main)


def add_lora_arguments(p) -> None:
    """The hint flags (``LoraHintConfig``), shared with ``export --format peft``; a flag not given is None."""
    pick = p.add_mutually_exclusive_group()  # None for both: the coverage default applies
    add_dataclass_arguments(pick, LoraHintConfig, include=PICK_FLAGS)
    add_dataclass_arguments(p, LoraHintConfig, include=RANK_FLAGS)
    p.add_argument("--layers", type=_int_list, metavar="I,J,...",
                   help="only modules of these layer indices (PEFT layers_to_transform)")
    p.add_argument("--modules", nargs="+", metavar="NAME",
                   help="only these modules (full names or suffixes such as q_proj v_proj; fused MoE expert "
                        "weights by parameter name or suffix, such as gate_up_proj)")


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def hint_kwargs(args: argparse.Namespace) -> dict:
    """``lora_hints`` keyword arguments from the flags; a flag left at None keeps the default."""
    kwargs = {name: getattr(args, name) for name in (*PICK_FLAGS, *RANK_FLAGS)}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return {**kwargs, "layers_to_transform": args.layers, "modules": args.modules}


def main(args: argparse.Namespace) -> int:
    return write_lora(args.run, hint_kwargs(args), Path(args.out), args.overwrite)


def write_lora(run, kwargs: dict, out: Path, overwrite: bool) -> int:
    from fisher_select.outputs.lora import check_lora_out, lora_export
    from fisher_select.run.load import load_run
    from fisher_select.run.names import LORA_PROVENANCE_FILE

    check_lora_out(out, overwrite)  # before the selection, not after it
    run = load_run(run)  # once: the export and the lr line both read it
    export = lora_export(run, **kwargs)
    path = export.hints.save_pretrained(out, overwrite=overwrite)
    print_targets(export)
    print(f"wrote {path}/ (adapter_config.json, {LORA_PROVENANCE_FILE})")
    print(SNIPPET.format(path=str(path), provenance=LORA_PROVENANCE_FILE))
    print(lora_lr_line(run))
    print(MASK_CAVEAT)
    return 0


def lora_lr_line(run) -> str:
    """What the outcome study measured about LoRA's lr for the loaded ``run``'s kind, or that it measured nothing."""
    from fisher_select.report.study_advice import lora_line

    kind = run.objectives[0].type
    return lora_line(kind) or f"no measured LoRA lr for {kind} in the outcome study (docs/OUTCOMES.md); sweep the lr"


def print_targets(export) -> None:
    """One line per target (both masses' shares, rank, alpha), then coverage and trainable counts."""
    hints = export.hints
    meta, targets = hints.provenance, hints.targets
    width = max(len(t["name"]) for t in targets)
    print(f"{'module':<{width}}  {'bound share':>11}  {'Fisher share':>12}  {'rank':>5}  {'alpha':>6}")
    for t in targets:
        print(f"{t['name']:<{width}}  {t['bound_share']:11.4f}  {t['fisher_share']:12.4f}  {t['rank']:>5}  "
              f"{t['alpha']:>6}")
    selection = meta["selection"]
    print(f"{len(targets)} modules, {selection['covered']:.1%} of the eligible {selection['ranking'].replace('_', ' ')}, "
          f"total rank {meta['total_rank']} (ranks in proportion to the {selection['ranking'].replace('_', ' ')})")
    print(f"LoRA adapters: {export.trainable:,} trainable parameters "
          f"({export.trainable / export.numel:.2%} of the model's {export.numel:,}); base weights frozen")
    experts = [t for t in targets if t.get("experts")]
    if experts:  # fused MoE expert weights go through PEFT's target_parameters, with its limits
        print(f"{len(experts)} targets are fused expert weights (target_parameters; {experts[0]['experts']} experts "
              f"each, the rank is per expert). PEFT's limits for them:")
        for line in meta.get("peft_limits", []):
            print(f"  - {line}")
