"""``fisher-select recipes``: list the shipped recipes; ``recipes show NAME`` explains one.

Shipped recipes live in the repository's ``recipes/`` folder beside the package
(``config.recipes_dir()``). ``show`` accepts a shipped name or any recipe file and prints each
objective's signal and scale formulas, its data needs and caveats, the notes at the top of the
file, and the resolved configuration (validated, paths made absolute), each key after a comment
with its help text. ``recipes fields`` prints the reference of every recipe key (docs/RECIPES.md).
"""

from __future__ import annotations

from fisher_select.commands import HELP

import argparse
from pathlib import Path

from fisher_select.recipe import (check_objective_files, commented_yaml, find_recipe, load_recipe, recipe_reference,
                                  recipe_to_dict, recipes_dir)
from fisher_select.errors import FisherSelectError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "recipes",
        help=HELP["recipes"],
        description="List the shipped recipes (name, objectives, description), explain one with `show`, "
                    "or print the reference of every recipe key with `fields` (Markdown, docs/RECIPES.md).",
    )
    sub = p.add_subparsers(dest="recipes_action", metavar="{show,fields}")
    show = sub.add_parser("show", help="objectives, formulas, data needs, caveats and resolved configuration")
    show.add_argument("name", help="a shipped recipe's name (see `fisher-select recipes`) or a recipe file")
    show.set_defaults(func=run_show)
    keys = sub.add_parser("fields", help="every recipe and objective key: type, default, description (Markdown)")
    keys.set_defaults(func=run_fields)
    p.set_defaults(func=run_list)


def shipped_recipes() -> list[Path]:
    """The recipe files shipped in ``recipes/``, sorted by name."""
    folder = recipes_dir()
    if not folder.is_dir():
        raise FisherSelectError(f"no recipes folder at {folder}; pass a recipe file to `recipes show`")
    return sorted(folder.glob("*.yaml"))


def run_list(args: argparse.Namespace) -> int:
    rows = []
    for path in shipped_recipes():
        try:
            recipe = load_recipe(path)
            types = ", ".join(_type_names(recipe))
            rows.append((path.stem, types, recipe.description))
        except FisherSelectError as exc:  # one broken file should not hide the others
            rows.append((path.stem, "?", f"INVALID: {exc}"))
    width = max([len("name")] + [len(r[0]) for r in rows])
    kinds = max([len("objectives")] + [len(r[1]) for r in rows])
    print(f"{'name':<{width}}  {'objectives':<{kinds}}  description")
    for name, types, description in rows:
        print(f"{name:<{width}}  {types:<{kinds}}  {description}")
    print(f"\n{len(rows)} recipe(s) in {recipes_dir()}; `fisher-select recipes show NAME` explains one")
    return 0


def run_show(args: argparse.Namespace) -> int:
    path = find_recipe(args.name)
    recipe = load_recipe(path)
    check_objective_files(recipe)  # explained from the configs, no objective built: no torch loaded
    print(f"recipe: {path.stem}  ({path})")
    print(f"description: {recipe.description}")
    for i, cfg in enumerate(recipe.objectives, start=1):
        print()
        for line in _objective_lines(i, cfg):
            print(line)
    notes = _header_comments(path)
    if notes:
        print("\nnotes (from the recipe file):")
        for line in notes:
            print(f"  {line}")
    print("\nresolved configuration:")
    print(commented_yaml(recipe))
    return 0


def run_fields(args: argparse.Namespace) -> int:
    print(recipe_reference())
    return 0


def _type_names(recipe) -> list[str]:
    return [entry["type"] for entry in recipe_to_dict(recipe)["objectives"]]


def _objective_lines(i: int, cfg) -> list[str]:
    about = cfg.about()
    d = about.describe(cfg.name)
    lines = [f"objective {i}: {d['name']} (type {d['type']})",
             f"  signal: {d['signal']}",
             f"  scale:  {d['scale']}",
             f"  data:   {d['data']}"]
    if about.token_level:  # a token-level type's config sets its sign draws
        lines.append(f"  Fisher: token-level F^tok (Rademacher sign draws: {cfg.sign_draws})")
    else:
        lines.append("  Fisher: the shared model Fisher F")
    if about.min_samples_per_prompt > 1:
        lines.append(f"  needs:  samples_per_prompt >= {about.min_samples_per_prompt}")
    lines.append("  caveats:")
    lines.extend(f"    - {c}" for c in d["caveats"])
    return lines


def _header_comments(path: Path) -> list[str]:
    """The comment block at the top of a recipe file (what the signal is, data, when loose)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        out.append(line[2:] if line.startswith("# ") else line[1:])  # keeps the comment's indentation
    return out
