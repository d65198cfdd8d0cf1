"""Where a child's output goes (process backend): a log file in the state directory, kept
under a size, or the daemon's standard output, line by line, each line prefixed with the
child's name.

In a container there is no journal: `numa-infer run --instance-logs stdout` (the image's
entrypoint) puts `infer@0: ...` and `frontdoor: ...` lines beside the daemon's own. Each
line is escaped (`printable`): a carriage return or an escape sequence in a child's
output would otherwise overwrite the prefix that says whose line it is.

A log file is `NAME.log`, and `NAME.log.1` before it: each at most `LOG_MAX_BYTES`, so a
child, however chatty (or compromised), fills at most twice that of the state directory
(/run, a tmpfs in memory, by default). The child writes to a pipe, never to the file: a
thread of the daemon copies the pipe to the file and rotates it before a write would
pass the size. Only then is the bound sure. A child that held the file itself could
write gigabytes between two checks of the daemon (at memory speed on a tmpfs), and
truncating a file another process appends to loses what it writes meanwhile. A child
faster than the copy fills the pipe and waits in write(): the pipe's 64 KiB is all
that is in flight.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import subprocess
import threading
from collections.abc import Callable
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
LOG_MAX_BYTES = 8 << 20  # NAME.log and NAME.log.1 each: 16 MiB a child, at most
_CHUNK = 65536  # read from a child's pipe at once (its whole buffer)
_TAIL = 65536  # of a log, what `last_error_line` reads: its end
# A line that says something went wrong, as servers word it ("couldn't bind HTTP server socket").
_ERROR = re.compile(r"\b(error|errors|fail|failed|failure|fatal|couldn't|could not|cannot|can't|unable|"
                    r"exception|abort|aborted|denied|in use)\b", re.IGNORECASE)
_SHOWN = 300  # characters of such a line shown in status

log = logging.getLogger(__name__)

_write_lock = threading.Lock()  # one whole line at a time on stdout, whichever child it is from
# One log write at a time: two threads of one name (a child stopped and started again, its
# pipe not yet drained) must not both rotate the same file.
_file_lock = threading.Lock()


class InstanceLogs(str, Enum):
    FILE = "file"  # <state dir>/logs/<name>.log
    STDOUT = "stdout"  # the daemon's stdout, `<name>: ` before each line


def open_log(log_dir: Path, name: str) -> BinaryIO:
    """Append to a log in the daemon's state directory, never through a planted symlink."""
    check_private_dir(log_dir)
    return os.fdopen(_open_append(log_dir / name), "ab")


def _open_append(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)


@dataclass(frozen=True)
class ChildOutput:
    mode: InstanceLogs
    log_dir: Path
    max_bytes: int = LOG_MAX_BYTES  # a log file's size (FILE)

    def popen(self, name: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start `argv` with its stdout and stderr sent where this mode says."""
        if self.mode is InstanceLogs.FILE:
            # Checked before the start, as the directory's owner and a planted link are: a
            # log that cannot be written stops the start with the reason.
            open_log(self.log_dir, f"{name}.log").close()
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
        assert child.stdout is not None
        # A thread per child: the daemon's loop never waits on a child's output.
        copy: Callable[..., None] = forward
        args: tuple[object, ...] = (child.stdout, name)
        if self.mode is InstanceLogs.FILE:
            copy, args = to_file, (child.stdout, self.log_dir / f"{name}.log", self.max_bytes)
        threading.Thread(target=copy, args=args, name=f"log {name}", daemon=True).start()
        return child


def to_file(pipe: BinaryIO, path: Path, max_bytes: int = LOG_MAX_BYTES) -> None:
    """Copy `pipe` to `path`, rotated at `max_bytes`, until the child closes it."""
    failing = False
    with pipe:
        for chunk in iter(lambda: os.read(pipe.fileno(), _CHUNK), b""):
            try:
                append_rotated(path, chunk, max_bytes)
                failing = False
            except OSError as exc:
                # Keep reading and drop the output: a child blocked on a full pipe stops serving.
                if not failing:
                    log.warning("%s: cannot write (%s): the output is dropped until it can be", path, exc.strerror)
                failing = True


def append_rotated(path: Path, data: bytes, max_bytes: int) -> None:
    """Append `data` to `path`; first, when it would pass `max_bytes`, the file becomes
    `path.1` (the one before is dropped). Only the end of `data` is kept if it alone is longer."""
    data = data[-max_bytes:]
    with _file_lock:
        fd = _open_append(path)
        try:
            size = os.fstat(fd).st_size
            if size > 0 and size + len(data) > max_bytes:
                os.close(fd)
                fd = -1
                os.replace(path, path.with_name(path.name + ".1"))  # the link itself, were one planted
                fd = _open_append(path)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            if fd >= 0:
                os.close(fd)


def last_error_line(path: Path) -> str | None:
    """The last line of the log at `path` (its last `_TAIL` bytes, NAME.log.1's when NAME.log
    is empty after a rotation) that reads as an error, escaped (`printable`): a child's words
    are anyone's. None when there is none, or no log to read."""
    for candidate in (path, path.with_name(path.name + ".1")):
        try:  # never through a link, never waiting on a FIFO planted in its place
            fd = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            tail = os.pread(fd, _TAIL, max(info.st_size - _TAIL, 0)) if stat.S_ISREG(info.st_mode) else b""
        except OSError:
            return None
        finally:
            os.close(fd)
        if tail.strip():
            break
    else:
        return None
    for line in reversed(tail.decode("utf-8", "replace").splitlines()):
        if _ERROR.search(line):
            text = printable(line.strip())
            return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
    return None


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
