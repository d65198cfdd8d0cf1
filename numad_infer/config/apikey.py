"""`server.api_key_file` (the key the instances require) and `tenants[].key_file` (the
keys the front door takes, frontdoor/tenants.py), read by root only.

The key never reaches argv or a unit file: under systemd it is a credential
(LoadCredential=, see render.py), under the process backend the child's environment.

The file is trusted only if no one but the daemon's user could have written it or put
it there: owned by that user, no access for group or others, in a directory group and
others cannot write (a sticky /tmp included: anyone may create a name there first). It
is opened once, without following a symlink, and every check is made on that open
descriptor, so nothing can be swapped in between the check and the read.

A Kubernetes Secret volume is a tree of links (`api-key -> ..data/api-key`, `..data ->
..2026_12_02_...`, swapped on rotation), all root's: a name that is a link is followed
when every link on the way is owned by root or the daemon's user and the file it ends at
stays inside the volume (the configured file's directory); that file is then checked as
above, except that its group may read it (a Secret's `defaultMode: 0440` with `fsGroup`).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from numad_infer.config.schema import Config
from numad_infer.config.tenants import TenantKey
from numad_infer.errors import ConfigError

# More than any key: a file this large is not one.
_MAX_BYTES = 64 * 1024


def read_api_key(config: Config, source: str) -> str | None:
    """The key, or None when none is configured; a ConfigError on `server.api_key_file` otherwise."""
    path = config.server.api_key_file
    return read_key_file(path, "server.api_key_file", source) if path else None


# RFC 6750's Bearer token (token68): what a client can send after "Bearer " unquoted, and
# what HAProxy's map file holds as one word (no #, no space, no backslash to misread).
_TOKEN68 = re.compile(r"[A-Za-z0-9._~+/-]+=*")


def read_tenant_keys(config: Config, source: str) -> tuple[TenantKey, ...]:
    """Each `[[tenants]]` table's key, in order; every key its own (a ConfigError on
    `tenants[i].key_file` otherwise)."""
    keys: list[TenantKey] = []
    owner: dict[str, str] = {}
    for k, tenant in enumerate(config.tenants):
        where = f"tenants[{k}].key_file"
        key = read_key_file(tenant.key_file, where, source)
        if not _TOKEN68.fullmatch(key):
            raise ConfigError(source, where, "must hold a key of letters, digits and - . _ ~ + / (then = only), as "
                              "a Bearer token is (RFC 6750); e.g. openssl rand -hex 32 > FILE", tenant.key_file, True)
        if key in owner:
            # One key naming two tenants would make one of them the other's.
            raise ConfigError(source, where, f"holds the same key as tenant {owner[key]}'s file: give every tenant "
                              "a key of its own", tenant.key_file, True)
        owner[key] = tenant.name
        keys.append(TenantKey(tenant.name, key))
    return tuple(keys)


def read_key_file(path: str, key: str, source: str) -> str:
    """The key in `path` (configured at `key`, as errors name it), checked as the module says."""

    def refuse(problem: str) -> ConfigError:
        return ConfigError(source, key, problem, path, True)

    linked = os.path.islink(path)
    real = _follow_in_volume(path, refuse) if linked else path
    _check_directory(real, refuse)
    try:
        # O_NONBLOCK: a FIFO planted in its place must not hang the daemon in open().
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise refuse("file not found; write the key into it (umask 077; e.g. openssl rand -hex 32 > FILE)") from None
    except PermissionError:
        raise refuse("cannot be read by this user; run as root") from None
    except OSError as exc:
        if Path(real).is_symlink():  # swapped in after it was followed
            raise refuse("changed while it was read (a link where its file was); try again") from None
        raise refuse(f"cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        _check_file(os.fstat(fd), real, refuse, group_may_read=linked)
        data = handle.read(_MAX_BYTES + 1)
    try:
        secret = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise refuse("is not UTF-8 text") from None
    if len(data) > _MAX_BYTES or not secret or any(c.isspace() or not c.isprintable() for c in secret):
        raise refuse("must hold one key: printable characters without spaces, on one line")
    return secret


def _owner() -> tuple[int, str]:
    """The user the key file must belong to: the daemon's own (root when run as root)."""
    euid = os.geteuid()
    return euid, "root" if euid == 0 else f"uid {euid}"


