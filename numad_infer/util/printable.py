"""Text others named, made safe to show: a thread's name, a path, a line read from /proc
or from an instance. Pure.

Anyone may name a thread (prctl PR_SET_NAME) or a file, and the kernel shows the name as
it is, ESC and newline included. Printed raw, such a name moves the cursor, recolours or
clears an operator's terminal, or starts a line of its own that reads like ours (in the
journal, in `kubectl logs`, in `doctor`). So every character that does not print itself is
shown as an escape: C0 and C1 controls, DEL, and Unicode's invisible ones (bidi
overrides, zero-width characters, separators). Letters of any script stay as they are.

The backslash is left alone on purpose: escaping it too would make every escape change
text that is already escaped, and `printable(printable(s)) == printable(s)` lets the
edges that read such text and the sinks that print it both escape without knowing of
each other.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

# The three controls everyone reads at a glance; the rest as hexadecimal.
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str) -> str:
    """`text` with every character that does not print itself written as an escape
    (`\\x1b`, `\\n`, `\\u202e`): one line, nothing a terminal obeys."""
    if text.isprintable():  # nearly always: one pass in C
        return text
    return "".join(char if char.isprintable() else _escape(char) for char in text)


def printable_lines(lines: Iterable[str]) -> str:
    """`lines` escaped one by one and joined by newlines: only our own line breaks remain."""
    return "\n".join(printable(line) for line in lines)


class EscapingFormatter(logging.Formatter):
    """One log record, one line, nothing a terminal obeys: the journal and `kubectl logs`
    read each line as a record of its own, so a name with a newline in it could forge
    one. A traceback (a record with exc_info) is one line too, its line breaks as `\\n`."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))
