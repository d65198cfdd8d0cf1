"""Where the instances run (the backend kind) and who they run as, decided here once.

Under systemd every instance unit has a DynamicUser: a uid allocated at start, in no
group that owns files, so only "others" permissions count for it. Under the process
backend a root daemon drops the servers to `server.user` (by default `numa-infer`) between
fork and exec. A daemon that is not root cannot change user: its servers run as itself,
and whatever it can read, they can.

The front door (HAProxy) runs as `numa-infer-frontdoor` under both backends: a user of
its own, not the servers'. A server parses untrusted prompts and model files; as the same
user it could ptrace HAProxy, which sees every client's prompt and key, or drive its
admin socket. Both users come with the package (sysusers.d). Run from a source tree
without them, the servers and the front door fall back to `nobody`, with a warning that
names the fix; under systemd the front door then stays root with no capability.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from numad_infer.config.defaults import FRONTDOOR_USER, INSTANCE_USER, SLOTS_DIR, SLOTS_GROUP, SYSUSERS_FILE
from numad_infer.errors import ConfigError


class BackendKind(str, Enum):
    SYSTEMD = "systemd"  # one unit per instance (systemd is PID 1)
    PROCESS = "process"  # the daemon's own children


def backend_kind(choice: str = "auto", fsroot: str = "/") -> BackendKind:
    """`--backend` (auto, systemd, process) as a kind: auto means systemd where it is PID 1.
    The one place that asks; every command and the daemon take its answer."""
    if choice == "auto":
        from numad_infer.systemd.systemctl import pid1_is_systemd

        return BackendKind.SYSTEMD if pid1_is_systemd(fsroot) else BackendKind.PROCESS
    return BackendKind(choice)


@dataclass(frozen=True)
class RunAs:
    name: str  # for messages: "nobody", "a DynamicUser"
    uid: int | None  # None: allocated at start (systemd's DynamicUser), owns nothing
    gid: int | None
    groups: tuple[int, ...]  # supplementary groups
    home: str = "/"
    # Why this is not the user that was asked for (a packaged user missing): a warning.
    fallback: str = ""

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def popen_kwargs(self) -> dict[str, object]:
        """subprocess.Popen's arguments that switch to this user in the child."""
        assert self.uid is not None and self.gid is not None
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}


DYNAMIC_USER = RunAs("systemd's DynamicUser", None, None, ())

FALLBACK_USER = "nobody"  # on every Linux host; shared with other daemons, hence only a fallback
CREATE_USERS = (f"install the numa-infer package, or create the users with `systemd-sysusers {SYSUSERS_FILE}` "
                "(from a source clone, in its root: `systemd-sysusers \"$PWD/debian/numa-infer.sysusers\"`)")


def lookup(name: str, source: str, key: str = "server.user") -> RunAs:
    """The user `name` of this host, or a ConfigError naming the key."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(source, key, "no such user on this host; create it (useradd --system --no-create-home "
                          f"{name}) or name another, e.g. \"nobody\"", name, True) from None
    groups = tuple(g for g in os.getgrouplist(name, entry.pw_gid) if g != entry.pw_gid)
    return RunAs(name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir or "/")


def lookup_packaged(name: str, source: str, key: str, packaged: str) -> RunAs:
    """`name`, except that the package's own user `packaged`, when this host lacks it (a
    source tree, no .deb), is `nobody` with a warning: an unprivileged fallback rather than
    a daemon that refuses to start. Any other missing user is a ConfigError."""
    if name != packaged:
        return lookup(name, source, key)
    try:
        pwd.getpwnam(name)
    except KeyError:
        fallback = lookup(FALLBACK_USER, source, key)
        return replace(fallback, fallback=f"user {name} does not exist on this host: running as {FALLBACK_USER}, "
                                          f"which other daemons share; {CREATE_USERS}")
    return lookup(name, source, key)


def frontdoor_runs_as(kind: BackendKind, name: str = FRONTDOOR_USER) -> RunAs | None:
    """Who HAProxy runs as, or None where it is not switched: under the process backend a
    daemon that is not root cannot change user (HAProxy runs as the daemon's user); under
    systemd without the user, the unit keeps HAProxy root with no capability, since only
    a group the daemon is in lets it reach an unprivileged HAProxy's admin socket.
    `name`: the packaged user (tests name a missing one)."""
    if kind == BackendKind.SYSTEMD:
        try:
            pwd.getpwnam(name)
        except KeyError:
            return None
        return lookup(name, "front door", "user")
    if os.geteuid() != 0:
        return None
    return lookup_packaged(name, "front door", "user", packaged=name)


def systemd_frontdoor_user(name: str = FRONTDOOR_USER) -> str | None:
    """The user the front door's unit names (render.frontdoor_identity): None on a host
    without it, where a `User=` would keep the unit from starting at all."""
    found = frontdoor_runs_as(BackendKind.SYSTEMD, name)
    return None if found is None else found.name


def group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def systemd_slots_group(root: str = SLOTS_DIR, group: str = SLOTS_GROUP) -> str | None:
    """The group the instance units join to keep their prompt caches in `root` (the
    daemon's StateDirectory=), or None where that cannot work and restarts start cold: no
    such group (a source install), or no `root` (an older daemon unit), where a
    --slot-save-path would keep every server from starting ("not a directory"). Host facts
    only, so that `check` run by anyone renders what the daemon renders; that the daemon
    can make the directories is the backend's to say (backends/systemd.py)."""
    if not group_exists(group):
        return None
    return group if os.path.isdir(root) else None


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
    return lookup_packaged(user, source, "server.user", packaged=INSTANCE_USER)
