"""The code's floors: no import cycle, and no import from a lower floor to a higher one."""

from __future__ import annotations

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
