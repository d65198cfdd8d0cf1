"""`numa-infer restart`'s request to the daemon: a file beside the state file naming the
instances, then SIGUSR1. Edge: the file, like a hold (holds.py), counts only when it is
a regular file of the daemon's own user, in the directory only that user may write; the
daemon removes it once read, so a request is acted on once.

The answer comes back in the state file (`DaemonStatus.last_restart`, keyed by the
request's id), where `numa-infer restart` follows the roll until it is over.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from numad_infer.util.atomicfile import NotRegularFile, read_regular, write_atomic
from numad_infer.util.typedjson import DecodeError, decode

NAME = "restart.request"


@dataclass(frozen=True)
class RestartRequest:
    id: str
    instances: tuple[str, ...]  # empty: all of them


def request_path(state_file: Path) -> Path:
    return state_file.parent / NAME


def write(state_file: Path, instances: tuple[str, ...]) -> RestartRequest:
    """Leave a request for the daemon (PermissionError: not the daemon's user)."""
    request = RestartRequest(uuid.uuid4().hex, instances)
    write_atomic(request_path(state_file), json.dumps({"id": request.id, "instances": list(instances)}),
                 durable=False, mode=0o600)
    return request


def take(state_file: Path) -> RestartRequest | str | None:
    """The waiting request, removed; None when there is none; a str saying why a file
    there is not a request (the daemon reports that rather than acting on it)."""
    path = request_path(state_file)
    try:
        text, info = read_regular(path, limit=64 << 10)
    except FileNotFoundError:
        return None
    except (OSError, NotRegularFile) as exc:
        _remove(path)
        return f"{path}: {exc}"
    _remove(path)
    if info.st_uid != os.geteuid():
        return f"{path}: owned by uid {info.st_uid}, not the daemon's user: ignored"
    try:
        return decode(RestartRequest, json.loads(text), str(path))
    except (DecodeError, ValueError, RecursionError) as exc:
        return f"{path}: not a restart request: {exc}"


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
