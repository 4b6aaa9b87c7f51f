"""From a recipe to a finished run directory: the job behind `fisher-select calibrate`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from fisher_select.atomic import check_dir_target, check_writable
from fisher_select.calibration.calibrator import Calibration, calibrate, resolve_inputs
from fisher_select.calibration.checkpoint import CheckpointConfig
from fisher_select.calibration.checkpoint import finish as finish_checkpoint
from fisher_select.calibration import fsdp
from fisher_select.calibration.prompts import load_prompts, render_prompt
from fisher_select.calibration.rollouts import load_rollouts
from fisher_select.calibration.config import SamplingConfig
from fisher_select.calibration.sampling import pad_id_of
from fisher_select.recipe import RecipeConfig, build_objectives, recipe_to_dict
from fisher_select.errors import DegenerateResultWarning
from fisher_select.distributed import init_from_env, rank_world
from fisher_select.models import fingerprint, load_model
from fisher_select.timing import PhaseClock
from fisher_select.report.build import build_report, write_run_with_pages
from fisher_select.run.names import checkpoint_folder
from fisher_select.run.schema import ModelInfo, RunReport
from fisher_select.run.write import run_bytes


@dataclass
class RunResult:
    calibration: Calibration
    report: RunReport
    out: Path


def run_recipe(recipe: RecipeConfig, out: str | Path, *, overwrite: bool = False, progress: bool = True,
               recipe_name: str | None = None, command_line: list[str] | None = None,
               resume: bool = False, log=None) -> RunResult | None:
    """Load model and prompts (or rollouts), calibrate every objective of the recipe, write the run directory.

    None on the ranks other than 0 under ``shard: fsdp`` (rank 0 alone gathers the result).

    ``resume``: continue from the checkpoint in ``OUT.checkpoint`` (written every ``checkpoint_every``
    batches), if there is one; it is removed once the run directory is written.
    ``log(line)``: one line per phase (model loaded, sampling, scoring, checks, written), for runs without
    progress bars.
    """
    log = log or (lambda line: None)
    clock = PhaseClock()  # report.json's timings: every phase from here to the written run
    out = Path(out)
    check_dir_target(out, overwrite)  # refuse before spending minutes on calibration
    device = init_from_env(recipe.device)  # torchrun / accelerate: one rank per device
    rank, world = rank_world()
    rollouts = load_rollouts(recipe.rollouts, limit=recipe.num_prompts) if recipe.rollouts else None  # checked now
    objectives = build_objectives(recipe)
    sampling = SamplingConfig(**recipe.sampling)  # checked by load_recipe (and again by calibrate, for API callers)
    # Checked before minutes of model loading (sampling: by load_recipe); a rollouts file's prompts and K win.
    prompts, config = resolve_inputs(None if rollouts else load_prompts(recipe.prompts, limit=recipe.num_prompts),
                                     objectives, recipe.calibration_config(), None, rollouts)
    clock.lap("setup")
    model, tokenizer, path = load_model(recipe.model, device, recipe.dtype, recipe.quantization)
    model_fingerprint = fingerprint(model)
    clock.lap("model_load")
    log(f"model loaded: {recipe.model} ({model_fingerprint['num_parameters']:,} parameters) on {device}")
    if recipe.shard == "fsdp":  # after the fingerprint, which reads every full weight; the rules checked first
        model = fsdp.wrap(model, [render_prompt(tokenizer, r) for r in prompts[:2]], pad_id_of(model, tokenizer))
    # Now the size is known: refuse a disk without room for the run before sampling, not after.
    check_writable(out.parent, run_bytes(model_fingerprint["num_parameters"], len(objectives)))
    ckpt = CheckpointConfig(checkpoint_folder(out), recipe.checkpoint_every, resume, discard_existing=overwrite,
                            model_id=model_fingerprint["id"], keep_when_done=True)
    with warnings.catch_warnings():  # the run's report and summary say S = 0 (report.warnings): not twice
        warnings.simplefilter("ignore", DegenerateResultWarning)
        cal = calibrate(model, tokenizer, prompts, objectives, config, sampling=sampling,
                        progress=progress and rank == 0, rollouts=rollouts, checkpoint=ckpt,
                        log=log if rank == 0 else None)
    sharded = recipe.shard == "fsdp"
    if cal is None:  # --shard fsdp: rank 0 alone holds the gathered result; wait while it writes the run
        finish_checkpoint(ckpt, rank, world, sharded)
        return None
    clock.lap("calibration")
    model_info = ModelInfo(name=recipe.model, path=str(path), fingerprint=model_fingerprint, dtype=recipe.dtype,
                           quantization=recipe.quantization, architecture=type(model).__name__)
    settings = {"samples_per_prompt": config.samples_per_prompt, "max_new_tokens": recipe.max_new_tokens,
                "seed": recipe.seed}
    report = build_report(cal, model=model_info, recipe=recipe_to_dict(recipe), recipe_name=recipe_name,
                          sampling=rollouts.describe() if rollouts else sampling.describe(), settings=settings,
                          command_line=command_line)
    if recipe.mix:
        report.mixed_bound = _mixed_summary(cal, recipe.mix)
    clock.lap("report")
    if rank == 0:  # every rank holds the merged result; one writes it
        write_run_with_pages(out, cal, report, overwrite, clock)
        log(f"written: {out}")
    finish_checkpoint(ckpt, rank, world, sharded)
    return RunResult(cal, report, out)


def _mixed_summary(cal: Calibration, weights: dict) -> dict:
    """The mixed bound's common factor and its largest coordinate, for the report."""
    bound = cal.mixed_bound(weights)
    worst = max(float(b.max()) for b in bound.values())
    return {"weights": weights, "bound_max": worst,
            "formula": "|sum_o c_o g_o,i| <= sum_o |c_o| sqrt(F_i^(o) S_o)"}
