"""The reports' Markdown tables: one renderer, padded so the tables read as plain text too."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MISSING = "—"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Iterable[int] = ()) -> str:
    """A Markdown table with padded columns, readable as plain text too; ``right``: right-aligned columns."""
    right = set(right)
    cells = [list(header), *[[str(c).replace("|", "\\|") for c in row] for row in rows]]
    widths = [max(3, *(len(row[i]) for row in cells)) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(row, widths))) + " |"

    rule = "| " + " | ".join("-" * (w - 1) + ":" if i in right else "-" * w for i, w in enumerate(widths)) + " |"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])
