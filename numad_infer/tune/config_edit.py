"""Edit the operator's configuration file in place, keeping its comments, order and layout
(tomlkit round-trips TOML), for `numa-infer tune --apply`.

All or nothing: the edited text is validated by the caller's validator (for `tune
--apply`, pipeline.validate: exactly what `check` runs) before anything is written; the old
file is kept as a backup; the new one replaces it in one rename, with the old file's mode
and owner.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numad_infer.config.load import parse_config
from numad_infer.config.schema import Config
from numad_infer.errors import ConfigError, NumaInferError
from numad_infer.util.atomicfile import write_atomic


@dataclass(frozen=True)
class Edit:
    section: str
    key: str
    value: Any
    index: int | None = None  # the k of `models[k]`: a table of an array of tables

    @property
    def name(self) -> str:
        """The key as messages and the reference spell it: `placement.threads`, `models[1].threads`."""
        return f"{self.section}{'' if self.index is None else f'[{self.index}]'}.{self.key}"

    @classmethod
    def at(cls, name: str, value: Any) -> Edit:
        """The edit of `name`, spelt as `name` spells it (`placement.threads`, `models[1].threads`)."""
        table, _, key = name.rpartition(".")
        section, _, index = table.partition("[")
        return cls(section, key, value, int(index.rstrip("]")) if index else None)


def edited_text(text: str, edits: list[Edit]) -> str:
    import tomlkit  # only `tune --apply` needs it

    document = tomlkit.parse(text)
    for edit in edits:
        if edit.index is not None:
            # One table of `[[models]]`: it exists (tune measured its model), and its
            # neighbours, comments and order stay as they are.
            document[edit.section][edit.index][edit.key] = edit.value
            continue
        if edit.section not in document:
            document[edit.section] = tomlkit.table()
        document[edit.section][edit.key] = edit.value
    return tomlkit.dumps(document)


def apply_edits(path: Path, edits: list[Edit], validate: Callable[[Config], object]) -> Path:
    """Write `edits` into the file at `path`; returns the backup's path. `validate` gets the
    parsed result and raises a NumaInferError (a ConfigError, HAProxy's refusal ...) to refuse it.

    A symbolic link (`/etc/numa-infer.toml -> /srv/conf/...`, as configuration management
    lays it out) is followed: its target is edited and the link stays a link. A file that
    changed between the read and the write is not overwritten."""
    source = str(path)
    target = Path(os.path.realpath(path))
    with target.open(encoding="utf-8") as handle:
        before = os.fstat(handle.fileno())
        original = handle.read()
    text = edited_text(original, edits)
    try:
        validate(parse_config(text, source))
    except NumaInferError as exc:
        # A ConfigError names its file first: said once, in the message below.
        reason = str(exc).removeprefix(f"{exc.source}: " if isinstance(exc, ConfigError) else "")
        raise ConfigError(source, None, f"the tuned settings were refused, nothing written: {reason}") from None
    now = os.stat(target)
    if (now.st_ino, now.st_size, now.st_mtime_ns) != (before.st_ino, before.st_size, before.st_mtime_ns):
        raise ConfigError(source, None, f"{target} changed while it was being edited; nothing written: run tune again")
    backup = target.with_name(f"{target.name}.{time.strftime('%Y%m%d-%H%M%S')}.bak")
    shutil.copy2(target, backup)
    # Created with the old file's mode before it takes the name: never readable by more
    # users than the old file was, not even for a moment.
    write_atomic(target, text, mode=before.st_mode & 0o7777)
    if os.geteuid() == 0:
        os.chown(target, before.st_uid, before.st_gid)
    return backup
