"""``fisher-select validate``: train for real from a run's calibration point and score its ranking."""

from __future__ import annotations

from pathlib import Path

from fisher_select.commands import HELP, add_command

OPTIMIZERS = ("sgd", "adamw")  # studies.loop.OPTIMIZERS (a test checks they agree)


def register(subparsers) -> None:
    p = add_command(
        subparsers, "validate", main, help=HELP["validate"],
        description="Fine-tune for a few steps from the calibration parameters with the run's objective (fp32), "
                    "record the realized movement of every coordinate and score the run's ranking against it "
                    "beside baselines (random, |theta|, one batch's |grad|, Spectrum's SNR, KappaTune, another "
                    "seed). Writes validation.json and plots to --out (default RUN/validation-OPT-seedS).",
        run_help="run directory written by `fisher-select calibrate`")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    p.add_argument("--lr", type=float, required=True, help="learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts-per-step", type=int, default=8,
                   help="prompts per step (SFT from demonstrations: rows = this x --samples-per-prompt)")
    p.add_argument("--samples-per-prompt", type=int, default=4, help="K fresh samples per prompt (on-policy)")
    p.add_argument("--max-new-tokens", type=int, help="default: the run's")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward/backward")
    p.add_argument("--subsample", type=int, default=2_000_000, help="coordinates scored (seeded uniform subsample)")
    p.add_argument("--first-step-prompts", type=int, help="prompts in the first-step check's batch (default 2x a step)")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for the training outcome")
    p.add_argument("--mask-densities", type=float, nargs="*", default=[], metavar="D",
                   help="also fine-tune with fisher / random / magnitude masks of these densities and with "
                        "Spectrum's module choice (at its own density)")
    p.add_argument("--mask-seeds", type=int, default=1, metavar="N",
                   help="repeat each masked fine-tuning (and full fine-tuning) over N seeds: the spread of the share")
    p.add_argument("--sparse-masks", action="store_true",
                   help="run the masked fine-tuning through the sparse-delta mode (optimizer state for the selected "
                        "coordinates only; the same steps as the dense default)")
    p.add_argument("--no-second-seed", action="store_true", help="skip the second run (the seed-to-seed ceiling)")
    p.add_argument("--no-adam-aware", action="store_true", help="skip the Adam-aware ranking")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="output directory (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def main(args) -> int:
    from fisher_select.report.build import regenerate
    from fisher_select.report.validation_section import summary_lines
    from fisher_select.studies.validate import ValidationConfig, validate

    config = ValidationConfig(subsample=args.subsample, second_seed=not args.no_second_seed,
                                first_step_prompts=args.first_step_prompts, eval_prompts=args.eval_prompts,
                                mask_densities=tuple(args.mask_densities),
                                mask_seeds=args.mask_seeds, adam_aware=not args.no_adam_aware,
                                sparse_masks=args.sparse_masks)
    batch = {"prompts_per_step": args.prompts_per_step, "samples_per_prompt": args.samples_per_prompt,
             "batch_size": args.batch_size}
    if args.max_new_tokens is not None:
        batch["max_new_tokens"] = args.max_new_tokens
    result = validate(args.run, args.steps, args.optimizer, args.lr, args.weight_decay, args.seed, out=args.out,
                      overwrite=args.overwrite, config=config, device=args.device, progress=not args.no_progress,
                      **batch)
    for line in summary_lines(result.record):
        print(line)
    if result.out is not None:
        print(f"wrote {result.out}")
        if Path(result.out).resolve().parent == Path(args.run).resolve():  # the run's pages show its validations
            for path in regenerate(args.run):
                print(f"wrote {path}")
    return 0
