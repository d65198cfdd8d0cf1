"""haproxy.cfg rendered once per plan, for the directory the front door runs from, and
checked by `haproxy -c` as it is: the text validation carries and the daemon writes.

Before, validation rendered and checked a scratch copy (the address bound by HAProxy, files
in a temporary directory), and the front door rendered and checked its own (the daemon's
sockets, its run directory): two texts, two checks, and a refusal that came only after the
instances had moved to the new plan. Now the text depends on nothing the front door learns
later:
- its files' paths are the front door's directory (`paths`), handed to validation;
- its binds are always the held sockets (`fd@`), and the loopback twin's bind is there
  exactly when this host has the twin's address (`twin_of`, a host fact read as the
  topology is). The listener hands HAProxy a socket for it in every case (listener.py).

`haproxy -c` is given stand-in sockets (loopback, port 0, bound, not listening) for the
descriptors the text binds: the check refuses a descriptor it lacks, and the daemon's own
are HAProxy's, or not held yet. An edge: a socket bound and closed, and a child process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from numad_infer.config.models import ServedModel
from numad_infer.config.schema import Config
from numad_infer.config.tenants import TenantKey
from numad_infer.engines import Engine
from numad_infer.frontdoor import haproxy, hold, lua, tenants
from numad_infer.frontdoor.haproxy import HaproxyError
from numad_infer.frontdoor.haproxy_config import CheckedConfig, Paths, paths_in, render_haproxy
from numad_infer.plan.model import Plan
from numad_infer.systemd.unitnames import FRONTDOOR_FD_VARIABLE, FRONTDOOR_TWIN_FD_VARIABLE
from numad_infer.util.addresses import loopback_twin
from numad_infer.util.atomicfile import write_atomic


def twin_of(host: str) -> str | None:
    """The loopback twin a front door on `host` also listens on, where this host has that
    address (no IPv6 on `lo`: no ::1). A host fact, read as validation reads the topology:
    haproxy.cfg binds the twin exactly then. Port 0: nothing is taken, the socket is closed."""
    twin = loopback_twin(host)
    if twin is None:
        return None
    try:
        with socket.socket(socket.AF_INET6 if ":" in twin else socket.AF_INET) as probe:
            probe.bind((twin, 0))
    except OSError as exc:
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            return None
    return twin


def put_lua(paths: Paths) -> None:
    """The Lua files haproxy.cfg loads and the data they read (lua.py), beside it, in place
    before the text is checked there: each one that differs."""
    for name, text in lua.files().items():
        path = paths.config.with_name(name)
        try:
            if path.read_text(encoding="utf-8") == text:
                continue
        except OSError:
            pass
        # Renamed into place, never written through; 0644: HAProxy runs as another user.
        write_atomic(path, text, durable=False)


def put_key_files(paths: Paths) -> None:
    """The key files haproxy.cfg names (tenants.py), so that `haproxy -c` finds them: made
    empty where missing (0600, the daemon's), never overwritten. Their keys are written
    only with the text that uses them (control.py), so a check never puts a key in force."""
    for path in paths.keys:
        with contextlib.suppress(FileExistsError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(tenants.HEADER)


def put_keys(paths: Paths, texts: tuple[str, str], group: int | None) -> bool:
    """The key files with their keys (`texts`: CheckedConfig.keys), readable by HAProxy's
    `group` alone (None: HAProxy runs as the daemon's user, 0600); True when one changed.
    Written on every apply (never in the monitoring loop): cheap, and a file someone
    chmod-ed is put right. HaproxyError when one cannot be written."""
    changed = False
    for path, text in zip(paths.keys, texts, strict=True):
        try:
            changed |= path.read_text(encoding="utf-8") != text
        except OSError:
            changed = True
        try:
            write_atomic(path, text, durable=False, mode=0o640 if group is not None else 0o600, group=group)
        except OSError as exc:
            raise HaproxyError(f"cannot write {path} (the front door's keys): {exc.strerror}; nothing "
                               "changed") from None
    return changed


def render_checked(config: Config, plan: Plan, served: tuple[ServedModel, ...], engine: Engine,
                   paths: Paths | None = None, keys: tuple[TenantKey, ...] = (),
                   api_key: str | None = None) -> CheckedConfig:
    """The plan's haproxy.cfg for the front door whose files are at `paths` (None: a scratch
    directory, for `check`, `plan` and tune, whose text is never written), checked as it is,
    with the key files' texts for `keys` (the tenants') and `api_key` (the instances').
    HaproxyError with HAProxy's words when refused."""
    texts = (tenants.keys_text(keys), tenants.upstream_text(api_key if config.tenants else None))
    if paths is not None:
        try:
            put_lua(paths)
            put_key_files(paths)
        except OSError as exc:
            raise HaproxyError(f"cannot write the front door's files beside {paths.config}: {exc.strerror}") from None
        return _checked(config, plan, served, engine, paths, texts)
    with tempfile.TemporaryDirectory(prefix="numa-infer-check-") as scratch:
        base = Path(scratch)
        where = paths_in(base, base / "admin.sock")
        put_lua(where)
        put_key_files(where)
        return _checked(config, plan, served, engine, where, texts)


def _checked(config: Config, plan: Plan, served: tuple[ServedModel, ...], engine: Engine,
             paths: Paths, keys: tuple[str, str]) -> CheckedConfig:
    _sockets_fit(paths, len(served))
    twin = twin_of(config.frontend.address[0]) is not None
    text = render_haproxy(config, plan, paths, held=True, twin=twin, served=served, engine=engine)
    with tempfile.TemporaryDirectory(prefix="numa-infer-check-") as scratch:
        candidate = Path(scratch) / paths.config.name
        candidate.write_text(text, encoding="utf-8")
        with _stand_ins([FRONTDOOR_FD_VARIABLE, *([FRONTDOOR_TWIN_FD_VARIABLE] if twin else [])]) as fds:
            haproxy.validate(config.frontend.haproxy, str(candidate), listener_fds=fds)
    return CheckedConfig(paths, text, keys)


def _sockets_fit(paths: Paths, models: int) -> None:
    """HaproxyError naming the fix when a socket HAProxy binds or logs to in the run
    directory has a longer path than it takes: HAProxy's own refusal names a path, not
    where the directory comes from."""
    sockets = [paths.socket, *([paths.requests] if paths.requests else []),
               *(hold.socket_of(paths.socket.parent, n) for n in range(models))]
    longest = max(sockets, key=lambda path: len(str(path)))
    if len(str(longest)) > haproxy.SOCKET_PATH_MAX:
        room = haproxy.SOCKET_PATH_MAX - (len(str(longest)) - len(str(longest.parent)))
        raise HaproxyError(f"the front door's sockets lie in {longest.parent}, too long a path: {longest} is "
                           f"{len(str(longest))} bytes and HAProxy takes at most {haproxy.SOCKET_PATH_MAX}; keep the "
                           f"state file (--state-file, NUMA_INFER_STATE_FILE) in a directory of at most {room} bytes")


@contextlib.contextmanager
def _stand_ins(variables: list[str]) -> Iterator[dict[str, int]]:
    with contextlib.ExitStack() as stack:
        fds = {}
        for variable in variables:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            fds[variable] = sock.fileno()
        yield fds
