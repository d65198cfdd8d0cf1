"""The model file as the planner needs it: present, readable, GGUF, whole, and how big;
and which file it is (model/identity.py's `FileIdentity`, one for the roll-out and the kept
prompt caches), so that a replaced model is rolled out.

`read_model` opens the file once and takes everything from that descriptor: what it is
(fstat), its size, its header. Checking a path and then opening it again would read
whatever was swapped in between: a FIFO there hung the daemon."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from numad_infer.errors import ConfigError
from numad_infer.host.identity import RunAs, unreadable_reason
from numad_infer.model.gguf import GgufError, GgufHeader, open_model, parse_header
from numad_infer.model.identity import FileIdentity


@dataclass(frozen=True)
class ModelFile:
    """The model as the pipeline read it, all from one open descriptor."""

    size: int  # bytes, from fstat
    header: GgufHeader
    identity: FileIdentity  # which file was read, from the same fstat

    @property
    def artifact_id(self) -> str:
        return self.identity.artifact_id


def read_model(path: str, source: str, runs_as: RunAs | None = None,
               opener: Callable[[str], tuple[BinaryIO | None, os.stat_result]] = open_model) -> ModelFile:
    """The readable, whole GGUF file at `path`, or a ConfigError on `model.path` saying what
    is wrong with it: missing, not a regular file, unreadable, not GGUF, a header that is
    malformed or larger than a header can be, or shorter than its tensor table (a copy in
    progress).

    `runs_as`: the instances run as another user (identity.instances_run_as): check what
    that user can read, not what the daemon (root, as a rule) can. `opener`: gguf.open_model
    (a test stands in for it to swap the file right after the open).
    """
    try:
        handle, info = opener(path)
    except OSError as exc:
        raise _cannot_open(path, source, exc) from None
    if handle is None:  # a FIFO, a device or a directory: opened without waiting (O_NONBLOCK), never read
        what = "is a directory" if stat.S_ISDIR(info.st_mode) else "is not a regular file"
        raise ConfigError(source, "model.path", f"{what}; name the .gguf file itself", path, True)
    with handle:
        reason = unreadable_reason(path, runs_as) if runs_as is not None else None
        if reason is not None:
            raise ConfigError(source, "model.path", f"cannot be read by the instances: {reason}", path, True)
        try:
            header = parse_header(handle, info.st_size)
        except GgufError as exc:
            raise ConfigError(source, "model.path", str(exc), path, True) from None
        except OSError as exc:  # EIO from a failing disk or a network file system
            raise ConfigError(source, "model.path", f"cannot be read: {exc.strerror}", path, True) from None
    missing = header.missing_bytes()
    if missing:
        raise ConfigError(source, "model.path", f"is {header.file_bytes} bytes, {missing} fewer than its tensor table "
                          "says: still being written, or cut short; let the copy finish (or copy it beside the model "
                          "and `mv` it into place, which is atomic)", path, True)
    return ModelFile(info.st_size, header, FileIdentity.of(path, info))


def _cannot_open(path: str, source: str, exc: OSError) -> ConfigError:
    if isinstance(exc, FileNotFoundError):
        return ConfigError(source, "model.path", "file not found; put a GGUF model there or fix the path", path, True)
    if isinstance(exc, PermissionError):
        try:
            os.stat(path)
        except PermissionError:
            # A directory on the way this user may not search: a volume mounted with the wrong owner or mode.
            return ConfigError(source, "model.path", "cannot be reached: a directory on its path is not readable by "
                               f"uid {os.geteuid()}; make the model's volume readable by that user", path, True)
        except OSError:
            pass
        return ConfigError(source, "model.path", "cannot be read by this user; make it readable by uid "
                           f"{os.geteuid()} (chmod 644)", path, True)
    if exc.errno == errno.ENXIO:  # a socket: nothing to open
        return ConfigError(source, "model.path", "is not a regular file; name the .gguf file itself", path, True)
    if isinstance(exc, NotADirectoryError):
        return ConfigError(source, "model.path", "file not found: a part of its path is not a directory", path, True)
    return ConfigError(source, "model.path", f"cannot be read: {exc.strerror}", path, True)


def artifact_id(path: str) -> str:
    """Which file is at `path` now (FileIdentity.artifact_id): another file moved into place,
    or the same one written over, gives another id."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    return FileIdentity.of(path, info).artifact_id


def file_identity(path: str) -> FileIdentity | None:
    """Which file `path` resolves to now, named by its real path; None when it cannot be
    read (a prompt cache computed with it is then invalid: supervision/slot_keeper.py)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return FileIdentity.of(os.path.realpath(path), info)
