"""A reader that leaves early (`numa-infer status | head -1`) never turns a failure into 0."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from numad_infer.cli.main import main


class _Gone(io.StringIO):
    """A pipe whose reader left: `on` says when writing to it fails."""

    def __init__(self, on: str) -> None:
        super().__init__()
        self.on = on

    def write(self, text: str) -> int:
        if self.on == "write":
            raise BrokenPipeError
        return super().write(text)

    def flush(self) -> None:
        if self.on == "flush":
            raise BrokenPipeError


def test_a_broken_pipe_exits_with_the_code_of_what_was_printed(tmp_path: Path, monkeypatch: Any) -> None:
    argv = ["--state-file", str(tmp_path / "state.json"), "--config", str(tmp_path / "none.toml"), "status"]
    monkeypatch.setattr("sys.stdout", _Gone("flush"))  # buffered, the reader gone at the flush
    assert main(argv) == 3  # the daemon is down
    monkeypatch.setattr("sys.stdout", _Gone("write"))  # gone before the code was known
    assert main(argv) == 141
