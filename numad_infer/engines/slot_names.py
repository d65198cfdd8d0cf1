"""Where an instance's saved prompt caches live: its directory under the slots root and
each slot's file name. Pure: the units (a --slot-save-path under systemd), both backends
and the keeper name the same places from here; engines/slot_cache.py makes them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path


def gives_slot_path(option: str | None, argv: Sequence[str]) -> bool:
    """Whether numa-infer gives an instance its --slot-save-path (and so saves and restores
    its slots): the engine has the option (`Engine.slot_save_option`) and the operator did
    not name a path of their own in server.extra_args, which numa-infer leaves alone."""
    return option is not None and option not in argv


def directory_name(instance: str) -> str:
    """An instance's own directory under STATE_DIR/slots: its name, nothing but [A-Za-z0-9_-]."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", instance)


def slot_directory(root: Path, instance: str) -> Path:
    return root / directory_name(instance)


def file_name(instance: str, slot: int) -> str:
    """A name llama-server takes (fs_validate_filename: no separators, no leading dot)."""
    return f"{directory_name(instance)}.slot{slot}.bin"
