"""Print the import cycles among fisher_select's modules (exit 1 if any); tests/test_layout.py checks them and the floors."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "fisher_select"

# The floors, lowest first: a module imports only from its own floor or lower ones, and on its own
# floor only from its own package (the ground floor's modules may use each other, and so may the
# interface's: the CLI, its commands and the package's lazy exports). A name matches
# a module and everything below it; the longest match wins.
FLOORS = [
    ("ground", ["fisher_select.version", "fisher_select.errors", "fisher_select.atomic", "fisher_select.caveats",
                "fisher_select.fields", "fisher_select.distributed", "fisher_select.stats", "fisher_select.timing"]),
    ("run schema", ["fisher_select.rundir", "fisher_select.run"]),
    ("engine", ["fisher_select.engine"]),
    ("model names", ["fisher_select.model_names"]),
    ("models", ["fisher_select.models"]),
    ("calibration", ["fisher_select.calibration"]),
    ("recipes", ["fisher_select.config"]),
    ("report and outputs", ["fisher_select.report", "fisher_select.outputs"]),
    ("run report", ["fisher_select.run_report"]),
    ("training", ["fisher_select.training"]),
    ("studies", ["fisher_select.studies"]),
    ("pipeline", ["fisher_select.pipeline"]),
    ("interface", ["fisher_select.commands", "fisher_select.cli", "fisher_select.__main__", "fisher_select"]),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph() -> dict[str, set[str]]:
    """Module -> the fisher_select modules it imports at module level (function-level imports too)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                # `from pkg import submodule` depends on the submodule, not on the package's __init__
                targets = [s for s in subs if s in modules] or [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    edges[name].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def floor_of(module: str) -> tuple[int, str]:
    """(floor index, the matched prefix: the module's package on that floor)."""
    best = None
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (index, prefix)
    if best is None:
        raise KeyError(f"{module} is on no floor; add it to FLOORS in scripts/import_graph.py")
    return best


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Imports that go up a floor, or sideways into another package of the same floor."""
    out = []
    for module, targets in sorted(edges.items()):
        floor, package = floor_of(module)
        for target in sorted(targets):
            t_floor, t_package = floor_of(target)
            if t_floor > floor:
                out.append(f"{module} ({FLOORS[floor][0]}) imports {target} from a higher floor ({FLOORS[t_floor][0]})")
            elif t_floor == floor and t_package != package and floor not in (0, len(FLOORS) - 1):
                out.append(f"{module} imports {target}, another package of the same floor ({FLOORS[floor][0]})")
    return out


if __name__ == "__main__":
    edges = graph()
    found = cycles(edges)
    for c in found:
        print("cycle:", " <-> ".join(c))
    problems = violations(edges)
    for line in problems:
        print("floor:", line)
    sys.exit(1 if found or problems else 0)
