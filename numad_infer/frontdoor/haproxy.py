"""HAProxy as a thin edge: the binary (version, `-c` validation, the `frontend.haproxy`
check) and the runtime API socket.

Everything numa-infer asks of a running HAProxy goes through `RuntimeAPI`: one text
command per connection on the admin socket (HAProxy's management guide, "Unix Socket
commands"). Parsing is kept to the few columns the front door uses.
"""

from __future__ import annotations

import csv
import io
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from numad_infer.errors import ConfigError, NumaInferError
from numad_infer.frontdoor import affinity
from numad_infer.frontdoor.haproxy_config import SPARE_PREFIX
from numad_infer.frontdoor.hold import HOLD_PREFIX
from numad_infer.util import peer
from numad_infer.util.printable import printable

if TYPE_CHECKING:
    from numad_infer.config.schema import Config

# json_query (affinity on the OpenAI "user" field), http-error and L7 retries are all in
# 2.6, the oldest HAProxy of a supported Debian release (12).
MIN_VERSION = (2, 6)


class HaproxyError(NumaInferError):
    pass


# The longest Unix socket path HAProxy binds or logs to: sun_path's 108 bytes, less its
# terminating NUL and the ".PID.tmp"-style name it binds first and renames into place
# (2.6 says "too long (max 97)").
SOCKET_PATH_MAX = 97


def version(binary: str, timeout_s: float = 30.0) -> tuple[int, int]:
    """(major, minor) of the haproxy at `binary`; HaproxyError when it is missing or is not haproxy.

    The limit only stops a hung binary, as `validate`'s does: a reload on a loaded machine
    (seen: a TCG guest beside another) once took over 10 s to run `haproxy -v`, and a
    reload refused for that would be a false alarm."""
    try:
        proc = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise HaproxyError("not found") from None
    except PermissionError:
        raise HaproxyError("is not executable") from None
    except OSError as exc:
        raise HaproxyError(f"cannot run: {exc.strerror}") from None
    except subprocess.TimeoutExpired:
        raise HaproxyError(f"`{binary} -v` gave no answer within {timeout_s:g}s") from None
    found = re.search(r"HAProxy version (\d+)\.(\d+)", proc.stdout)
    if proc.returncode != 0 or found is None:
        raise HaproxyError("is not haproxy (`-v` does not print \"HAProxy version\")")
    return int(found.group(1)), int(found.group(2))


def validate(binary: str, config_path: str, timeout_s: float = 30.0,
             listener_fds: Mapping[str, int] | None = None) -> None:
    """`haproxy -c`: HaproxyError with HAProxy's own words when the file is refused (never
    `-q`: it silences the alerts too, leaving only the exit status).
    `listener_fds`: the held sockets the file binds ("fd@${NUMA_INFER_FRONTDOOR_FD}"), by
    variable; the check refuses a descriptor it lacks."""
    fds = dict(listener_fds or {})
    env = {**os.environ, **{name: str(fd) for name, fd in fds.items()}} if fds else None
    try:
        proc = subprocess.run([binary, "-c", "-f", config_path], capture_output=True, text=True,
                              timeout=timeout_s, pass_fds=tuple(fds.values()), env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HaproxyError(f"cannot run {binary} -c: {exc}") from None
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines()
                 if "ALERT" in line or "error" in line.lower()]
        raise HaproxyError(f"haproxy -c refused {config_path}: " + ("; ".join(lines[:3]) or f"exit {proc.returncode}"))


class AdminState(str, Enum):
    """What the daemon wants HAProxy to do with one server (`set server ... state`)."""

    READY = "ready"  # in rotation
    DRAIN = "drain"  # finish what it has, take nothing new (a restart is coming)
    MAINT = "maint"  # out of rotation: unhealthy, failed, stopped or restarting