def _follow_in_volume(path: str, refuse: Callable[[str], ConfigError]) -> str:
    """The file a link ends at, when the links on the way are root's or the daemon user's
    (whoever owns a link can re-point it) and the file is inside the link's directory (the
    Secret volume): a link out of it names a file that the volume's owner does not control."""
    uid, who = _owner()
    volume = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    hop, seen = os.path.abspath(path), 0
    while os.path.islink(hop):
        seen += 1
        if seen > 16:
            raise refuse("is a chain of more than 16 links; name the file itself")
        owner = os.lstat(hop).st_uid
        if owner not in (0, uid):
            raise refuse(f"is a link owned by uid {owner} ({hop}), who could re-point it; name the file itself, or "
                         f"make the link {who}'s")
        target = os.readlink(hop)
        # The first component of a relative target may be a link itself (`..data`).
        first, _, rest = target.partition("/")
        base = os.path.join(os.path.dirname(hop), first)
        if rest and os.path.islink(base) and os.lstat(base).st_uid not in (0, uid):
            raise refuse(f"goes through a link owned by uid {os.lstat(base).st_uid} ({base}); make it {who}'s")
        hop = os.path.join(os.path.dirname(hop), target)
    real = os.path.realpath(hop)
    if os.path.commonpath([volume, real]) != volume:
        raise refuse(f"is a link that leads out of its directory {volume}, to {real}; name the file itself, or keep "
                     "the links inside one directory (a Secret volume does)")
    return real


def _check_file(info: os.stat_result, path: str, refuse: Callable[[str], ConfigError],
                group_may_read: bool = False) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise refuse("is not a regular file; put the key in a file")
    uid, who = _owner()
    # A Secret's files are the kubelet's (root's), whoever the daemon runs as.
    owners = {uid, 0} if group_may_read else {uid}
    if info.st_uid not in owners:
        raise refuse(f"is owned by uid {info.st_uid}, not by {who}, who runs the daemon: whoever owns it can change "
                     f"the key; chown {uid} {path}")
    mode = stat.S_IMODE(info.st_mode)
    if group_may_read and mode & 0o037:
        raise refuse(f"can be written by its group or read or written by others (mode {mode:04o}); in a Secret "
                     "volume set defaultMode: 0400 (or 0440 with fsGroup)")
    if not group_may_read and mode & 0o077:
        raise refuse(f"can be read or written by others (mode {mode:04o}); chmod 600 {path}")


def _check_directory(path: str, refuse: Callable[[str], ConfigError]) -> None:
    """Whoever can write the file's directory can replace the file; whoever can write a
    directory above it can rename the one below away. So: the directory writable by the
    daemon's user (or root) alone, even sticky (under a sticky bit another user can still
    create the name before the operator does); each directory above it owned by root or
    that user and, when group or others may write it, sticky (they cannot rename what is
    not theirs)."""
    parent = os.path.realpath(os.path.dirname(path) or "/")
    uid, who = _owner()
    directory, first = parent, True
    while True:
        try:
            info = os.stat(directory)
        except OSError as exc:
            raise refuse(f"its directory {directory} cannot be read: {exc.strerror}") from None
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid not in (0, uid):
            raise refuse(f"is under {directory}, owned by uid {info.st_uid}, who could replace it; move the file to "
                         f"a directory owned by {who}, e.g. /etc/numa-infer")
        if mode & 0o022 and (first or not mode & stat.S_ISVTX):
            raise refuse(f"is under {directory}, which group or others can write (mode {mode:04o}): another user "
                         f"could put their own key there; move the file to a directory only {who} can write, e.g. "
                         f"/etc/numa-infer (mode 755 or 700)")
        if directory == "/":
            return
        directory, first = os.path.dirname(directory), False


def fingerprint(key: str | None) -> str:
    """Stands for the key in what is compared or logged (a changed key restarts the instances)."""
    return "" if key is None else hashlib.sha256(key.encode()).hexdigest()[:16]
