"""Which file a path named when it was read: the one identity of a model file. Pure.

Two readers compare it: the roll-out (`artifact_id`, in every instance's spec: another
model file moved into place, or the same one written over, is a change to roll out) and
the prompt caches kept across a restart (supervision/kept_slots.py: a cache computed with
another file is never restored). model/file.py takes it from the descriptor it read the
model from, or from a path's stat."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class FileIdentity:
    """A file as `stat` saw it. A file replaced (mv) has another inode (or device); one
    rewritten in place another size or modification time, or, keeping both, another change
    time."""

    path: str
    size: int
    mtime_ns: int
    inode: int = 0
    ctime_ns: int = 0
    device: int = 0

    @classmethod
    def of(cls, path: str, info: os.stat_result) -> FileIdentity:
        return cls(path, info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns, info.st_dev)

    @property
    def artifact_id(self) -> str:
        """`PATH: DEVICE:INODE:SIZE:MTIME_NS`: the id the instances' specs carry (the change
        time is not in it, as it never was: the specs of running instances stay as they are)."""
        return f"{self.path}: {self.device}:{self.inode}:{self.size}:{self.mtime_ns}"
