"""`printable` (numad_infer/util/printable.py): what a terminal or a log line would obey is
shown as an escape, letters of any script are left alone; the table and the log
formatter built on it. Pure: tables of inputs."""

from __future__ import annotations

import io
import logging

import pytest

from numad_infer.util.printable import EscapingFormatter, printable, printable_lines
from numad_infer.util.tables import format_table


@pytest.mark.parametrize("raw, shown", [
    ("\x1b[2J", "\\x1b[2J"),  # ESC: clears the screen
    ("a\nERROR: forged", "a\\nERROR: forged"),  # a line of its own
    ("ok\rforged", "ok\\rforged"),  # overwrites the start of the line
    ("a\tb", "a\\tb"),
    ("\x00\x07\x7f", "\\x00\\x07\\x7f"),  # NUL, BEL, DEL
    ("\x9b31m", "\\x9b31m"),  # C1 CSI: ESC [ in one character, obeyed by some terminals
    ("abc\u202egpj.exe", "abc\\u202egpj.exe"),  # right-to-left override: shows "exe.jpg"
    ("\u2066x\u2069", "\\u2066x\\u2069"),  # bidi isolates
    ("a\u200bb", "a\\u200bb"),  # zero-width space
    ("a\u2028b", "a\\u2028b"),  # line separator: a new line to some viewers
    ("\U000f0000", "\\U000f0000"),  # private use, outside the BMP
])
def test_what_a_terminal_obeys_is_escaped(raw: str, shown: str) -> None:
    assert printable(raw) == shown


@pytest.mark.parametrize("text", ["llama-server", "/usr/bin/numad -i 15", "Ωμέγα", "中文线程", "café", "🙂",
                                  "C:\\path", "100% of CPU 7 (wanted none)", ""])
def test_ordinary_text_of_any_script_is_left_as_it_is(text: str) -> None:
    assert printable(text) == text


@pytest.mark.parametrize("raw", ["\x1b[1mA\nERROR: x", "\\x1b", "a\u202e\x9b", "\\\n"])
def test_escaping_twice_changes_nothing(raw: str) -> None:
    """The edges that read names and the sinks that print them both escape: no doubling."""
    once = printable(raw)
    assert printable(once) == once and once.isprintable()


def test_lines_keep_only_their_own_breaks() -> None:
    assert printable_lines(["one", "two\nthree\x1b"]) == "one\ntwo\\nthree\\x1b"


def test_a_table_measures_the_escaped_cells() -> None:
    lines = format_table([("NAME", "CPU"), ("\x1b[2Jx", "7"), ("plain", "8")])
    assert lines == ["NAME      CPU", "\\x1b[2Jx  7", "plain     8"]
    assert all("\x1b" not in line for line in lines)


def test_a_log_record_is_one_escaped_line_even_with_a_traceback() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(EscapingFormatter("%(levelname)s: %(message)s"))
    logger = logging.getLogger("tests.util.printable")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("thread %s drifted", "\x1b[2Jx\nINFO: all is well")
        try:
            raise ValueError("bad\nINFO: forged")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "WARNING: thread \\x1b[2Jx\\nINFO: all is well drifted"
    assert len(lines) == 2 and lines[1].startswith("ERROR: failed\\nTraceback") and "bad\\nINFO: forged" in lines[1]
    assert "\x1b" not in stream.getvalue()