@dataclass(frozen=True)
class ServerStat:
    name: str
    status: str  # HAProxy's words: UP, DOWN, MAINT, DRAIN, "UP 1/2"...
    in_flight: int  # scur: requests being served
    queued: int  # qcur: requests waiting for this server
    served: int  # stot: requests sent to it since HAProxy (re)started
    # Its last health check's result: "L7OK" passed; "INI": none done yet (a server leaving
    # maintenance is UP before its first check); "" where not read.
    check: str = ""

    @property
    def admin(self) -> AdminState:
        # MAINT (also "MAINT (via ...)") wins over DRAIN; a drained server shows DRAIN.
        if self.status.startswith("MAINT"):
            return AdminState.MAINT
        if self.status.startswith("DRAIN"):
            return AdminState.DRAIN
        return AdminState.READY

    @property
    def in_rotation(self) -> bool:
        """HAProxy would send it a request now: ready (not drained, not in maintenance) and up."""
        return self.admin == AdminState.READY and self.status.startswith("UP")


@dataclass(frozen=True)
class BackendStat:
    queued: int  # waiting for an instance: in a queue, in the hold, in the batch wait
    in_flight: int  # at an instance (the spare included)
    servers: dict[str, ServerStat]  # every server, the spare a surge's copy serves from too

    @property
    def instances(self) -> dict[str, ServerStat]:
        """The servers of the plan's instances: all but the spare (haproxy_config.surge_server)
        and the hold server (hold.py)."""
        return {name: s for name, s in self.servers.items() if not name.startswith((SPARE_PREFIX, HOLD_PREFIX))}


# HAProxy counts a frontend's answers by class only (hrsp_1xx ... hrsp_other): its own
# 503 "queue full" answer is in 5xx with the instances' 500s and its 502/504s.
RESPONSE_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx", "other")


@dataclass(frozen=True)
class FrontendStat:
    responses: dict[str, int]  # class (RESPONSE_CLASSES) -> answers sent since HAProxy (re)started


# `show stat` is about 500 bytes a row, one row per instance and three more: 1 MiB is a
# thousand instances. An answer past it is no HAProxy's, and is refused unread.
ANSWER_CAP = 1 << 20
HOMES_CAP = 16 << 20  # the prefix keys' homes: 2 x HOME_GENERATION lines of ~40 bytes, per model


class NoRuntimeAnswer(HaproxyError):
    """HAProxy did not answer: no socket, refused, past the deadline, too long (as opposed
    to an answer that refuses the command)."""


class RuntimeAPI:
    def __init__(self, socket_path: str, timeout_s: float = 2.0, cap: int = ANSWER_CAP) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s  # for the whole command: connect, send, the whole answer
        self.cap = cap

    def command(self, line: str) -> str:
        # The socket's directory belongs to the front door's user, who can put a server of
        # their own there: one that answers a byte at a time, or without end, must not hold
        # the daemon's pass (util/peer.py).
        try:
            answer = peer.exchange(self.socket_path, line.encode() + b"\n", self.timeout_s, self.cap)
        except OSError as exc:
            raise NoRuntimeAnswer(f"runtime API {self.socket_path}: {exc.strerror or exc}") from None
        except peer.PeerError as exc:
            raise NoRuntimeAnswer(f"runtime API {self.socket_path}: {exc}") from None
        return answer.decode(errors="replace")

    def homes(self) -> str:
        """The prefix keys' homes (affinity.HOMES_COMMAND): up to 100,000 lines of ~40 bytes,
        without the blank line that ends every answer of HAProxy's CLI."""
        text = RuntimeAPI(self.socket_path, max(self.timeout_s, 5.0), HOMES_CAP).command(affinity.HOMES_COMMAND)
        return "".join(f"{line}\n" for line in text.splitlines() if line.strip())

    def backend(self, name: str) -> BackendStat:
        return _backend(self._show_stat(), name)

    def counters(self, backend: str, frontend: str) -> tuple[BackendStat, FrontendStat]:
        """The backend's servers and the frontend's answers, from one `show stat`."""
        rows = self._show_stat()
        return _backend(rows, backend), _frontend(rows, frontend)

    def backends(self, names: Sequence[str], frontend: str) -> tuple[dict[str, BackendStat], FrontendStat]:
        """Each named backend's servers, and the frontend's answers, from one `show stat`."""
        rows = self._show_stat()
        return {name: _backend(rows, name) for name in names}, _frontend(rows, frontend)

    def _show_stat(self) -> list[dict[str, str]]:
        text = self.command("show stat")
        if not text.startswith("# "):
            raise HaproxyError(f"runtime API: unexpected answer to show stat: {text[:120]!r}")
        return list(csv.DictReader(io.StringIO(text[2:])))

    def set_state(self, backend: str, server: str, state: AdminState) -> None:
        answer = self.command(f"set server {backend}/{server} state {state.value}").strip()
        if answer:  # HAProxy answers nothing on success; its answer may span lines
            raise HaproxyError(f"set server {backend}/{server} state {state.value}: {printable(answer)}")

    def worker_pid(self) -> int:
        """The PID of the worker answering (`show info`): a reload that took hands the
        socket to a new worker, so a new PID here is how the daemon knows it took."""
        text = self.command("show info")
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key == "Pid" and value.strip().isdigit():
                return int(value)
        raise HaproxyError(f"runtime API: no Pid in the answer to show info: {printable(text[:120])!r}")

    def servers_state(self) -> str:
        """`show servers state`: the file format `load-server-state-from-file` reads back."""
        return self.command("show servers state")


