"""Plain-text tables, the one layout every command's output uses (`plan`, `status`, `tune`). Pure."""

from __future__ import annotations

from collections.abc import Sequence

from numad_infer.util.printable import printable


def format_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells, the header first -> lines: columns left-aligned two spaces apart, no
    trailing blanks (so the last column may be empty without padding the line). Cells are
    escaped (`printable`) before they are measured: a name with a control character in it
    neither reaches the terminal nor shifts the columns."""
    cells = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[c]) for row in cells) for c in range(len(cells[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in cells]
