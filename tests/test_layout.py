"""The code's floors: no import cycle, and no import from a lower floor to a higher one."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


def test_no_module_imports_upward_or_in_a_cycle():
    edges = import_graph.graph()
    assert import_graph.cycles(edges) == []
    assert import_graph.violations(edges) == []


def test_every_module_is_on_a_floor():
    for module in import_graph.graph():
        import_graph.floor_of(module)  # raises KeyError naming a module on no floor


def test_the_guard_catches_an_upward_import_and_a_cycle():
    edges = {"fisher_select.stats.ranking": {"fisher_select.report.text"}, "fisher_select.report.text": set()}
    assert "higher floor" in import_graph.violations(edges)[0]
    sideways = {"fisher_select.report.text": {"fisher_select.outputs.masks"}, "fisher_select.outputs.masks": set()}
    assert "same floor" in import_graph.violations(sideways)[0]
    loop = {"fisher_select.report.a": {"fisher_select.report.b"}, "fisher_select.report.b": {"fisher_select.report.a"}}
    assert import_graph.cycles(loop) == [["fisher_select.report.a", "fisher_select.report.b"]]


# -- size: no module over 500 lines, no class over 250, no function over 60 (outside tests) ------------------

SIZE_LIMITS = {"module": 500, "class": 250, "function": 60}
EXEMPT = "# size-exempt:"  # a one-line reason, between the header and the first statement, lets one stay longer


def _exempt(lines: list[str], first: int, last: int) -> bool:
    """A reason ``# size-exempt: why`` on lines first..last (1-based), with the why non-empty."""
    return any(line.strip().startswith(EXEMPT) and line.strip()[len(EXEMPT):].strip() for line in lines[first - 1:last])


def size_violations(source: str, path: str) -> list[str]:
    """Every module, class or function of ``source`` over its limit and without a reason at its top."""
    lines, tree = source.splitlines(), ast.parse(source)
    out = []
    top = tree.body[0].lineno - 1 if tree.body else len(lines)  # the module's top: before its first statement
    if len(lines) > SIZE_LIMITS["module"] and not _exempt(lines, 1, top):
        out.append(f"{path}: module of {len(lines)} lines (limit {SIZE_LIMITS['module']})")
    for node in ast.walk(tree):
        kind = "class" if isinstance(node, ast.ClassDef) else \
            "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if kind is None:
            continue
        size = node.end_lineno - node.lineno + 1
        if size > SIZE_LIMITS[kind] and not _exempt(lines, node.lineno, node.body[0].lineno - 1):
            out.append(f"{path}:{node.lineno}: {kind} {node.name} of {size} lines (limit {SIZE_LIMITS[kind]})")
    return out


def test_no_module_class_or_function_over_its_size_limit():
    found = [v for p in sorted((ROOT / "fisher_select").rglob("*.py"))
             for v in size_violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == [], "split these, or give the reason in one line at the top (" + EXEMPT + " why):\n" + "\n".join(found)


def test_the_size_guard_catches_a_long_function_unless_it_says_why():
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    assert "function f of 61 lines" in size_violations(f"def f():\n{body}", "m.py")[0]
    assert size_violations(f"def f():\n    {EXEMPT} one table, read top to bottom\n{body}", "m.py") == []
    assert size_violations(f"def f():\n    {EXEMPT}\n{body}", "m.py") != []  # a marker without a reason
    long_class = "class C:\n" + "".join(f"    x{i} = {i}\n" for i in range(250))
    assert "class C of 251 lines" in size_violations(long_class, "m.py")[0]
    long_module = "".join(f"x{i} = {i}\n" for i in range(501))
    assert "module of 501 lines" in size_violations(long_module, "m.py")[0]
    assert size_violations(f"{EXEMPT} generated table\n" + long_module, "m.py") == []
