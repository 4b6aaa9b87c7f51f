"""Recipes: typed dataclasses, one source of defaults, validated in one place.

A recipe is a YAML file whose keys are the fields of ``RecipeConfig``; ``objectives`` is a
list of objective configs, each a mapping with a ``type`` naming a registered objective (the
dataclass registered for it lists its keys). ``load_recipe`` collects every problem (unknown
keys, wrong types, missing fields) and raises one ``FisherSelectError`` naming file and key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fisher_select.calibration.objectives.registry import OBJECTIVE_TYPES
from fisher_select.errors import FisherSelectError
from fisher_select.models import EMBEDDED_DEFAULT
from fisher_select.calibration.sampling import SamplingConfig
from fisher_select.validation import build_dataclass


@dataclass
class RecipeConfig:
    """Everything one calibration run needs; CLI flags override these fields."""

    objectives: list  # objective configs (dataclass instances after validation)
    prompts: str  # JSONL, relative to the recipe file
    description: str = ""
    model: str = EMBEDDED_DEFAULT
    num_prompts: int | None = None
    samples_per_prompt: int = 4
    max_new_tokens: int = 64
    seed: int = 0
    batch_size: int = 8
    device: str = "cpu"
    dtype: str = "float32"
    quantization: str | None = None  # None, "nf4", "fp4" or "int8" (bitsandbytes)
    sampling: dict = field(default_factory=dict)
    mix: dict | None = None  # objective name -> weight c_o, for the mixed bound


def parse_recipe(data: Any, source: str, base_dir: Path | None = None) -> RecipeConfig:
    """Validate a recipe mapping; one error listing every problem."""
    errors: list[str] = []
    objectives = []
    if isinstance(data, dict):
        data = dict(data)
        if "objective" in data:  # a single objective may be given without the list
            if "objectives" in data:
                errors.append(f"{source}: give either 'objective' or 'objectives', not both")
            data["objectives"] = [data.pop("objective")]
        objectives = _parse_objectives(data.get("objectives"), source, errors)
    recipe = build_dataclass(RecipeConfig, data, source, errors)
    if recipe is not None:
        recipe.objectives = objectives
        _check_values(recipe, source, errors)
        if base_dir is not None and not Path(recipe.prompts).is_absolute():
            recipe.prompts = str((base_dir / recipe.prompts).resolve())
        if base_dir is not None:  # objective data files (SFT demonstrations) are relative to the recipe too
            for cfg in objectives:
                if hasattr(cfg, "resolve_paths"):
                    cfg.resolve_paths(base_dir)
    if errors:
        raise FisherSelectError(f"invalid recipe {source}: " + "; ".join(errors))
    return recipe


def _parse_objectives(items, source: str, errors: list[str]) -> list:
    if items is None:
        return []  # reported as a missing key
    if not isinstance(items, list) or not items:
        errors.append(f"{source}.objectives: expected a non-empty list of objective mappings")
        return []
    out = []
    for i, item in enumerate(items):
        where = f"{source}.objectives[{i}]"
        kind = item.get("type") if isinstance(item, dict) else None
        if kind not in OBJECTIVE_TYPES:
            errors.append(f"{where}.type: expected one of {sorted(OBJECTIVE_TYPES)}, got {kind!r}")
            continue
        cfg = build_dataclass(OBJECTIVE_TYPES[kind][0], {k: v for k, v in item.items() if k != "type"}, where, errors)
        if cfg is not None:
            check = getattr(cfg, "problems", None)
            errors.extend(f"{where}: {p}" for p in (check() if check else []))
            out.append(cfg)
    return out


def _check_values(r: RecipeConfig, source: str, errors: list[str]) -> None:
    """Value checks the types cannot express."""
    for name in ("samples_per_prompt", "max_new_tokens", "batch_size"):
        if getattr(r, name) < 1:
            errors.append(f"{source}.{name}: must be at least 1, got {getattr(r, name)}")
    if r.num_prompts is not None and r.num_prompts < 1:
        errors.append(f"{source}.num_prompts: must be at least 1, got {r.num_prompts}")
    if r.dtype not in ("float32", "bfloat16", "float16", "auto"):
        errors.append(f"{source}.dtype: expected float32, bfloat16, float16 or auto, got {r.dtype!r}")
    if r.quantization not in (None, "nf4", "fp4", "int8"):
        errors.append(f"{source}.quantization: expected nf4, fp4 or int8, got {r.quantization!r}")
    sampling = build_dataclass(SamplingConfig, r.sampling, f"{source}.sampling", errors)
    if sampling is not None:
        errors.extend(f"{source}: {p}" for p in sampling.problems())


def load_recipe(path: str | Path) -> RecipeConfig:
    """Read and validate a recipe file (paths inside it are relative to the file)."""
    path = Path(path)
    if not path.is_file():
        raise FisherSelectError(f"recipe {path} not found; `fisher-select recipes` lists the shipped ones")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise FisherSelectError(f"recipe {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    return parse_recipe(data, str(path), path.parent)


def apply_overrides(recipe: RecipeConfig, overrides: dict, source: str = "command line") -> RecipeConfig:
    """Flags override recipe fields (None means not given); the result is validated again."""
    data = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)}
    data["objectives"] = [
        {"type": _type_of(o), **dataclasses.asdict(o)} for o in recipe.objectives
    ]
    data.update({k: v for k, v in overrides.items() if v is not None})
    return parse_recipe(data, source)


def _type_of(cfg) -> str:
    for name, (cls, _) in OBJECTIVE_TYPES.items():
        if isinstance(cfg, cls):
            return name
    raise AssertionError(f"unregistered objective config {type(cfg).__name__}")


def recipe_to_dict(recipe: RecipeConfig) -> dict:
    """The resolved configuration, for reports and ``recipes show``."""
    data = dataclasses.asdict(recipe)
    data["objectives"] = [{"type": _type_of(o), **dataclasses.asdict(o)} for o in recipe.objectives]
    return data


def build_objectives(recipe: RecipeConfig, base_dir: Path | None = None) -> list:
    return [OBJECTIVE_TYPES[_type_of(c)][1](c, base_dir) for c in recipe.objectives]


def recipes_dir() -> Path:
    """The shipped recipes: ``recipes/`` beside the package (repository checkout or editable install)."""
    return Path(__file__).resolve().parent.parent / "recipes"


def find_recipe(name_or_path: str) -> Path:
    """A recipe file path, or the name of a shipped recipe (``rl-arithmetic``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for folder in (recipes_dir(), Path.cwd() / "recipes"):  # checkout / editable install, or a project folder
        shipped = folder / f"{name_or_path}.yaml"
        if shipped.is_file():
            return shipped
    names = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
    raise FisherSelectError(f"recipe {name_or_path!r} is neither a file nor a shipped recipe ({', '.join(names)})")
