"""The matched-budget outcome study (issue 22, item 2): one JSON, table and plot per training kind.

Trains the run's objective with every method of ``fisher_select.studies.outcomes`` (masks from
the bound, |g_hat|, single-batch |grad|, random, |theta| at each density; Spectrum's and
KappaTune's modules; LoRA at equal trainable counts; SHiRA fisher vs random) and full fine-tuning,
each at its own lr chosen on validation prompts, reported on held-out prompts. Hours on a CPU for
the embedded default (docs/OUTCOMES.md has the commands and estimates); ``--device cuda`` on a GPU.

    python bench/outcomes.py runs/sft --kind sft --json bench/results/outcomes-sft.json \\
        --plot bench/results/outcomes-sft.png
    python bench/outcomes.py --table bench/results/outcomes-sft.json   # the markdown table, no training

``--recipe NAME`` calibrates RUN first when it holds no run (timed: the calibration's wall time is
recorded as the selection cost); otherwise pass ``--calibration-seconds`` if you timed it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from fisher_select.errors import FisherSelectError
from fisher_select.report.outcomes_section import outcome_table
from fisher_select.studies.outcomes import (KINDS, METHODS, OutcomeConfig, check_kind, keep_in_run, outcome_study,
                                             write_outcomes)

TIMING_FILE = "outcomes-calibration-seconds.json"  # written beside the run's files by --recipe


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", help="the calibration run directory")
    p.add_argument("--table", metavar="JSON", help="print the markdown table of a study's JSON and exit")
    p.add_argument("--kind", choices=KINDS, help="the training kind the run's objective must be")
    p.add_argument("--json", help="output JSON (e.g. bench/results/outcomes-sft.json)")
    p.add_argument("--plot", help="output recovery-vs-density plot (PNG)")
    p.add_argument("--recipe", help="calibrate RUN with this recipe first when it holds no run (timed)")
    p.add_argument("--calibration-seconds", type=float, help="the calibration's wall time, when timed elsewhere")
    d = OutcomeConfig()
    p.add_argument("--densities", type=float, nargs="+", default=list(d.densities))
    p.add_argument("--lr-multipliers", type=float, nargs="+", default=list(d.lr_multipliers),
                   help="each method's lr grid, x full fine-tuning's chosen lr")
    p.add_argument("--full-lr-multipliers", type=float, nargs="+", default=list(d.full_lr_multipliers),
                   help="full fine-tuning's own lr grid, x --base-lr")
    p.add_argument("--base-lr", type=float, default=d.base_lr)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seeds", type=int, default=d.seeds)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default=d.optimizer)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(d.methods))
    p.add_argument("--validation-prompts", type=int, default=d.validation_prompts)
    p.add_argument("--heldout-prompts", type=int, default=d.heldout_prompts)
    p.add_argument("--dense", action="store_true", help="masks through apply_masks instead of the sparse-delta mode")
    p.add_argument("--lora-mean-rank", type=int, default=d.lora_mean_rank)
    p.add_argument("--shira-r", type=int, default=d.shira_r)
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step)
    p.add_argument("--samples-per-prompt", type=int, default=d.samples_per_prompt)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--device", default="cpu")
    p.add_argument("--progress", action="store_true")
    return p.parse_args(argv)


def config_of(args, calibration_seconds: float | None) -> OutcomeConfig:
    return OutcomeConfig(
        densities=tuple(args.densities), lr_multipliers=tuple(args.lr_multipliers),
        full_lr_multipliers=tuple(args.full_lr_multipliers), base_lr=args.base_lr, steps=args.steps,
        seeds=args.seeds, seed=args.seed, optimizer=args.optimizer, weight_decay=args.weight_decay,
        methods=tuple(args.methods), validation_prompts=args.validation_prompts,
        heldout_prompts=args.heldout_prompts, sparse=not args.dense, lora_mean_rank=args.lora_mean_rank,
        shira_r=args.shira_r, prompts_per_step=args.prompts_per_step, samples_per_prompt=args.samples_per_prompt,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, calibration_seconds=calibration_seconds)


def calibration_seconds(args) -> float | None:
    """Calibrate RUN with --recipe when it holds no run (timed); else the recorded or given time."""
    run = Path(args.run)
    timing = run / TIMING_FILE
    if not (run / "report.json").is_file():
        if not args.recipe:
            raise FisherSelectError(f"{run} holds no run (report.json); calibrate it, or pass --recipe")
        from fisher_select.recipe import find_recipe, load_recipe
        from fisher_select.pipeline import run_recipe

        started = time.time()
        run_recipe(load_recipe(find_recipe(args.recipe), {"device": args.device}), run, progress=args.progress,
                   recipe_name=args.recipe)
        timing.write_text(json.dumps({"calibration_seconds": time.time() - started}) + "\n")
    if args.calibration_seconds is not None:
        return args.calibration_seconds
    return json.loads(timing.read_text())["calibration_seconds"] if timing.is_file() else None


def main(argv=None) -> int:
    args = parse(argv)
    try:
        if args.table:
            print("\n".join(outcome_table(json.loads(Path(args.table).read_text()))))
            return 0
        if not args.run:
            raise FisherSelectError("give RUN (a calibration run directory), or --table JSON")
        seconds = calibration_seconds(args)
        if args.kind:
            check_kind(args.run, args.kind)
        report = outcome_study(args.run, config_of(args, seconds), device=args.device, progress=args.progress)
        write_outcomes(report, args.json, args.plot)
        kept = keep_in_run(report, args.run)  # the run's report shows the study from now on
        print("\n".join(outcome_table(report)))
        print(f"\nkept in {kept}; the run's report.html shows it")
    except FisherSelectError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
