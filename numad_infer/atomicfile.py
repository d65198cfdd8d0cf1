"""Replace a file in one step: readers (systemd, `numa-infer status`) never see half of it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, content: str, durable: bool = True) -> None:
    """Write `content` to a temporary file beside `path` (mode 0644), then rename it over `path`.

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
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
