"""The README's "Validation against training" table: calibrate the embedded default, then validate.

For each training (RL or SFT from demonstrations, SGD or AdamW) this calibrates once (cached in
``--runs``), runs ``fisher_select.studies.validate`` and prints one table row: AUROC of the run's
ranking for "moved" = the realized top 1% beside every baseline, the module aggregates' Spearman
and the first-step check. Each validation's full ``validation.json`` and plots stay in the run dir.

    python bench/validate_embedded.py --objective rl --optimizer sgd --lr 1e-4 --steps 8
    python bench/validate_embedded.py --objective sft --optimizer adamw --lr 1e-5 --steps 8
    python bench/validate_embedded.py --objective rl --optimizer sgd --steps 2 --num-prompts 8 \\
        --calibration-samples 4 --prompts-per-step 4 --samples-per-prompt 4 --max-new-tokens 16   # small check

Settings of the issue's measurement: calibration 16 prompts x 8 samples, 32 new tokens; 8 steps of
8 prompts x 4 samples; 2M-coordinate subsample. On a 2-core CPU one RL validation at those settings
takes tens of minutes; ``--device cuda`` on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from fisher_select.recipe import find_recipe, load_recipe
from fisher_select.pipeline import run_recipe
from fisher_select.report.validation_section import summary_lines
from fisher_select.run.load import load_run
from fisher_select.studies.validate import ValidationConfig, validate

RECIPES = {"rl": "rl-arithmetic", "sft": "sft-demonstrations"}
COLUMNS = ("random", "magnitude", "single_batch_gradient", "second_seed", "spectrum_snr", "kappa")


def calibrated(args) -> Path:
    """The run directory of this objective and calibration size (calibrated once, then reused)."""
    out = Path(args.runs) / f"{args.objective}-n{args.num_prompts}-k{args.calibration_samples}-t{args.max_new_tokens}"
    if (out / "report.json").is_file():
        return out
    overrides = {"num_prompts": args.num_prompts, "samples_per_prompt": args.calibration_samples,
                 "max_new_tokens": args.max_new_tokens, "device": args.device, "seed": 0}
    recipe = load_recipe(find_recipe(RECIPES[args.objective]), overrides)
    started = time.time()
    run_recipe(recipe, out, progress=not args.quiet, recipe_name=RECIPES[args.objective])
    print(f"calibrated {out} in {time.time() - started:.0f} s", file=sys.stderr)
    return out


def sft_setup_on(run_dir: Path, args):
    """SFT from demonstrations trained on the prompts of a run calibrated with another objective.

    The model Fisher F does not depend on the objective (same model, prompts and samples), so an RL
    run's F ranks coordinates for SFT as well; this saves a second calibration on a slow machine.
    Training uses the demonstrations of the first ``--train-prompts`` prompts (default: the run's
    calibration prompts; more, so that a step is a minibatch and not every demonstration), the
    held-out set the ``--eval-prompts`` after them.
    """
    from fisher_select.recipe import build_objectives
    from fisher_select.calibration.prompts import load_prompts
    from fisher_select.models import load_model
    from fisher_select.studies.validate import Setup

    run = load_run(run_dir)
    recipe = load_recipe(find_recipe(RECIPES["sft"]), {"num_prompts": run.report.num_prompts})
    model, tokenizer, _ = load_model(run.report.model.path, args.device, "float32")
    every = load_prompts(recipe.prompts)
    n = max(run.report.num_prompts, args.train_prompts or 0)
    return Setup(model, tokenizer, build_objectives(recipe)[0], every[:n], every[n : n + args.eval_prompts], True,
                 args.device)


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def row(label: str, report: dict) -> str:
    """One README table row: AUROC (moved = realized top 1%) of F and every baseline, precision@1%,
    the module aggregates' Spearman and the first-step check."""
    def auc(entry):  # "(tied)": every score equal, e.g. a batch without signal: chance by construction
        return _num(entry.get("auroc", {}).get("q0.99")) + (" (tied)" if entry.get("degenerate") else "")

    base, sm, fs = report["baselines"], report["spearman_modules"], report["first_step"]
    cells = [label, auc(report)] + [auc(base[k]) for k in COLUMNS] + [auc(report["adam_aware"])]
    cells += [_num(report["precision_at_k"]["0.01"]), _num(report["adam_aware"].get("precision_at_k", {}).get("0.01")),
              _num(sm["bound_mass"]), _num(sm["fisher_mass"])]
    cells.append("n/a (no S for the trained objective)" if fs.get("violation_rate") is None else
                 f"{fs['violation_rate']:.1e} (noise {fs['noise_violation_rate']:.1e})")
    return "| " + " | ".join(cells) + " |"


HEADER = ("| training | F ranking AUROC | random | abs(theta) | single-batch abs(grad) | second seed | Spectrum SNR "
          "| KappaTune | Adam-aware SNR | F precision@1% | Adam-aware precision@1% | module rho, bound mass "
          "(sum sqrt(F)) | module rho, Fisher mass (sum F) | first-step violations |\n" + "|---" * 14 + "|")


MASK_HEADER = ("| training | mask | density | trainable | held-out before | held-out after | full fine-tuning "
               "| share of full's improvement | over seeds (min..max) |\n" + "|---" * 9 + "|")


