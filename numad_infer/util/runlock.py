"""One daemon per state file: an exclusive flock(2) on a lock file beside it, held for the
daemon's whole life. The lock, not the pid written into the file, decides: a pid left by a
daemon that died names nothing (the kernel dropped its lock with its last descriptor).

The file is opened close-on-exec, so what the daemon execs (HAProxy, the servers) does not
hold the lock after the daemon is gone, and a new daemon can start while they run."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from numad_infer.errors import NumaInferError


class LockHeld(NumaInferError):
    """Another process holds the lock: `pid` is the one its holder wrote (None: unreadable)."""

    def __init__(self, path: Path, pid: int | None) -> None:
        self.path, self.pid = path, pid
        who = f"pid {pid}" if pid is not None else "a process that has not yet written its pid"
        super().__init__(f"another numa-infer daemon ({who}) is running on this state file ({path} is locked); "
                         "not starting a second one")


def lock_path(state_file: Path) -> Path:
    return Path(f"{state_file}.lock")


class RunLock:
    """The lock held: keep the object (its descriptor) for as long as the daemon runs."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def take(cls, path: Path) -> RunLock:
        """Take the lock at `path` (created 0644 if missing) and write this process's pid into
        it; LockHeld naming the holder's pid when another open file description holds it. Never
        waits. Other errors (no such directory, read-only) are the OSError."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            pid = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockHeld(path, pid) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd, path)

    def close(self) -> None:
        """Release the lock (the daemon's exit does it too)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None