def _backend(rows: list[dict[str, str]], name: str) -> BackendStat:
    servers: dict[str, ServerStat] = {}
    held = 0  # the BACKEND row's scur
    found = False
    for row in rows:
        if row.get("pxname") != name:
            continue
        kind = row.get("svname", "")
        if kind == "BACKEND":
            found = True
            held = _int(row.get("scur"))
        elif kind != "FRONTEND":
            servers[kind] = ServerStat(kind, row.get("status", ""), _int(row.get("scur")), _int(row.get("qcur")),
                                       _int(row.get("stot")), row.get("check_status", ""))
    if not found:
        raise HaproxyError(f"runtime API: no backend {name!r} in show stat")
    # The BACKEND row's scur counts every request the backend holds (measured, HAProxy 2.6):
    # at a server, in the backend's queue or a server's own (prefix routing's), waiting in a
    # Lua action (the hold, the batch wait) or on the hold server. In flight: at an instance
    # (the servers' own scur, the hold server's left out); waiting: all the rest. A request
    # let go by the hold server passes through the backend again (hold.py) and is counted at
    # its instance too, until answered: then it is counted both ways.
    at_instances = sum(s.in_flight for n, s in servers.items() if not n.startswith(HOLD_PREFIX))
    return BackendStat(max(0, held - at_instances), at_instances, servers)


def merged(stats: Sequence[BackendStat]) -> BackendStat:
    """Several backends as one: queued and in flight summed, the servers side by side (their
    names differ: each is an instance's)."""
    return BackendStat(sum(s.queued for s in stats), sum(s.in_flight for s in stats),
                       {name: server for s in stats for name, server in s.servers.items()})


def _frontend(rows: list[dict[str, str]], name: str) -> FrontendStat:
    for row in rows:
        if row.get("pxname") == name and row.get("svname") == "FRONTEND":
            return FrontendStat({cls: _int(row.get(f"hrsp_{cls}")) for cls in RESPONSE_CLASSES})
    raise HaproxyError(f"runtime API: no frontend {name!r} in show stat")


def _int(value: str | None) -> int:
    return int(value) if value and value.isdigit() else 0


def check_haproxy(config: Config, source: str) -> None:
    """The configured haproxy exists and is recent enough (a ConfigError naming the key otherwise)."""
    if not config.frontend.enabled:
        return
    binary = config.frontend.haproxy
    off = 'or set frontend.listen = "" to run without a front door'
    try:
        found = version(binary)
    except HaproxyError as exc:
        raise ConfigError(source, "frontend.haproxy", f"{exc}; install it (apt-get install haproxy) {off}",
                          binary, True) from None
    if found < MIN_VERSION:
        need = ".".join(map(str, MIN_VERSION))
        raise ConfigError(source, "frontend.haproxy", f"is HAProxy {found[0]}.{found[1]}, older than {need}; "
                          f"install {need} or newer {off}", binary, True)
