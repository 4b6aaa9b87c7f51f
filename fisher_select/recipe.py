"""Recipes: typed dataclasses, one source of defaults, validated in one place.

A recipe is a YAML file whose keys are the fields of ``RecipeConfig``; ``objectives`` is a
list of objective configs, each a mapping with a ``type`` naming a registered objective (the
dataclass registered for it lists its keys). Every config field carries its help text
(``metadata={"help": ...}``), from which the CLI flags, ``recipes show`` and docs/RECIPES.md
are generated. ``load_recipe`` collects every problem (unknown keys, wrong types, missing
fields, bad values) and raises one ``FisherSelectError`` naming the file and each key. Reading,
checking and explaining a recipe loads no torch; ``build_objectives`` imports the objectives.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fisher_select.calibration.objectives.registry import OBJECTIVE_TYPES, build_objective, type_of
from fisher_select.calibration.config import CalibrationConfig, SamplingConfig, TeacherConfig
from fisher_select.errors import FisherSelectError
from fisher_select.model_names import DTYPE_NAMES, EMBEDDED_DEFAULT, QUANTIZATIONS
from fisher_select.fields import build_dataclass, describe_field, fields_table

_SINGLE = "objective"  # a recipe may give one objective under this key instead of a list
_FILE_KEYS = ("prompts", "rollouts")  # relative paths: relative to the recipe file (or, from a flag, to the working directory)


@dataclass(kw_only=True)
class RecipeConfig(CalibrationConfig):
    """Everything one calibration run needs; CLI flags override these fields. The calibration's own
    fields (samples per prompt, response length, seed, batch size, memory mode) are inherited from
    ``CalibrationConfig``, declared once there; ``calibration_config()`` hands them to ``calibrate``."""

    objectives: list = field(metadata={
        "help": "the objectives, each a mapping with a 'type' and that type's keys (below); "
                "one objective may be given as 'objective: {...}' instead of a list"})
    prompts: str = field(metadata={"help": "prompts file (JSONL), relative to the recipe file"})
    description: str = field(default="", metadata={"help": "one line shown by `fisher-select recipes` and in the report"})
    model: str = field(default=EMBEDDED_DEFAULT, metadata={
        "help": "embedded default name, local model directory, .gguf file, or a hub id already in the local cache"})
    num_prompts: int | None = field(default=None, metadata={
        "help": "calibrate on the first N prompts of the file (default all)", "min": 1})
    rollouts: str | None = field(default=None, metadata={
        "help": "score these rollouts (JSONL, or Parquet with pyarrow) instead of sampling: their prompts and K "
                "replace prompts and samples_per_prompt; field mapping in docs/ROLLOUTS.md"})
    checkpoint_every: int | None = field(default=None, metadata={
        "help": "write a checkpoint (accumulators, generator states, samples) to OUT.checkpoint/ every N prompt "
                "batches, so `calibrate --resume` continues after a kill; each costs the accumulators' bytes "
                "on disk (default: none)",
        "min": 1,
    })  # the CLI's, not calibrate()'s: the API takes a CheckpointConfig
    device: str = field(default="cpu", metadata={
        "help": "torch device (cpu, cuda, cuda:1, mps), or auto to spread a large model over the devices"})
    dtype: str = field(default="float32", metadata={
        "help": "dtype the weights are loaded in (scores and Fisher accumulate in fp32 regardless)",
        "choices": DTYPE_NAMES})
    quantization: str | None = field(default=None, metadata={
        "help": "load the Linear layers quantized with bitsandbytes (a QLoRA-style base model); "
                "the Fisher is then over the dequantized weights", "choices": QUANTIZATIONS})
    sampling: dict = field(default_factory=dict, metadata={
        "help": "sampling keys (below); only plain sampling at temperature 1 estimates the model Fisher"})
    mix: dict | None = field(default=None, metadata={
        "help": "objective name -> weight c_o, for the mixed bound |sum_o c_o g_o,i| <= sum_o |c_o| sqrt(F_i S_o)"})


def parse_recipe(data: Any, source: str, base_dir: Path | None = None) -> RecipeConfig:
    """Validate a recipe mapping; one error, prefixed once by ``source``, listing every problem."""
    errors: list[str] = []
    objectives = []
    if isinstance(data, dict):
        data = dict(data)
        if _SINGLE in data:  # a single objective may be given without the list
            if "objectives" in data:
                errors.append(f"give either '{_SINGLE}' or 'objectives', not both")
            data["objectives"] = [data.pop(_SINGLE)]
        objectives = _parse_objectives(data.get("objectives"), errors)
        _check_sampling(data.get("sampling", {}), errors)
    recipe = build_dataclass(RecipeConfig, data, "", errors, also_allowed=(_SINGLE,))
    if recipe is not None:
        recipe.objectives = objectives
        if base_dir is not None:
            _resolve_paths(recipe, objectives, base_dir)
    if errors:
        raise FisherSelectError(f"invalid recipe {source}: " + "; ".join(errors))
    return recipe


def _parse_objectives(items, errors: list[str]) -> list:
    if items is None:
        return []  # reported as a missing key
    if not isinstance(items, list) or not items:
        errors.append("objectives: expected a non-empty list of objective mappings")
        return []
    out = []
    for i, item in enumerate(items):
        where = f"objectives[{i}]"
        kind = item.get("type") if isinstance(item, dict) else None
        if kind not in OBJECTIVE_TYPES:
            errors.append(f"{where}.type: expected one of {', '.join(sorted(OBJECTIVE_TYPES))}, got {kind!r}")
            continue
        cfg = build_dataclass(OBJECTIVE_TYPES[kind][0], {k: v for k, v in item.items() if k != "type"}, where, errors)
        if cfg is not None:
            check = getattr(cfg, "problems", None)
            errors.extend(f"{where}: {p}" for p in (check() if check else []))
            out.append(cfg)
    return out


def _check_sampling(data, errors: list[str]) -> None:
    """The sampling keys; the one check of them on the recipe path (the pipeline trusts it)."""
    if not isinstance(data, dict):
        return  # reported as the wrong type of the sampling key
    sampling = build_dataclass(SamplingConfig, data, "sampling", errors)
    if sampling is not None:
        errors.extend(sampling.problems())  # each names its sampling.key


def _resolve_paths(recipe: RecipeConfig, objectives: list, base_dir: Path) -> None:
    for name in _FILE_KEYS:
        if getattr(recipe, name) is not None and not Path(getattr(recipe, name)).is_absolute():
            setattr(recipe, name, str((base_dir / getattr(recipe, name)).resolve()))
    for cfg in objectives:  # objective data files (SFT demonstrations) are relative to the recipe too
        if hasattr(cfg, "resolve_paths"):
            cfg.resolve_paths(base_dir)


def load_recipe(path: str | Path, overrides: dict | None = None) -> RecipeConfig:
    """Read and validate a recipe file (paths inside it are relative to the file), once.

    ``overrides`` (field -> value, None meaning not given: the CLI flags) replace the file's
    values before the validation, so a bad flag is reported with the file's problems.
    """
    path = Path(path)
    if not path.is_file():
        raise FisherSelectError(f"recipe {path} not found; `fisher-select recipes` lists the shipped ones")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise FisherSelectError(f"recipe {path} is not valid YAML: {_yaml_problem(exc)}") from None
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    source = str(path)
    if given:
        source += " with " + ", ".join("--" + k.replace("_", "-") for k in given)
        for name in _FILE_KEYS:  # a path given on the command line is relative to the working directory
            if isinstance(given.get(name), str):
                given[name] = str(Path(given[name]).resolve())
        if isinstance(data, dict):
            data = {**data, **given}
    return parse_recipe(data, source, path.parent)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """yaml's own words with the line and column (1-based) where it went wrong, and what it was parsing."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return problem
    text = f"{_line_column(mark)}: {problem}"
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context:
        text += f" ({context}" + (f" that starts at {_line_column(start)}" if start is not None else "") + ")"
    return text


