"""The front door's listening sockets, held by the daemon rather than by HAProxy.

Why: a port that only HAProxy holds is closed while HAProxy is dead. Between a kill and the
restart every connection is refused, and the chaos soak counted those refusals as failures
before the first byte. A socket the daemon holds outlives HAProxy: connections made
meanwhile wait in its backlog and are answered once HAProxy is back. HAProxy takes the same
socket as `bind "fd@${NUMA_INFER_FRONTDOOR_FD}"`, and keeps it across its seamless reloads.

It also makes the drain honest. `disable frontend` pauses HAProxy's listener, but on an
inherited socket the kernel keeps queueing connections that no one accepts. `refuse()` shuts
the socket down, and Linux then refuses new connections at once for every process holding it,
while connections already accepted run to their end.

How HAProxy gets it depends on who starts HAProxy:
- the process backend passes it to its child (pass_fds);
- under systemd, the front door's unit starts HAProxy through `frontdoor_exec`, which asks
  the daemon for it over a unix socket (`Handout`, SCM_RIGHTS): systemd has no way to pass
  one service's descriptor to another.

The port is a credential's way in: a local user who binds it while no one holds it gets
the clients, and the API keys they send. So it is never left free:
- under systemd, numa-infer-port.socket binds it at boot (sockets.target, before any
  user's process runs) and keeps it while the daemon is stopped or restarting; the daemon
  gets it at each start (LISTEN_FDNAMES "port"). `offer` takes what systemd passed, `hold`
  uses the socket bound to the configured address (getsockname) and binds its own where
  there is none (the unit is missing, or has the previous frontend.listen until it is
  started again: backends/portunit.py);
- a socket the daemon bound goes into its unit's file descriptor store (`store`), so that a
  daemon killed and restarted finds the same socket, and connections made meanwhile are
  still answered;
- the drain's shut-down socket stays bound with SO_REUSEADDR off: Linux lets a second
  SO_REUSEADDR socket bind an address whose socket does not listen, so with it on, anyone
  could take the port while the daemon drains. On a stop the daemon listens again before
  it exits (`release`): systemd fails a socket unit whose socket hangs up, and closes it.

`localhost` is both 127.0.0.1 and ::1 (util/addresses.py says why that matters): a front
door on one loopback address (or a wildcard) also listens on the other's port, its
"twin", and HAProxy serves both.

An edge: sockets and nothing else. The front door (`control.py`) decides when.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from numad_infer.frontdoor.checked_config import twin_of
from numad_infer.systemd.unitnames import FRONTDOOR_FD_VARIABLE, FRONTDOOR_TWIN_FD_VARIABLE, PORT_FD_NAME, PORT_SOCKET
from numad_infer.util.addresses import host_port, same_address

log = logging.getLogger(__name__)

# Under these names for backends and frontdoor_exec, which import them from here.
FD_VARIABLE = FRONTDOOR_FD_VARIABLE
TWIN_FD_VARIABLE = FRONTDOOR_TWIN_FD_VARIABLE

# The kernel caps it at net.core.somaxconn: what waits there while HAProxy is restarted.
# numa-infer-port.socket's Backlog= is the same (tests/units).
BACKLOG = 4096
# Their names in the daemon unit's file descriptor store (FDNAME=), by the variable
# haproxy.cfg finds each in.
STORE_NAME = "frontdoor"
TWIN_STORE_NAME = "frontdoor-twin"
STORE_NAMES = {FD_VARIABLE: STORE_NAME, TWIN_FD_VARIABLE: TWIN_STORE_NAME}
# Where systemd kept a socket, by the name LISTEN_FDNAMES gives it: for the log.
_STORE = "the file descriptor store"
ORIGINS = {PORT_FD_NAME: PORT_SOCKET, STORE_NAME: _STORE, TWIN_STORE_NAME: _STORE}

# Keeps a socket somewhere that outlives the daemon: called with the descriptor on a new
# socket, with None once the daemon lets go of it (Notifier.store_fd).
Store = Callable[[str, "int | None"], None]


@dataclass(eq=False)
class Held:
    """One listening socket of the front door, and where it came from."""

    sock: socket.socket
    address: tuple[str, int]  # as frontend.listen writes it, once `hold` uses it
    name: str  # its LISTEN_FDNAMES name ("" for one bound here)
    from_unit: bool  # numa-infer-port.socket holds it too: never left shut down

    @property
    def origin(self) -> str:
        return ORIGINS.get(self.name, "a bind of its own")

    @property
    def listening(self) -> bool:
        try:
            return bool(self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        except OSError:
            return False


def _tcp_address(sock: socket.socket) -> tuple[str, int] | None:
    """Where a TCP socket is bound, None for anything else (or an unbound one)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return None
    try:
        host, port = sock.getsockname()[:2]
    except OSError:
        return None
    return (host, port) if port else None


