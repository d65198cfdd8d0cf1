"""The model file as the planner needs it: present, readable, GGUF, and how big."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from numad_infer.config import ConfigError

GGUF_MAGIC = b"GGUF"


def model_size(path: str, source: str, unprivileged_instances: bool = False) -> int:
    """Size in bytes of a readable GGUF file, or a ConfigError on `model.path`.

    `unprivileged_instances`: the instances run as another, unprivileged user (systemd's
    DynamicUser): as root, check what that user can read, not what root can.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(source, "model.path", "file not found; put a GGUF model there or fix the path", path, True) from None
    except OSError as exc:
        raise ConfigError(source, "model.path", f"cannot be read: {exc.strerror}", path, True) from None
    if stat.S_ISDIR(mode):
        raise ConfigError(source, "model.path", "is a directory; name the .gguf file itself", path, True)
    if not stat.S_ISREG(mode):
        # A FIFO or a device would block the read below (or never end).
        raise ConfigError(source, "model.path", "is not a regular file; name the .gguf file itself", path, True)
    if unprivileged_instances and os.geteuid() == 0:
        _readable_by_anyone(path, source)
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
            size = os.fstat(handle.fileno()).st_size
    except FileNotFoundError:
        raise ConfigError(source, "model.path", "file not found; put a GGUF model there or fix the path", path, True) from None
    except PermissionError:
        raise ConfigError(
            source, "model.path", "cannot be read by this user; fix its permissions (chmod 644) ", path, True
        ) from None
    except IsADirectoryError:
        raise ConfigError(source, "model.path", "is a directory; name the .gguf file itself", path, True) from None
    except OSError as exc:
        raise ConfigError(source, "model.path", f"cannot be read: {exc.strerror}", path, True) from None
    if magic != GGUF_MAGIC:
        raise ConfigError(source, "model.path", "is not a GGUF model file (llama.cpp loads only GGUF)", path, True)
    return size


def _readable_by_anyone(path: str, source: str) -> None:
    """As root every file is readable; the instances are not root (systemd's DynamicUser, no
    group of the file's): the file needs read permission for others, and every directory
    above it search permission. (ACLs are not consulted.)"""
    target = Path(path).resolve()
    for directory in reversed(target.parents):
        if not os.stat(directory).st_mode & stat.S_IXOTH:
            raise ConfigError(source, "model.path", f"cannot be read by the instances' unprivileged user: directory "
                              f"{directory} is not searchable by others (chmod o+x {directory})", path, True)
    if not os.stat(target).st_mode & stat.S_IROTH:
        raise ConfigError(source, "model.path", "cannot be read by the instances' unprivileged user "
                          f"(chmod o+r {target})", path, True)
