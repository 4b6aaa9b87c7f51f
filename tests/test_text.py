"""What the project ships speaks about the product, to its user: no first-person asides about how it
was built, and no words about the machines it was built on rather than the ones it runs on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Each pattern is a way such text was written here before; a hit names the file and line.
FORBIDDEN = {
    "first-person aside": r"\bof mine\b|\bmy own\b|\bI (?:measured|ran|tried|had|did|saw)\b|\bHonestly\b",
    "the build environment": r"\bthis workplace\b|\bwas lent\b|\bnone was lent\b|\bno GPU has been\b|\bsessions so far\b",
    "a helper path of the build environment": r"^/\.(?:gl|whl)/$",
    "a file outside the repository": r"\.\./shared\b",
}
SHIPPED = ["README.md", "CHANGELOG.md", "Makefile", ".gitignore", "pyproject.toml", "docs/*.md", "scripts/*",
           "bench/*.py", "bench/results/*.md", "examples/*.py", "fisher_select/**/*.py", "fisher_select/recipes/*.yaml"]


def shipped_files() -> list[Path]:
    return sorted({p for pattern in SHIPPED for p in ROOT.glob(pattern) if p.is_file()})


def offending_lines(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            if re.search(pattern, line, flags=re.M):
                found.append(f"{number}: {what}: {line.strip()[:100]}")
    return found


def test_shipped_text_speaks_about_the_product():
    problems = [f"{p.relative_to(ROOT)}:{hit}" for p in shipped_files() for hit in offending_lines(p.read_text())]
    assert problems == []


@pytest.mark.parametrize("line", ["a test run of mine had overlapped them", "Honestly:",
                                  "none was lent to this project's sessions so far", "/.whl/",
                                  "see ../" "shared/notes.md"])  # split: the project itself names no such path
def test_the_check_catches_each_kind(line):
    assert offending_lines(line)


def test_the_check_passes_product_text():
    assert offending_lines("Measured on a 2-core CPU on 2026-12-03 with `bench/bench_engine.py`.") == []
