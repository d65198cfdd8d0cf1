"""Where the instances run (the backend kind) and who they run as, decided here once.

Under systemd every instance unit has a DynamicUser: a uid allocated at start, in no
group that owns files, so only "others" permissions count for it. Under the process
backend a root daemon drops the servers to `server.user` (by default `nobody`) between
fork and exec. A daemon that is not root cannot change user: its servers run as itself,
and whatever it can read, they can.
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from numad_infer.errors import ConfigError


class BackendKind(str, Enum):
    SYSTEMD = "systemd"  # one unit per instance (systemd is PID 1)
    PROCESS = "process"  # the daemon's own children


def backend_kind(choice: str = "auto", fsroot: str = "/") -> BackendKind:
    """`--backend` (auto, systemd, process) as a kind: auto means systemd where it is PID 1.
    The one place that asks; every command and the daemon take its answer."""
    if choice == "auto":
        from numad_infer.systemctl import pid1_is_systemd

        return BackendKind.SYSTEMD if pid1_is_systemd(fsroot) else BackendKind.PROCESS
    return BackendKind(choice)


@dataclass(frozen=True)
class RunAs:
    name: str  # for messages: "nobody", "a DynamicUser"
    uid: int | None  # None: allocated at start (systemd's DynamicUser), owns nothing
    gid: int | None
    groups: tuple[int, ...]  # supplementary groups
    home: str = "/"

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def popen_kwargs(self) -> dict[str, object]:
        """subprocess.Popen's arguments that switch to this user in the child."""
        assert self.uid is not None and self.gid is not None
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}


DYNAMIC_USER = RunAs("systemd's DynamicUser", None, None, ())


def lookup(name: str, source: str, key: str = "server.user") -> RunAs:
    """The user `name` of this host, or a ConfigError naming the key."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(source, key, "no such user on this host; create it (useradd --system --no-create-home "
                          f"{name}) or name another, e.g. \"nobody\"", name, True) from None
    groups = tuple(g for g in os.getgrouplist(name, entry.pw_gid) if g != entry.pw_gid)
    return RunAs(name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir or "/")


def unreadable_reason(path: str, user: RunAs) -> str | None:
    """Why `user` could not read `path` (owner, group, then other bits, as the kernel checks
    them; ACLs are not consulted), or None when it can. For root there is no reason."""
    if user.is_root:
        return None
    try:
        target = Path(path).resolve()
        for directory in reversed(target.parents):
            if not _allows(os.stat(directory), user, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH):
                return f"directory {directory} is not searchable by {user.name} (chmod o+x {directory})"
        if not _allows(os.stat(target), user, stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH):
            return f"{user.name} may not read it (chmod o+r {target})"
    except OSError:
        return None  # what the daemon cannot stat, it cannot open either: model_size says so
    return None


def _allows(st: os.stat_result, user: RunAs, owner_bit: int, group_bit: int, other_bit: int) -> bool:
    if user.uid is not None and st.st_uid == user.uid:
        return bool(st.st_mode & owner_bit)
    if user.gid is not None and (st.st_gid == user.gid or st.st_gid in user.groups):
        return bool(st.st_mode & group_bit)
    return bool(st.st_mode & other_bit)


def instances_run_as(user: str, source: str, kind: BackendKind) -> RunAs | None:
    """Who the instances will run as: None when that is the daemon's own user.

    Under systemd, a DynamicUser. Under the process backend, `server.user` when the
    daemon is root (it switches between fork and exec); otherwise the daemon's user.
    """
    if kind == BackendKind.SYSTEMD:
        return DYNAMIC_USER
    if os.geteuid() != 0:
        return None
    return lookup(user, source)
