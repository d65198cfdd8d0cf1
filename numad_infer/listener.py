"""The front door's listening socket, held by the daemon rather than by HAProxy.

Why: a port that only HAProxy holds is closed while HAProxy is dead. Between a kill and the
restart every connection is refused, and the chaos soak counted those refusals as failures
before the first byte. A socket the daemon holds outlives HAProxy: connections made
meanwhile wait in its backlog and are answered once HAProxy is back. HAProxy takes the same
socket as `bind fd@N`, and keeps it across its seamless reloads.

It also makes the drain honest. `disable frontend` pauses HAProxy's listener, but on an
inherited socket the kernel keeps queueing connections that no one accepts. `refuse()` shuts
the socket down, and Linux then refuses new connections at once for every process holding it,
while connections already accepted run to their end.

An edge: sockets and nothing else. The front door (`frontdoor.py`) decides when.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

# The kernel caps it at net.core.somaxconn: what waits there while HAProxy is restarted.
BACKLOG = 4096


class HeldListener:
    """One listening TCP socket at the front door's address, or none."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self.address: tuple[str, int] | None = None

    @property
    def fd(self) -> int | None:
        """The descriptor HAProxy is given (`bind fd@N`), None while nothing is held."""
        return None if self._sock is None else self._sock.fileno()

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
        self._sock, self.address = sock, (host, port)
        log.info("front door: holding the listening socket on %s:%d (fd %d)", host, port, sock.fileno())
        return sock.fileno()

    def refuse(self) -> None:
        """Refuse new connections now, in every process that holds this socket; keep those
        already accepted. The daemon lets go of the socket."""
        if self._sock is None:
            return
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected/listening any more: nothing to refuse
        self._sock.close()
        self._sock, self.address = None, None