def _same_socket(a: socket.socket, b: socket.socket) -> bool:
    return os.fstat(a.fileno()).st_ino == os.fstat(b.fileno()).st_ino


def _listen(sock: socket.socket) -> None:
    # Back on: with it off, connections of the old listener in TIME_WAIT make listen() fail.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.listen(BACKLOG)


def _bind(address: tuple[str, int]) -> socket.socket:
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A HAProxy that outlived a previous holder may still have the port in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    # Inherited only where it is passed (pass_fds): HAProxy, and its `-c` check.
    os.set_inheritable(sock.fileno(), False)
    return sock


class HeldListener:
    """The front door's listening sockets: one at the configured address, and its loopback
    twin where it has one; or none."""

    def __init__(self, store: Store | None = None) -> None:
        self._held: dict[str, Held] = {}  # by the variable haproxy.cfg finds it in
        self._kept: list[Held] = []  # what systemd passed at start, until `hold` uses or drops it
        self._store = store
        self.refused = False  # the drain shut them down: HAProxy must not start on them
        # The handout thread sends the descriptors while the loop may close them: never a
        # number that was closed (and perhaps reused) meanwhile.
        self.lock = threading.Lock()

    @property
    def address(self) -> tuple[str, int] | None:
        """frontend.listen's address while a socket is held there."""
        held = self._held.get(FD_VARIABLE)
        return None if held is None else held.address

    @property
    def fds(self) -> dict[str, int]:
        """The descriptors HAProxy is given, by the variable its config names; none while
        the drain refuses connections."""
        return {} if self.refused else {var: held.sock.fileno() for var, held in self._held.items()}

    @property
    def fd(self) -> int | None:
        return self.fds.get(FD_VARIABLE)

    def held(self) -> list[Held]:
        return list(self._held.values())

    def offer(self, kept: Mapping[str, list[int]]) -> None:
        """Take the descriptors systemd passed this daemon (LISTEN_FDS, by name): what
        numa-infer-port.socket holds, and what a previous daemon stored. `hold` uses them."""
        for name, fds in kept.items():
            for fd in fds:
                self._offer(name, fd)

    def _offer(self, name: str, fd: int) -> None:
        sock = socket.socket(fileno=fd)
        address = _tcp_address(sock) if name in ORIGINS else None
        if address is None:
            log.warning("front door: the kept descriptor %d (%s) is not a bound TCP socket: dropped", fd, name)
            sock.close()
            if name in STORE_NAMES.values() and self._store is not None:
                self._store(name, None)
            return
        os.set_inheritable(fd, False)
        # HAProxy accepts on the same open file: a blocking one stalls its workers in accept()
        # (systemd clears O_NONBLOCK on the sockets it passes unless NonBlocking=yes).
        os.set_blocking(fd, False)
        same = next((held for held in self._kept if _same_socket(held.sock, sock)), None)
        if same is None:
            self._kept.append(Held(sock, address, name, name == PORT_FD_NAME))
            return
        # The socket unit's socket, stored too: one copy is enough, known as the unit's.
        if name == PORT_FD_NAME:
            same.name, same.from_unit = name, True
        sock.close()

    def hold(self, host: str, port: int) -> bool:
        """Listen on host:port and its loopback twin: on a socket held or kept there, or a
        new one; then let go of the others. True when one is new (bound now): a HAProxy
        running on the old ones must be restarted. A kept one is what it runs on already.

        OSError (the port is taken, the address is not this machine's) is for the caller
        to report in the operator's words; nothing changes then."""
        before = [*self._held.values(), *self._kept]
        new = {FD_VARIABLE: self._acquire((host, port))}
        twin = twin_of(host)
        port = new[FD_VARIABLE].sock.getsockname()[1]  # port 0 (tests): the twin at the port it got
        if twin is not None:  # haproxy.cfg binds it exactly then (checked_config.py)
            new[TWIN_FD_VARIABLE] = self._acquire_twin((twin, port))
        self._drop_kept((host, port))
        with self.lock:
            old, self._held, self.refused = self._held, new, False
        for var, held in old.items():
            if all(held is not kept for kept in new.values()):
                self._let_go(var, held)
        for var, held in new.items():
            if all(held is not was for was in old.values()) and self._store is not None:
                self._store(STORE_NAMES[var], held.sock.fileno())
        return any(all(held is not was for was in before) for held in new.values())

    def _acquire(self, address: tuple[str, int]) -> Held:
        for held in self._held.values():
            if same_address(held.address, address):
                if not held.listening:  # a drain was cut short by a new plan
                    _listen(held.sock)
                return held
        for held in self._kept:
            if same_address(held.address, address):
                if not held.listening:  # a drain, or a daemon that died before it listened again
                    _listen(held.sock)
                self._kept.remove(held)
                held.address = address
                log.info("front door: took the listening socket on %s from %s (fd %d)", host_port(*address),
                         held.origin, held.sock.fileno())
                return held
        sock = _bind(address)
        log.info("front door: holding the listening socket on %s (fd %d)", host_port(*address), sock.fileno())
        return Held(sock, address, "", False)

    def _acquire_twin(self, address: tuple[str, int]) -> Held:
        """The twin's socket; where its port is taken, one at port 0 in its place: haproxy.cfg
        binds a twin wherever the host has the address, and its check passed so."""
        try:
            return self._acquire(address)
        except OSError as exc:
            log.warning("front door: cannot listen on %s too (%s): a client that says `localhost` may reach "
                        "whoever holds it before the front door, and send it its API key; free it (ss -ltnp)",
                        host_port(*address), exc.strerror)
        try:
            stand_in = _bind((address[0], 0))
        except OSError:
            stand_in = _bind(("127.0.0.1", 0))
        return Held(stand_in, stand_in.getsockname()[:2], "", False)

    def _drop_kept(self, wanted: tuple[str, int]) -> None:
        """What systemd passed and `hold` did not use: another address than frontend.listen's."""
        for held in self._kept:
            where = host_port(*held.address)
            if held.from_unit:
                log.warning("front door: %s holds %s, frontend.listen is %s: not using it (it takes the new address "
                            "from its next start)", PORT_SOCKET, where, host_port(*wanted))
            else:
                log.info("front door: dropped the kept socket on %s (frontend.listen is %s)", where,
                         host_port(*wanted))
                if self._store is not None:
                    self._store(held.name, None)
                with contextlib.suppress(OSError):
                    held.sock.shutdown(socket.SHUT_RDWR)  # refused in a HAProxy still on it, until restarted
            held.sock.close()
        self._kept = []

    def _let_go(self, var: str, held: Held) -> None:
        if self._store is not None:
            self._store(STORE_NAMES[var], None)
        if not held.from_unit:
            with contextlib.suppress(OSError):  # not listening any more: nothing to refuse
                held.sock.shutdown(socket.SHUT_RDWR)  # refused now, in HAProxy's copy too
        elif not held.listening:
            with contextlib.suppress(OSError):
                _listen(held.sock)  # systemd's copy must go on listening, or systemd drops the port
        held.sock.close()

    def refuse(self) -> None:
        """Refuse new connections now, in every process that holds these sockets; keep those
        already accepted, and the port: no one else may bind it meanwhile."""
        with self.lock:
            self.refused = True
            held = list(self._held.values())
        for one in held:
            with contextlib.suppress(OSError):
                one.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
            with contextlib.suppress(OSError):  # not connected/listening any more: nothing to refuse
                one.sock.shutdown(socket.SHUT_RDWR)

    def lend(self) -> list[tuple[str, int]]:
        """Let another root socket bind the addresses of the sockets bound here
        (SO_REUSEPORT: Linux still refuses a process of another user), so that
        numa-infer-port.socket can take the port over before the daemon lets go: it is
        never free in between. Returns those addresses; call `refuse` first, or the two
        sockets share the connections until this one is closed."""
        lent = []
        for held in self._held.values():
            if not held.from_unit:
                held.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                lent.append(held.address)
        return lent

    def release(self) -> None:
        """Let go of every socket: the daemon serves no front door any more. One that
        numa-infer-port.socket holds too listens again first: it stays systemd's."""
        with self.lock:
            held, self._held, self.refused = self._held, {}, False
        for var, one in held.items():
            self._let_go(var, one)


