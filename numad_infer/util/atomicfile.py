"""Files the daemon and its commands share, written and read safely.

Writes replace a file in one step (readers, systemd or `numa-infer status`, never see half
of it) and never follow a planted link. Reads of files another process left (state,
holds) open only a regular file: a symbolic link could point anywhere, and a FIFO would
block the daemon's loop forever.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from numad_infer.errors import NumaInferError


class NotRegularFile(NumaInferError):
    """A path that is a symbolic link, FIFO, device or directory where a plain file belongs."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"{path} {what}")
        self.what = what


def read_regular(path: Path, limit: int = 16 << 20) -> tuple[str, os.stat_result]:
    """The text of the regular file `path` (at most `limit` bytes) and its fstat.

    O_NOFOLLOW: a link is refused, not followed; O_NONBLOCK: opening a FIFO does not wait
    for a writer. The checks look at the descriptor that is read, so nothing can be
    swapped in between the check and the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a symbolic link
            raise NotRegularFile(path, "is a symbolic link") from None
        raise
    data, info = read_descriptor(fd, path, limit)
    return data.decode("utf-8", errors="replace"), info


def read_descriptor(fd: int, path: Path, limit: int, whole: bool = True) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file open at `fd` (closed here) and its fstat: at most
    `limit`, the rest refused (whole=True) or left unread (whole=False, for a file whose
    start is all that matters). A FIFO, device, socket or directory is refused: nothing
    bounds what a device gives, or when a FIFO's writer comes."""
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(path, "is not a regular file")
        data = handle.read(limit + 1)
    if len(data) > limit:
        if whole:
            raise NotRegularFile(path, f"is larger than {limit} bytes")
        data = data[:limit]
    return data, info


def write_atomic(path: Path, content: str, durable: bool = True, mode: int = 0o644, group: int | None = None) -> None:
    """Write `content` to a temporary file beside `path` (created private, given `mode`
    and `group` before it appears under its name), then rename it over `path`. The rename
    replaces a link planted at `path` rather than writing through it.

    durable=False skips the fsync, for files rewritten every few seconds on tmpfs.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(content)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        if group is not None:
            os.chown(tmp, -1, group)  # a group the writer is in: no capability needed
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
