"""From a recipe to a finished run directory: the job behind `fisher-select calibrate`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fisher_select.calibration.calibrator import Calibration, calibrate, check_inputs
from fisher_select.config import RecipeConfig, build_objectives, recipe_to_dict
from fisher_select.calibration.distributed import init_from_env, rank_world
from fisher_select.models import fingerprint, load_model
from fisher_select.calibration.prompts import load_prompts
from fisher_select.report.build import build_report, write_run
from fisher_select.atomic import check_dir_target
from fisher_select.rundir import ModelInfo, RunReport
from fisher_select.calibration.sampling import SamplingConfig


@dataclass
class RunResult:
    calibration: Calibration
    report: RunReport
    out: Path


def run_recipe(recipe: RecipeConfig, out: str | Path, *, overwrite: bool = False, progress: bool = True,
               recipe_name: str | None = None) -> RunResult:
    """Load model and prompts, calibrate every objective of the recipe, write the run directory."""
    out = Path(out)
    check_dir_target(out, overwrite)  # refuse before spending minutes on calibration
    device = init_from_env(recipe.device)  # torchrun / accelerate: one rank per device
    rank, _ = rank_world()
    prompts = load_prompts(recipe.prompts, limit=recipe.num_prompts)
    objectives = build_objectives(recipe)
    sampling = SamplingConfig(**recipe.sampling)  # checked by load_recipe (and again by calibrate, for API callers)
    # The prompt and objective checks, before minutes of model loading; the sampling keys are not re-checked.
    check_inputs(prompts, objectives, recipe.samples_per_prompt, None)  # sampling: checked by load_recipe
    model, tokenizer, path = load_model(recipe.model, device, recipe.dtype, recipe.quantization)
    cal = calibrate(model, tokenizer, prompts, objectives, samples_per_prompt=recipe.samples_per_prompt,
                    max_new_tokens=recipe.max_new_tokens, seed=recipe.seed, batch_size=recipe.batch_size,
                    sampling=sampling, progress=progress and rank == 0)
    model_info = ModelInfo(name=recipe.model, path=str(path), fingerprint=fingerprint(model), dtype=recipe.dtype,
                           quantization=recipe.quantization, architecture=type(model).__name__)
    settings = {"samples_per_prompt": recipe.samples_per_prompt, "max_new_tokens": recipe.max_new_tokens,
                "seed": recipe.seed}
    report = build_report(cal, model=model_info, recipe=recipe_to_dict(recipe), recipe_name=recipe_name,
                          sampling=sampling.describe(), settings=settings)
    if recipe.mix:
        report.mixed_bound = _mixed_summary(cal, recipe.mix)
    if rank == 0:  # every rank holds the merged result; one writes it
        write_run(out, cal, report, overwrite)
    return RunResult(cal, report, out)


def _mixed_summary(cal: Calibration, weights: dict) -> dict:
    """The mixed bound's common factor and its largest coordinate, for the report."""
    bound = cal.mixed_bound(weights)
    worst = max(float(b.max()) for b in bound.values())
    return {"weights": weights, "bound_max": worst,
            "formula": "|sum_o c_o g_o,i| <= sum_o |c_o| sqrt(F_i^(o) S_o)"}