class Handout:
    """Hands the held socket to HAProxy's unit (`frontdoor_exec`) over a unix socket.

    Only to a peer whose uid is in `uids` (SO_PEERCRED: the front door's user, or root):
    the file is its owner's and `gid`'s only (its owner's without one), in the run directory.
    """

    def __init__(self, listener: HeldListener, path: Path, uids: frozenset[int], gid: int | None) -> None:
        self.listener = listener
        self.path = path
        self.uids = uids
        self.gid = gid
        self._server: socket.socket | None = None

    def start(self) -> None:
        self.path.unlink(missing_ok=True)  # a previous daemon's
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # owner only: without `gid` the file's group is the daemon's, no one's to use
        try:
            server.bind(str(self.path))
        finally:
            os.umask(old)
        if self.gid is not None:
            os.chown(self.path, -1, self.gid)  # the daemon is in that group: no capability needed
            os.chmod(self.path, 0o660)  # the front door's user connects through its group
        server.listen(16)
        self._server = server
        threading.Thread(target=self._serve, args=(server,), name="frontdoor-handout", daemon=True).start()

    def _serve(self, server: socket.socket) -> None:
        # Its own reference: `close` clears the attribute while this thread may be between
        # two connections (a closed socket then ends the loop with OSError).
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    self._answer(conn)
                except OSError as exc:
                    log.warning("front door: handing the listening socket out failed: %s", exc)

    def _answer(self, conn: socket.socket) -> None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        pid, uid = int.from_bytes(creds[0:4], "little"), int.from_bytes(creds[4:8], "little")
        if uid not in self.uids:
            log.warning("front door: pid %d (uid %d) asked for the listening socket: refused", pid, uid)
            return
        with self.listener.lock:
            fds = self.listener.fds
            if FD_VARIABLE not in fds:
                conn.sendall(b"none\n")  # draining or stopped: HAProxy must not start on it
                return
            # Which variable each descriptor goes in, in the order they are sent.
            socket.send_fds(conn, [" ".join(["fd", *fds]).encode() + b"\n"], list(fds.values()))
        log.info("front door: handed the listening socket%s to pid %d", "s" if len(fds) > 1 else "", pid)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
            self.path.unlink(missing_ok=True)


def receive(path: str) -> dict[str, int] | None:
    """The held sockets, from the daemon's `Handout` (new descriptors in this process), by
    the variable haproxy.cfg names each by; None where it holds none. OSError where the
    daemon does not answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        message, fds, _, _ = socket.recv_fds(conn, 256, len(STORE_NAMES))
    words = [word.decode() for word in message.split()]
    if words[:1] == ["fd"] and len(words) == len(fds) + 1 and set(words[1:]) <= set(STORE_NAMES):
        return dict(zip(words[1:], fds, strict=True))
    for fd in fds:
        os.close(fd)
    return None
