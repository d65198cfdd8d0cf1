"""Holds: "keep this instance stopped for now", asked by another process (`numa-infer tune`
while it measures that node). Edge: files in a directory beside the state file, which
only root may write (the daemon's runtime directory).

A hold is `<instance>.hold` naming its holder by PID and start time: the daemon drains the
instance out of the front door, stops it and shows it as `held`; when the file goes
away, or its holder is no longer alive (Ctrl-C, kill -9), the daemon starts the instance
again. So a hold never outlives the process that took it, and a PID recycled by another
process holds nothing. Only a regular file owned by the daemon's own user counts: a
planted link, FIFO or another user's file is ignored (and never opened blocking).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from numad_infer.errors import NumaInferError
from numad_infer.util.atomicfile import NotRegularFile, read_regular, write_atomic
from numad_infer.util.typedjson import DecodeError, decode

SUFFIX = ".hold"


class HoldError(NumaInferError):
    pass


@dataclass(frozen=True)
class HoldFile:
    """The file's JSON: who holds, and since when."""
    pid: int
    started: float  # the holder's start time (psutil's create_time): a recycled PID is not the holder
    by: str
    since: float


@dataclass(frozen=True)
class Hold:
    instance: str
    pid: int
    by: str
    since: float


def hold_dir(state_file: Path) -> Path:
    return state_file.parent / "holds"


def acquire(directory: Path, instance: str, by: str) -> Path:
    path = directory / f"{instance}{SUFFIX}"
    me = psutil.Process()
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        write_atomic(path, json.dumps({"pid": me.pid, "started": me.create_time(), "by": by, "since": time.time()}),
                     durable=False, mode=0o600)
    except PermissionError:
        raise HoldError(f"cannot hold {instance}: {directory} is the daemon's and not writable by this user; "
                        "run this as the daemon's user (root)") from None
    return path


def release(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def alive(pid: int | None, started: float | None = None) -> bool:
    """Is there a process `pid` (one of another user's counts too), started at `started`?"""
    if not pid or pid < 1:
        return False
    try:
        process = psutil.Process(pid)
        # create_time is derived from the same boot time and tick count each time: exact
        # for one process, and a recycled PID starts later.
        return started is None or abs(process.create_time() - started) < 0.01
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return started is None


def _read(path: Path) -> HoldFile | None:
    """The hold in `path`, or None for anything that is not one of ours."""
    try:
        text, info = read_regular(path, limit=4096)
        if info.st_uid != os.geteuid():
            return None
        return decode(HoldFile, json.loads(text), str(path))
    except (OSError, NotRegularFile, DecodeError, ValueError, RecursionError):  # ValueError: not JSON
        return None


def active(directory: Path) -> dict[str, Hold]:
    """Holds whose holder still runs; the others are removed (their holder died)."""
    found: dict[str, Hold] = {}
    try:
        entries = list(directory.iterdir())
    except OSError:
        return found
    for path in entries:
        if not path.name.endswith(SUFFIX):
            continue
        held = _read(path)
        if held is None:
            continue
        if held.pid > 1 and alive(held.pid, held.started):
            found[path.name.removesuffix(SUFFIX)] = Hold(path.name.removesuffix(SUFFIX), held.pid, held.by, held.since)
        else:
            release(path)
    return found
