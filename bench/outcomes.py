"""The matched-budget outcome study: protocol v2 (issue 32, ``--v2``), and protocol 1 (withdrawn, kept for one release).

Protocol v2 (docs/OUTCOMES.md): replicates, each with its own calibration seed and disjoint draw of
training / validation / held-out prompts; a pilot replicate chooses every arm's lr on an extended
grid; every cell is cached under --cells (a rerun skips finished cells); --assemble builds the
record and tables from the cells alone.

    python bench/outcomes.py --v2 --recipe sft-demonstrations --kind sft --cells bench/results/cells/sft --pilot
    python bench/outcomes.py --v2 --recipe sft-demonstrations --kind sft --cells bench/results/cells/sft \
        --budget-minutes 600
    python bench/outcomes.py --v2 --kind sft --cells bench/results/cells/sft --assemble \
        --json bench/results/outcomes-sft.json

Protocol 1 (below) shared prompts between training and evaluation and cut its lr grids; its
results are withdrawn.

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
import hashlib
import json
import sys
import time
from pathlib import Path

from fisher_select.cli import quiet_third_party_loggers
from fisher_select.errors import FisherSelectError

quiet_third_party_loggers()  # a script, so it may: before the imports below reach peft, which imports bitsandbytes

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
    p.add_argument("--validation-prompts", type=int,
                   help=f"default: {d.validation_prompts} (protocol 1), 16 (--v2)")
    p.add_argument("--heldout-prompts", type=int, help=f"default: {d.heldout_prompts} (protocol 1), 32 (--v2)")
    p.add_argument("--dense", action="store_true", help="masks through apply_masks instead of the sparse-delta mode")
    p.add_argument("--lora-mean-rank", type=int, default=d.lora_mean_rank)
    p.add_argument("--shira-r", type=int, default=d.shira_r)
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step)
    p.add_argument("--samples-per-prompt", type=int, default=d.samples_per_prompt)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--device", default="cpu")
    p.add_argument("--progress", action="store_true")
    v2 = p.add_argument_group("protocol v2 (--v2)")
    v2.add_argument("--v2", action="store_true", help="run protocol v2 (replicates, cells, --assemble)")
    v2.add_argument("--cells", help="the folder of the study's cells (and its replicates' calibration runs)")
    v2.add_argument("--pilot", action="store_true", help="only the pilot replicate: choose every arm's lr")
    v2.add_argument("--assemble", action="store_true", help="build the record and tables from the cells alone")
    v2.add_argument("--keep-in", metavar="RUN", help="with --assemble: keep the record in RUN/outcomes-<kind>/ "
                                                      "and redraw RUN's report (it shows the study's tables)")
    v2.add_argument("--costs", action="store_true", help="print what the finished cells cost per stage (seconds), "
                    "train nothing")
    v2.add_argument("--plan", action="store_true", help="print the protocol, its minimum cell count and what --cells "
                    "still lacks (cells, calibrations, estimated hours), train nothing")
    v2.add_argument("--budget-minutes", type=float, help="stop before a cell would overrun this many minutes")
    v2.add_argument("--replicates", type=int, default=6)
    v2.add_argument("--arms", nargs="+", help="default: the core arms (fisher_select.studies.arms.CORE_ARMS); "
                                               "add magnitude and lora_config by naming every arm wanted")
    v2.add_argument("--budgets", type=float, nargs="+", help="mask densities (default: the kind's core budgets)")
    v2.add_argument("--prompts", help="draw every replicate's prompts from this file instead of the recipe's (e.g. "
                                       "fisher_select/recipes/data/arithmetic_chat.jsonl for distillation: its solved "
                                       "examples make responses end)")
    v2.add_argument("--train-prompts", type=int, default=48)
    v2.add_argument("--grid-cap", type=int, default=10)
    v2.add_argument("--threads", type=int, help="torch threads (default: torch's; on a shared 2-core machine: 2)")
    v2.add_argument("--time-cell", nargs=3, metavar=("ARM", "BUDGET", "LR"),
                    help="time one held-out cell of replicate 0 (BUDGET 'none' for full / LoRA), before (plain "
                         "path) and after (shared prefix once); writes no cell")
    v2.add_argument("--model", help="calibrate and train this model instead of the recipe's (a small one for a smoke)")
    return p.parse_args(argv)


def config_of(args, calibration_seconds: float | None) -> OutcomeConfig:
    return OutcomeConfig(
        densities=tuple(args.densities), lr_multipliers=tuple(args.lr_multipliers),
        full_lr_multipliers=tuple(args.full_lr_multipliers), base_lr=args.base_lr, steps=args.steps,
        seeds=args.seeds, seed=args.seed, optimizer=args.optimizer, weight_decay=args.weight_decay,
        methods=tuple(args.methods), validation_prompts=args.validation_prompts or OutcomeConfig.validation_prompts,
        heldout_prompts=args.heldout_prompts or OutcomeConfig.heldout_prompts, sparse=not args.dense, lora_mean_rank=args.lora_mean_rank,
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


def protocol_of(args):
    from fisher_select.studies.arms import CORE_ARMS
    from fisher_select.studies.protocol import ProtocolV2

    d = ProtocolV2(args.kind)
    return ProtocolV2(args.kind, replicates=args.replicates, seed=args.seed, train_prompts=args.train_prompts,
                      validation_prompts=args.validation_prompts or d.validation_prompts,
                      heldout_prompts=args.heldout_prompts or d.heldout_prompts,
                      budgets=tuple(args.budgets or ()), arms=tuple(args.arms or CORE_ARMS), grid_cap=args.grid_cap,
                      steps=args.steps, optimizer=args.optimizer, weight_decay=args.weight_decay,
                      prompts_per_step=args.prompts_per_step, samples_per_prompt=args.samples_per_prompt,
                      max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)


def replicate_loader(args, protocol):
    """load(r): replicate r's own calibration (the recipe on its drawn training prompts, seed + r; made once,
    kept under CELLS/runs/r<r>), its model and its draw."""
    from fisher_select.calibration.prompts import load_prompts
    from fisher_select.recipe import find_recipe, load_recipe
    from fisher_select.pipeline import run_recipe
    from fisher_select.run.load import load_run
    from fisher_select.studies.cell_run import Replicate
    from fisher_select.studies.protocol import draw
    from fisher_select.studies.validate import load_setup

    records = load_prompts(args.prompts or load_recipe(find_recipe(args.recipe)).prompts)
    runs = Path(args.cells) / "runs"

    def load(r: int) -> Replicate:
        splits = draw(records, protocol, r)
        run_dir = runs / f"r{r}"
        if not (run_dir / "report.json").is_file():
            runs.mkdir(parents=True, exist_ok=True)
            prompts = runs / f"r{r}-training.jsonl"  # the replicate's training prompts, its calibration's file
            prompts.write_text("".join(json.dumps(x.fields) + "\n" for x in splits["training"]), encoding="utf-8")
            overrides = {"device": args.device, "prompts": str(prompts), "num_prompts": protocol.train_prompts,
                         "seed": protocol.seed + r, "model": args.model, "max_new_tokens": protocol.max_new_tokens}
            run_recipe(load_recipe(find_recipe(args.recipe), overrides), run_dir, progress=args.progress,
                       recipe_name=args.recipe)
        run = load_run(run_dir)
        want = {"seed": protocol.seed + r, "num_prompts": protocol.train_prompts, "max_new_tokens": protocol.max_new_tokens}
        have = {k: (run.report.config or {}).get(k) for k in want}
        if have != want:  # a calibration made for other settings is never reused for these cells
            raise FisherSelectError(f"{run_dir} was calibrated with {have}, but replicate {r} of this protocol needs "
                                    f"{want}; remove {run_dir} (it is remade) or run the protocol it was made for")
        setup = load_setup(run, args.device, 0)
        return Replicate(r, run, setup.model, setup.tokenizer, setup.objective, splits, args.device)

    return load


def replicate_identity(args) -> dict:
    """What defines the replicates besides the protocol: the recipe's text, the prompts' text, the model and
    device; a finished replicate's marker is honoured only under the same (``study.run_study``)."""
    from fisher_select.calibration.prompts import load_prompts
    from fisher_select.recipe import find_recipe, load_recipe

    recipe = find_recipe(args.recipe)
    records = load_prompts(args.prompts or load_recipe(recipe).prompts)
    digest = lambda text: hashlib.sha256(text.encode()).hexdigest()  # noqa: E731
    return {"recipe": digest(recipe.read_text(encoding="utf-8")),
            "prompts": digest(json.dumps([x.fields for x in records], sort_keys=True)),
            "model": args.model, "device": args.device}


