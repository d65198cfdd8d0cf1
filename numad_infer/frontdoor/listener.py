"""The front door's listening socket, held by the daemon rather than by HAProxy.

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
  one service's descriptor to another. The daemon keeps the socket in its own unit's file
  descriptor store (`store`), so that a daemon killed and restarted finds the same socket,
  and connections made meanwhile are still answered.

An edge: sockets and nothing else. The front door (`frontdoor.py`) decides when.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from numad_infer.systemd.unitnames import FRONTDOOR_FD_VARIABLE

log = logging.getLogger(__name__)

# Under this name for backends.py and frontdoor_exec.py, which import it from here.
FD_VARIABLE = FRONTDOOR_FD_VARIABLE

# The kernel caps it at net.core.somaxconn: what waits there while HAProxy is restarted.
BACKLOG = 4096
# Its name in the daemon unit's file descriptor store (FDNAME=).
STORE_NAME = "frontdoor"

# Keeps the socket somewhere that outlives the daemon: called with the descriptor on a new
# socket, with None once the daemon lets go of it (Notifier.store_fd).
Store = Callable[[str, "int | None"], None]


class HeldListener:
    """One listening TCP socket at the front door's address, or none."""

    def __init__(self, store: Store | None = None) -> None:
        self._sock: socket.socket | None = None
        self.address: tuple[str, int] | None = None
        self._store = store
        # The handout thread sends the descriptor while the loop may close it: never a
        # number that was closed (and perhaps reused) meanwhile.
        self.lock = threading.Lock()

    @property
    def fd(self) -> int | None:
        """The descriptor HAProxy is given, None while nothing is held."""
        return None if self._sock is None else self._sock.fileno()

    def adopt(self, fd: int) -> None:
        """Take a listening socket kept for us (a restarted daemon's file descriptor store)."""
        sock = socket.socket(fileno=fd)
        listening, host, port = 0, "", 0
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            try:
                host, port = sock.getsockname()[:2]
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            except OSError:
                pass
        if not listening:
            log.warning("front door: the kept descriptor %d is not a listening TCP socket: dropped", fd)
            sock.close()
            if self._store is not None:
                self._store(STORE_NAME, None)
            return
        os.set_inheritable(fd, False)
        with self.lock:
            self._sock, self.address = sock, (host, port)
        log.info("front door: took back the listening socket on %s:%d (fd %d): "
                 "connections made while the daemon was away are still answered", host, port, fd)

    def hold(self, host: str, port: int) -> int:
        """Listen on host:port, or keep the socket already there. Returns its descriptor.

        OSError (the port is taken, the address is not this machine's) is for the caller
        to report in the operator's words."""
        if self._sock is not None and self.address == (host, port):
            return self._sock.fileno()
        self.refuse()
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
        with self.lock:
            self._sock, self.address = sock, (host, port)
        if self._store is not None:
            self._store(STORE_NAME, sock.fileno())
        log.info("front door: holding the listening socket on %s:%d (fd %d)", host, port, sock.fileno())
        return sock.fileno()

    def refuse(self) -> None:
        """Refuse new connections now, in every process that holds this socket; keep those
        already accepted. The daemon lets go of the socket."""
        with self.lock:
            sock, self._sock, self.address = self._sock, None, None
        if sock is None:
            return
        if self._store is not None:
            self._store(STORE_NAME, None)
        with contextlib.suppress(OSError):  # not connected/listening any more: nothing to refuse
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


class Handout:
    """Hands the held socket to HAProxy's unit (`frontdoor_exec`) over a unix socket.

    Only to a peer whose uid is in `uids` (SO_PEERCRED: the front door's user, or root):
    the file is group-only besides, in the daemon's run directory.
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
        old = os.umask(0o117)  # 0660 from the start, never a moment wider
        try:
            server.bind(str(self.path))
        finally:
            os.umask(old)
        if self.gid is not None:
            os.chown(self.path, -1, self.gid)  # the daemon is in that group: no capability needed
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
            fd = self.listener.fd
            if fd is None:
                conn.sendall(b"none\n")  # draining or stopped: HAProxy must not start on it
                return
            socket.send_fds(conn, [b"fd\n"], [fd])
        log.info("front door: handed the listening socket to pid %d", pid)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
            self.path.unlink(missing_ok=True)


def receive(path: str) -> int | None:
    """The held socket, from the daemon's `Handout` (a new descriptor in this process), or
    None where it holds none. OSError where the daemon does not answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        message, fds, _, _ = socket.recv_fds(conn, 64, 1)
    if message.startswith(b"fd") and fds:
        return fds[0]
    for fd in fds:
        os.close(fd)
    return None
