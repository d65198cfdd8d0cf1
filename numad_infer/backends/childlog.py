"""Where a child's output goes (process backend): a log file in the state directory, or
the daemon's standard output, line by line, each line prefixed with the child's name.

In a container there is no journal: `numa-infer run --instance-logs stdout` (the image's
entrypoint) puts `infer@0: ...` and `frontdoor: ...` lines beside the daemon's own. Each
line is escaped (`printable`): a carriage return or an escape sequence in a child's
output would otherwise overwrite the prefix that says whose line it is.
"""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO

from numad_infer.systemd.unitdir import check_private_dir
from numad_infer.util.printable import printable

# A line longer than this is forwarded in pieces, each with its prefix: a child that never
# ends a line cannot make the daemon hold its output in memory.
MAX_LINE = 16384
STDOUT_FD = 1

_write_lock = threading.Lock()  # one whole line at a time on stdout, whichever child it is from


class InstanceLogs(str, Enum):
    FILE = "file"  # <state dir>/logs/<name>.log
    STDOUT = "stdout"  # the daemon's stdout, `<name>: ` before each line


def open_log(log_dir: Path, name: str) -> BinaryIO:
    """Append to a log in the daemon's state directory, never through a planted symlink."""
    check_private_dir(log_dir)
    fd = os.open(log_dir / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    return os.fdopen(fd, "ab")


@dataclass(frozen=True)
class ChildOutput:
    mode: InstanceLogs
    log_dir: Path

    def popen(self, name: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start `argv` with its stdout and stderr sent where this mode says."""
        if self.mode is InstanceLogs.FILE:
            with open_log(self.log_dir, f"{name}.log") as output:
                return subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT, **kwargs)
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
        assert child.stdout is not None
        # A thread per child: the daemon's loop never waits on a child's output.
        threading.Thread(target=forward, args=(child.stdout, name), name=f"log {name}", daemon=True).start()
        return child


def forward(pipe: BinaryIO, name: str, fd: int = STDOUT_FD) -> None:
    """Copy `pipe` to `fd` line by line, `name: ` first, until the child closes it."""
    prefix = f"{name}: ".encode()
    with pipe:
        for line in iter(lambda: pipe.readline(MAX_LINE), b""):
            text = printable(line.rstrip(b"\r\n").decode("utf-8", "replace"))
            _write_all(fd, prefix + text.encode() + b"\n")


def _write_all(fd: int, data: bytes) -> None:
    with _write_lock:
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            pass  # stdout is gone: keep reading, so the child never blocks on a full pipe
