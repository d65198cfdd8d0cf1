"""Plain-text tables, the one layout every command's output uses (`plan`, `status`, `tune`). Pure."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells, the header first -> lines: columns left-aligned two spaces apart, no
    trailing blanks (so the last column may be empty without padding the line)."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in rows]
