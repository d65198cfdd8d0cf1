"""The state file (`/run/numa-infer/state.json`): the daemon writes its `Status` there every
pass; `numa-infer status`, `reload` and `tune` read it. The types and their JSON shape
are `status.py`'s; this module only moves them to and from the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from numad_infer.atomicfile import NotRegularFile, read_regular, write_atomic
from numad_infer.status import Status, StatusError


def write_status(path: Path, status: Status) -> None:
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
