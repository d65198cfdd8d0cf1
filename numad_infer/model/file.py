"""The model file as the planner needs it: present, readable, GGUF, whole, and how big;
and which file it is (`artifact_id`), so that a replaced model is rolled out."""

from __future__ import annotations

import os
import stat
import struct

from numad_infer.errors import ConfigError
from numad_infer.host.identity import RunAs, unreadable_reason
from numad_infer.model.gguf import GgufError, read_header

GGUF_MAGIC = b"GGUF"


def model_size(path: str, source: str, runs_as: RunAs | None = None) -> int:
    """Size in bytes of a readable GGUF file, or a ConfigError on `model.path`.

    `runs_as`: the instances run as another user (identity.instances_run_as): check what
    that user can read, not what the daemon (root, as a rule) can.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(source, "model.path", "file not found; put a GGUF model there or fix the path",
                          path, True) from None
    except PermissionError:
        # A directory on the way this user may not search: a volume mounted with the wrong owner or mode.
        raise ConfigError(source, "model.path", f"cannot be reached: a directory on its path is not readable by uid "
                          f"{os.geteuid()}; make the model's volume readable by that user", path, True) from None
    except OSError as exc:
        raise ConfigError(source, "model.path", f"cannot be read: {exc.strerror}", path, True) from None
    if stat.S_ISDIR(mode):
        raise ConfigError(source, "model.path", "is a directory; name the .gguf file itself", path, True)
    if not stat.S_ISREG(mode):
        # A FIFO or a device would block the read below (or never end).
        raise ConfigError(source, "model.path", "is not a regular file; name the .gguf file itself", path, True)
    reason = unreadable_reason(path, runs_as) if runs_as is not None else None
    if reason is not None:
        raise ConfigError(source, "model.path", f"cannot be read by the instances: {reason}", path, True)
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
            size = os.fstat(handle.fileno()).st_size
    except FileNotFoundError:
        raise ConfigError(source, "model.path", "file not found; put a GGUF model there or fix the path",
                          path, True) from None
    except PermissionError:
        raise ConfigError(
            source, "model.path", f"cannot be read by this user; make it readable by uid {os.geteuid()} (chmod 644)",
            path, True
        ) from None
    except IsADirectoryError:
        raise ConfigError(source, "model.path", "is a directory; name the .gguf file itself", path, True) from None
    except OSError as exc:
        raise ConfigError(source, "model.path", f"cannot be read: {exc.strerror}", path, True) from None
    if magic != GGUF_MAGIC:
        raise ConfigError(source, "model.path", "is not a GGUF model file (llama.cpp loads only GGUF)", path, True)
    return size


def check_whole(path: str, source: str) -> None:
    """ConfigError when the file is shorter than its tensor table says: copied over in place
    (`cp new.gguf model.gguf`) and not finished, or cut short. A header this reader cannot
    take is left to the engine, which says why when it loads."""
    try:
        header = read_header(path)
    except (OSError, GgufError, struct.error):
        return
    missing = header.missing_bytes()
    if missing:
        raise ConfigError(source, "model.path", f"is {header.file_bytes} bytes, {missing} fewer than its tensor table "
                          "says: still being written, or cut short; let the copy finish (or copy it beside the model "
                          "and `mv` it into place, which is atomic)", path, True)


def artifact_id(path: str) -> str:
    """Which file is at `path` now: device, inode, size and modification time. Another file
    moved into place, or the same one written over, gives another id."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    return f"{path}: {info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}"
