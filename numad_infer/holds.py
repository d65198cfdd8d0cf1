"""Holds: "keep this instance stopped for now", asked by another process (`numa-infer tune`
while it measures that node). Edge: files in a directory beside the state file, which
only root may write (the daemon's runtime directory).

A hold is `<instance>.hold` holding the holder's PID: the daemon drains the instance out
of the front door, stops it and shows it as `held`; when the file goes away, or its
holder is no longer alive (Ctrl-C, kill -9), the daemon starts the instance again. So a
hold never outlives the process that took it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from numad_infer.atomicfile import write_atomic

SUFFIX = ".hold"


@dataclass(frozen=True)
class Hold:
    instance: str
    pid: int
    by: str
    since: float


def hold_dir(state_file: Path) -> Path:
    return state_file.parent / "holds"


def acquire(directory: Path, instance: str, by: str) -> Path:
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"{instance}{SUFFIX}"
    write_atomic(path, json.dumps({"pid": os.getpid(), "by": by, "since": time.time()}), durable=False)
    return path


def release(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def alive(pid: int | None) -> bool:
    """Is there a process `pid` (one of another user's counts too)?"""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def active(directory: Path) -> dict[str, Hold]:
    """Holds whose holder still runs; the others are removed (their holder died)."""
    found: dict[str, Hold] = {}
    try:
        entries = list(directory.iterdir())
    except OSError:
        return found
    for path in entries:
        if not path.name.endswith(SUFFIX) or path.is_symlink():
            continue
        try:
            data = json.loads(path.read_text())
            hold = Hold(path.name.removesuffix(SUFFIX), int(data["pid"]), str(data.get("by", "?")),
                        float(data.get("since", 0)))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if hold.pid > 1 and alive(hold.pid):
            found[hold.instance] = hold
        else:
            release(path)
    return found
