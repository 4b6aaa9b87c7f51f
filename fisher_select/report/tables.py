"""The report's one table renderer, as markdown lines and as HTML (every section of report.md / .html uses it)."""

from __future__ import annotations

import html
from collections.abc import Sequence


def markdown_table(header: Sequence, rows: Sequence[Sequence]) -> list[str]:
    """A markdown table; a ``|`` inside a cell is escaped so that it cannot split the cell."""
    cells = [[str(c).replace("|", "\\|") for c in r] for r in rows]
    return ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in cells]


def html_table(header: Sequence, rows: Sequence[Sequence]) -> str:
    """An HTML table, every header and cell escaped."""
    e = html.escape
    head = "".join(f"<th>{e(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"