def mask_rows(label: str, report: dict) -> list[str]:
    """Masked fine-tuning rows: each mask's density and trainable count, the held-out objective it
    reached and the share of full fine-tuning's improvement it recovers (same steps and seed)."""
    masked = report["training_outcome"].get("masked_fine_tuning")
    if not masked:
        return []
    full = masked.get("full_fine_tuning_per_seed") or [masked["full_fine_tuning"]]

    def spread(r):
        s = r.get("recovered_spread")
        return f"{_num(s['min'])}..{_num(s['max'])} ({len(r['per_seed'])} seeds)" if s else "one seed"

    return [f"| {label} | {r['mask']} | {r['density']:.4f} | {r['trainable']:,} | {masked['before']:.4f} "
            f"| {r['after']:.4f} | {sum(full) / len(full):.4f} | {_num(r['recovered'])} | {spread(r)} |"
            for r in masked["runs"]]


def label_of(report: dict) -> str:
    s = report["settings"]
    opt = "SGD" if s["optimizer"] == "sgd" else "AdamW"
    return f"{report['objective']['type'].upper()}, {opt} (lr {s['lr']:g}, wd {s['weight_decay']:g})"


def table(paths: list[str]) -> int:
    """The table again from validation.json files (or their directories), without training."""
    reports = [json.loads((Path(p) / "validation.json" if Path(p).is_dir() else Path(p)).read_text()) for p in paths]
    print(HEADER)
    for report in reports:
        print(row(label_of(report), report))
    masks = [line for report in reports for line in mask_rows(label_of(report), report)]
    if masks:
        print("\n" + MASK_HEADER + "\n" + "\n".join(masks))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objective", choices=tuple(RECIPES), default="rl")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=None, help="default 1e-4 (SGD) / 1e-5 (AdamW)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=16, help="calibration prompts")
    p.add_argument("--calibration-samples", type=int, default=8, help="calibration samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--train-new-tokens", type=int, default=None, help="training samples' length (default: as calibrated)")
    p.add_argument("--first-step-prompts", type=int, default=None, help="default 2 x --prompts-per-step")
    p.add_argument("--no-second-seed", action="store_true")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--subsample", type=int, default=2_000_000)
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--mask-densities", type=float, nargs="*", default=[],
                   help="masked fine-tuning: fisher / random / magnitude masks of these densities, and Spectrum's choice")
    p.add_argument("--mask-seeds", type=int, default=1, help="masked fine-tuning repeated over this many seeds")
    p.add_argument("--device", default="cpu")
    p.add_argument("--runs", default="runs/validate-bench")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--train-prompts", type=int, default=None,
                   help="with --fisher-run: train on the demonstrations of this many prompts (default: the run's)")
    p.add_argument("--fisher-run", help="train SFT from demonstrations on this (e.g. RL) run's F and prompts "
                                        "instead of calibrating the SFT recipe (F is objective-independent)")
    p.add_argument("--table", nargs="+", metavar="VALIDATION", help="only print the table of these validation.json "
                                                                      "files or directories (no training)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.table:
        return table(args.table)
    lr = args.lr if args.lr is not None else (1e-4 if args.optimizer == "sgd" else 1e-5)
    setup = None
    if args.fisher_run:
        if args.objective != "sft":
            p.error("--fisher-run is for --objective sft")
        run, setup = Path(args.fisher_run), sft_setup_on(Path(args.fisher_run), args)
    else:
        run = calibrated(args)
    out = run / f"validation-{args.objective}-{args.optimizer}-lr{lr:g}-wd{args.weight_decay:g}-s{args.steps}-seed{args.seed}"
    options = ValidationConfig(subsample=args.subsample, eval_prompts=args.eval_prompts,
                                first_step_prompts=args.first_step_prompts, second_seed=not args.no_second_seed,
                                mask_densities=tuple(args.mask_densities), mask_seeds=args.mask_seeds)
    new_tokens = args.train_new_tokens or args.max_new_tokens
    started = time.time()
    result = validate(run, args.steps, args.optimizer, lr, args.weight_decay, args.seed, out=out, overwrite=True,
                      config=options, setup=setup, device=args.device, progress=not args.quiet,
                      prompts_per_step=args.prompts_per_step, samples_per_prompt=args.samples_per_prompt,
                      max_new_tokens=new_tokens)
    print("\n".join(summary_lines(result.record)))
    cal = load_run(run).report  # the calibration used (with --fisher-run: that run's, not the flags')
    print(f"\nsettings: calibration {cal.num_prompts} x {cal.samples_per_prompt}, {cal.max_new_tokens} new tokens; "
          f"{args.steps} steps of {args.prompts_per_step} x {args.samples_per_prompt}, {new_tokens} new tokens"
          f"{'' if not args.train_prompts else f', SFT on the demonstrations of {args.train_prompts} prompts'}; "
          f"subsample {args.subsample}; "
          f"{time.time() - started:.0f} s; wrote {result.out}")
    print(HEADER)
    measured = result.record.to_json()
    print(row(label_of(measured), measured))
    masks = mask_rows(label_of(measured), measured)
    if masks:
        print("\n" + MASK_HEADER + "\n" + "\n".join(masks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
