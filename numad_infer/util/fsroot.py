"""Files read inside a filesystem root: `/`, or a tree someone else captured (`--fsroot`).

A captured tree is data, not a filesystem to trust. A link in it may point out of it (a
CPU's governor file linked to /etc/shadow would have root print the shadow file), a FIFO
may sit where a file belongs (the read waits for a writer forever), and a link to
/dev/zero never ends. So, read through `FsRoot`:

- a link is followed only while it stays inside the tree: sysfs's own relative links
  (node0/cpu0 -> ../../cpu/cpu0) work; one that climbs above the root, or an absolute one,
  is refused (`NotRegularFile`);
- only a regular file is read (what /sys and /proc files are), never a FIFO or a device;
- no read takes more than its limit.

The walk opens one component at a time from the directory before it, never following
(O_PATH | O_NOFOLLOW), and opens the last one for reading with O_NOFOLLOW: a component
swapped for a link between two steps is seen as a link and resolved inside the tree, not
followed by the kernel. The root `/` has nothing outside it: there the kernel resolves
the path in one call (the daemon re-reads /sys/devices/system/cpu/online every pass), and
only the file's type and size are checked.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from numad_infer.util.atomicfile import NotRegularFile, read_descriptor

SMALL = 64 << 10  # a sysfs attribute or one process's /proc file: far more than any holds
LARGE = 16 << 20  # /proc/interrupts or /proc/cpuinfo of a machine with hundreds of CPUs
MAX_LINKS = 40  # links followed for one path, the kernel's own limit (ELOOP)

_STEP = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: opening a FIFO does not wait


def _oserror(code: int, path: Path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


class FsRoot:
    """Reads below `root`; every path given is `root / something` (as the readers build them)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.whole = os.path.realpath(self.root) == "/"  # nothing is outside /

    def read(self, path: Path, limit: int = SMALL, whole: bool = True) -> bytes:
        """The bytes of the regular file `path`. OSError where it is absent, not reachable or
        a directory (IsADirectoryError); NotRegularFile for a link out of the tree, a FIFO, a
        device or a socket, and a file over `limit` bytes (whole=False: its first `limit`)."""
        fd = self._open(path, _READ)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            raise _oserror(errno.EISDIR, path)
        return read_descriptor(fd, path, limit, whole)[0]

    def text(self, path: Path, limit: int = SMALL) -> str:
        return self.read(path, limit).decode("utf-8", errors="replace")

    def listdir(self, path: Path) -> list[str]:
        """The names in directory `path` (OSError or NotRegularFile as `read`)."""
        fd = self._open(path, _READ | os.O_DIRECTORY)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def is_dir(self, path: Path) -> bool:
        """`path` leads to a directory inside the tree; False where it leads nowhere (a
        dangling link: sysfs's offline nodes) or to something else. NotRegularFile where
        it leads out of the tree."""
        try:
            os.close(self._open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        except OSError:
            return False
        return True

    def _open(self, path: Path, flags: int) -> int:
        parts = path.relative_to(self.root).parts  # ValueError: a path outside, the caller's mistake
        if self.whole:
            return os.open(path, flags)
        return self._walk(path, parts, flags)

    def _walk(self, path: Path, parts: tuple[str, ...], flags: int) -> int:
        """Open `parts` below the root with `flags`, resolving each link inside the tree."""
        dirs = [os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)]  # the way down, the root first
        todo = list(reversed(parts))  # the next component last
        links = 0
        try:
            while todo:
                name = todo.pop()
                if name in ("", "."):
                    continue
                if name == "..":
                    if len(dirs) == 1:
                        raise NotRegularFile(path, f"leads out of {self.root}")
                    os.close(dirs.pop())
                    continue
                fd = os.open(name, _STEP, dir_fd=dirs[-1])
                mode = os.fstat(fd).st_mode
                if stat.S_ISLNK(mode):
                    os.close(fd)
                    links += 1
                    if links > MAX_LINKS:
                        raise _oserror(errno.ELOOP, path)
                    target = os.readlink(name, dir_fd=dirs[-1])
                    if target.startswith("/"):
                        raise NotRegularFile(path, f"leads out of {self.root} ({name} -> {target})")
                    todo.extend(reversed(target.split("/")))
                elif any(rest not in ("", ".") for rest in todo):
                    if not stat.S_ISDIR(mode):
                        os.close(fd)
                        raise _oserror(errno.ENOTDIR, path)
                    dirs.append(fd)
                else:
                    os.close(fd)
                    return self._last(path, name, dirs[-1], flags)
            return os.open(".", flags, dir_fd=dirs[-1])  # the path ends at a directory ("..", a link to ".")
        finally:
            for fd in dirs:
                os.close(fd)

    @staticmethod
    def _last(path: Path, name: str, parent: int, flags: int) -> int:
        """The last component, opened for real. O_NOFOLLOW: a link put there since the step
        before is refused, not followed."""
        try:
            return os.open(name, flags | os.O_NOFOLLOW, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotRegularFile(path, "became a link while it was read") from None
            raise