def time_cell(args, protocol) -> int:
    """One held-out cell of replicate 0, timed with the plain scoring path and with the shared prefix computed
    once (``studies.prefix``); both results are printed so that the lead sees they agree."""
    from fisher_select.studies import prefix
    from fisher_select.studies.cell_run import ReplicateCells

    if not args.recipe:
        raise FisherSelectError("--time-cell calibrates replicate 0 from --recipe NAME (once); give it")
    arm, budget, lr = args.time_cell
    budget = None if budget.lower() == "none" else float(budget)
    cells = ReplicateCells(protocol, replicate_loader(args, protocol)(0), args.progress)
    out = {}
    for name, reuse in (("before", False), ("after", True)):
        prefix.CACHED = reuse  # before: the plain path; after: the shared prefix once and cached greedy decoding
        started = time.perf_counter()
        result = cells.compute(arm, budget, float(lr), "held_out")
        out[name] = {"seconds": time.perf_counter() - started, "training_seconds": result["training_seconds"],
                     **{k: result.get(k) for k in ("general_text_nll", "general_kl", "answer_nll", "greedy_correct", "held_out")}}
    print(json.dumps({"cell": [arm, budget, float(lr)], "threads": args.threads, **out}, indent=1))
    return 0


def main_v2(args) -> int:
    from fisher_select.atomic import write_file
    from fisher_select.run.outcomes import read_outcomes
    from fisher_select.studies.assemble import assemble
    from fisher_select.studies.study import run_study
    from fisher_select.report.outcome_tables import record_markdown

    if not args.cells or not args.kind:
        raise FisherSelectError("--v2 needs --cells DIR and --kind")
    if args.costs:
        from fisher_select.studies.cells import cell_costs

        print(json.dumps(cell_costs(args.cells), indent=1))
        return 0
    if args.assemble:
        record = read_outcomes(assemble(args.cells, args.kind))
        if args.json:
            write_file(Path(args.json), lambda tmp: tmp.write_text(json.dumps(record.as_dict(), indent=1) + "\n"),
                       overwrite=True)
        if args.plot:
            from fisher_select.studies.outcome_plots import gain_vs_forgetting

            write_file(Path(args.plot), lambda tmp: gain_vs_forgetting(tmp, record), overwrite=True)
        if args.keep_in:
            from fisher_select.studies.assemble import keep_record_in_run

            print(f"kept in {keep_record_in_run(record, args.keep_in)}; the run's report shows it")
        print("\n".join(record_markdown(record)))
        return 0
    protocol = protocol_of(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.plan:
        from fisher_select.studies.plan import cells_left

        print(json.dumps({"protocol": protocol.as_dict(), "minimum_cells": protocol.minimum_cells(),
                          "left": cells_left(protocol, args.cells)}, indent=1))
        return 0
    if args.time_cell:
        return time_cell(args, protocol)
    if not args.recipe:
        raise FisherSelectError("--v2 calibrates each replicate from --recipe NAME; give it (or --assemble)")
    done = run_study(protocol, args.cells, replicate_loader(args, protocol), budget_minutes=args.budget_minutes,
                     pilot_only=args.pilot, progress=args.progress, identity=replicate_identity(args))
    print(json.dumps({k: v for k, v in done.items() if k != "lr_choices"}))
    for name, c in done["lr_choices"].items():
        print(f"{name}: lr {c['chosen']:.3g}" + (" (ON THE GRID'S EDGE)" if c["on_edge"] else ""))
    return 0 if done["finished"] else 3


def main(argv=None) -> int:
    args = parse(argv)
    try:
        if args.v2:
            return main_v2(args)
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
