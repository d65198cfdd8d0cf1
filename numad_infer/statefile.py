"""The status the daemon publishes each pass (/run/numa-infer/state.json): data first.

Written atomically, world-readable, no secrets: `numa-infer status` reads it without root.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from numad_infer.atomicfile import write_atomic

SCHEMA = 1


def write_state(path: Path, data: dict[str, Any]) -> None:
    # Rewritten every pass on /run (tmpfs): atomic for readers, no fsync needed.
    write_atomic(path, json.dumps({"schema": SCHEMA, **data}, indent=1, sort_keys=True), durable=False)


def read_state(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
