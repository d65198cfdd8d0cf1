"""The state file (`/run/numa-infer/state.json`): the daemon writes its `Status` there every
pass; `numa-infer status`, `reload` and `tune` read it. The types and their JSON shape
are `records.py`'s; this module only moves them to and from the file.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from numad_infer.errors import NumaInferError
from numad_infer.status.records import Status, StatusError
from numad_infer.status.verdicts import summary_line
from numad_infer.systemd.unitdir import check_private_dir
from numad_infer.util.atomicfile import NotRegularFile, read_regular, write_atomic


def check_state_dir(state_file: Path) -> None:
    """The state file's directory exists (or is made) and takes a new file: a read-only or
    missing mount is one line at start, not a traceback or an error on every pass."""
    directory = state_file.parent
    try:
        check_private_dir(directory)
    except OSError as exc:
        raise _unusable(Path(exc.filename or directory), exc) from None
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".numa-infer-write-test-")
    except OSError as exc:
        raise _unusable(directory, exc) from None
    os.close(fd)
    os.unlink(probe)


def _unusable(where: Path, exc: OSError) -> NumaInferError:
    problem = "not a directory" if exc.errno in (errno.EEXIST, errno.ENOTDIR) else exc.strerror
    return NumaInferError(f"state directory {where}: {problem} (uid {os.geteuid()}); mount a writable volume there "
                          "or pass --state-file a path in a writable directory")


def write_status(path: Path, status: Status) -> None:
    """A daemon's status line (`daemon.status` set) is written as made from the rest of the
    status: what `status` and `--json` read agrees with its tables and `health`."""
    if status.daemon.status is not None:
        status = replace(status, daemon=replace(status.daemon, status=summary_line(status)))
    # Rewritten every pass on /run (tmpfs): atomic for readers, no fsync needed.
    write_atomic(path, json.dumps(status.to_json(), indent=1, sort_keys=True), durable=False)


def read_status(path: Path) -> Status | None:
    """None when there is no state file (or it cannot be read); StatusError for one of another shape."""
    try:
        text, _ = read_regular(path)
    except NotRegularFile as exc:
        raise StatusError(f"{path}: {exc.what}; remove it (the daemon writes a regular file there)") from None
    except OSError:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None  # half of a file never happens (atomic writes): this is not ours
    except RecursionError:
        raise StatusError(f"{path}: not a numa-infer state file (nested too deeply)") from None
    return Status.from_json(data, str(path))