def _line_column(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"  # yaml's marks count from 0


def recipe_to_dict(recipe: RecipeConfig) -> dict:
    """The resolved configuration, for reports and ``recipes show``."""
    data = dataclasses.asdict(recipe)
    data["objectives"] = [{"type": type_of(o), **dataclasses.asdict(o)} for o in recipe.objectives]
    return data


def build_objectives(recipe: RecipeConfig, base_dir: Path | None = None) -> list:
    return [build_objective(c, base_dir) for c in recipe.objectives]


def check_objective_files(recipe: RecipeConfig) -> None:
    """Read the files the objectives will read (demonstrations), as building them would, without torch."""
    for cfg in recipe.objectives:
        if hasattr(cfg, "check_files"):
            cfg.check_files()


def recipes_dir() -> Path:
    """The shipped recipes and their data: package data (``fisher_select/recipes``, also ``recipes/`` in a checkout)."""
    return Path(str(importlib.resources.files("fisher_select") / "recipes"))


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


# ---------------------------------------------------------------------------
# Generated from the fields: `recipes show` and docs/RECIPES.md

REGENERATE = "python -m fisher_select recipes fields > docs/RECIPES.md"


def commented_yaml(recipe: RecipeConfig) -> str:
    """``recipe_to_dict`` as YAML, each key after a comment with its help, allowed values and default."""
    data = recipe_to_dict(recipe)
    lines = _commented(RecipeConfig, {k: v for k, v in data.items() if k != "objectives"}, "")
    lines.append("# " + describe_field(_field(RecipeConfig, "objectives")))
    lines.append("objectives:")
    for entry in data["objectives"]:
        kind = entry["type"]
        lines.append(f"- type: {kind}")
        lines.extend(_commented(OBJECTIVE_TYPES[kind][0], {k: v for k, v in entry.items() if k != "type"}, "  "))
    return "\n".join(lines)


def _commented(cls: type, values: dict, indent: str) -> list[str]:
    lines = []
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        text = describe_field(f)
        if text:
            lines.append(f"{indent}# {text}")
        dumped = yaml.safe_dump({f.name: values[f.name]}, sort_keys=False, allow_unicode=True, width=1000)
        lines.extend((indent + line).rstrip() for line in dumped.rstrip().splitlines())
    return lines


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def recipe_reference() -> str:
    """docs/RECIPES.md: every recipe key, from the dataclasses' fields and the objective registry."""
    out = ["# Recipe keys", "",
           f"Generated from the config dataclasses' fields; do not edit. Regenerate with `{REGENERATE}`.", "",
           "A recipe is a YAML file. `fisher-select calibrate` takes the top-level scalar keys as flags too "
           "(`--samples-per-prompt 8`), which override the file; `fisher-select recipes show NAME` prints a "
           "recipe's resolved values with these descriptions.", "",
           "## Top level", "", *fields_table(RecipeConfig), "",
           "## `sampling`", "", SamplingConfig.__doc__.strip(), "", *fields_table(SamplingConfig, "sampling."), ""]
    out += ["## Objectives", "",
            "Each entry of `objectives` has a `type`, one of "
            + ", ".join(f"`{k}`" for k in sorted(OBJECTIVE_TYPES)) + ", and that type's keys.", ""]
    for kind in sorted(OBJECTIVE_TYPES):
        cls = OBJECTIVE_TYPES[kind][0]
        out += [f"### `type: {kind}`", "", (cls.__doc__ or "").strip(), "", *fields_table(cls), ""]
    out += ["## Teacher and demonstrator keys", "",
            "The mapping under an objective's `teacher` (`opd-pg`, `opd-full`) or `demonstrator` (`sft`).", "",
            *fields_table(TeacherConfig), ""]
    return "\n".join(out)
