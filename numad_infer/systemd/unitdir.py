"""Write rendered units into a directory: atomic, idempotent, and only ever our own files."""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from numad_infer.config.schema import Config
from numad_infer.errors import ConfigError, NumaInferError
from numad_infer.systemd.unitnames import DROPIN_GLOB, FRONTDOOR_UNIT, TEMPLATE_GLOB, UNIT_MARKER, template_unit
from numad_infer.util.atomicfile import write_atomic


@dataclass(frozen=True)
class WriteResult:
    written: tuple[str, ...]
    unchanged: tuple[str, ...]
    removed: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return bool(self.written or self.removed)


def _ours(path: Path) -> bool:
    try:
        with path.open("r", encoding="utf-8", errors="replace") as handle:
            return handle.readline().rstrip("\n") == UNIT_MARKER
    except OSError:
        return False


# Where systemd looks for units (systemd.unit(5), "Unit File Load Path"), most important first.
SYSTEM_UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system",
                    "/usr/lib/systemd/system", "/lib/systemd/system")


def check_unit_names(config: Config, source: str, dirs: tuple[str, ...] = SYSTEM_UNIT_DIRS) -> None:
    """Refuse names of units that someone else ships: ours in /run would shadow theirs."""
    names = [(template_unit(config.systemd.template), "tuning.unit_template", config.systemd.template)]
    if config.frontend.enabled:
        names.append((FRONTDOOR_UNIT, "frontend.listen", config.frontend.listen))
    for name, key, value in names:
        for directory in dirs:
            path = Path(directory) / name
            if path.is_file() and not _ours(path):
                raise ConfigError(source, key, f"{path} exists and was not written by numa-infer: rendering {name} "
                                  "would shadow it; pick another name", value, True)


def managed_files(unit_dir: Path) -> list[str]:
    """Relative paths of the files numa-infer wrote in `unit_dir` (marker on the first line)."""
    found: list[str] = []
    if not unit_dir.is_dir():
        return found
    for path in sorted([*unit_dir.glob(TEMPLATE_GLOB), unit_dir / FRONTDOOR_UNIT]):
        if path.is_file() and _ours(path):
            found.append(path.name)
    for path in sorted(unit_dir.glob(DROPIN_GLOB)):
        if path.is_file() and _ours(path):
            found.append(f"{path.parent.name}/{path.name}")
    return found


def plan_write(unit_dir: Path, files: dict[str, str]) -> WriteResult:
    """What `write_units` would do, without doing it (used by `check` and to decide daemon-reload)."""
    written: list[str] = []
    unchanged: list[str] = []
    for rel, content in sorted(files.items()):
        path = unit_dir / rel
        try:
            same = path.read_text(encoding="utf-8") == content
        except OSError:
            same = False
        (unchanged if same else written).append(rel)
    removed = [rel for rel in managed_files(unit_dir) if rel not in files]
    return WriteResult(tuple(written), tuple(unchanged), tuple(removed))


def check_private_dir(path: Path) -> None:
    """Create `path` if needed; as root, refuse one another user could redirect or fill.

    A root daemon that writes into a directory owned by someone else, writable by others,
    or reached through a symlink can be made to write anywhere (a planted
    `infer@0.service.d -> /etc/...`).
    """
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return
    for directory in (path, *path.parents):
        if directory == Path("/"):
            break
        info = os.lstat(directory)
        if stat.S_ISLNK(info.st_mode) and directory == path:
            raise NumaInferError(f"{directory} is a symbolic link; numa-infer writes there as root: "
                                 "make it a directory")
        if stat.S_ISLNK(info.st_mode):
            continue  # a link higher up (/run -> /var/run) is the system's own
        # Above it, a sticky world-writable directory (/tmp) is safe: others may not rename or
        # remove what root owns there. The directory itself must be root's alone: in a
        # sticky one, others could still plant files (holds, a candidate haproxy.cfg).
        shared = info.st_mode & stat.S_IWOTH or (info.st_mode & stat.S_IWGRP and info.st_gid != 0)
        writable_by_others = shared and (directory == path or not info.st_mode & stat.S_ISVTX)
        if info.st_uid != 0 or writable_by_others:
            raise NumaInferError(
                f"{directory} is {'owned by uid ' + str(info.st_uid) if info.st_uid != 0 else 'writable by others'}; "
                "numa-infer writes there as root: chown root and chmod go-w it, or choose another directory")


def write_units(unit_dir: Path, files: dict[str, str]) -> WriteResult:
    check_private_dir(unit_dir)
    result = plan_write(unit_dir, files)
    for rel in result.written:
        target = unit_dir / rel
        if target.exists() and not _ours(target):
            # Never overwrite what an operator (or another tool) wrote under our names.
            raise NumaInferError(f"{target} exists and was not written by numa-infer; move it away first")
    for rel in result.written:
        if (unit_dir / rel).parent != unit_dir:
            check_private_dir((unit_dir / rel).parent)  # a drop-in directory: never a planted link
        write_atomic(unit_dir / rel, files[rel])
    for rel in result.removed:
        path = unit_dir / rel
        path.unlink(missing_ok=True)
        if path.parent != unit_dir:
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # only if empty: an operator's own drop-ins stay
    return result
