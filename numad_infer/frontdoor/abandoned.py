"""Requests whose client has left: which of HAProxy's streams to end.

On a CPU an answer nobody waits for still burns the cores, and takes a slot that a client
who waits could have. A streaming request is freed on its own: HAProxy's next write to the
gone client fails, it closes its connection to the instance, and llama-server cancels a task
whose connection is closed. A non-streaming request is not: HAProxy 2.6 reads nothing more
from a client whose request arrived whole, so it learns of the close only when it writes the
answer, and the instance generates to the last token (measured, docs/frontdoor.md; `option
abortonclose` changes nothing there, even for a queued request).

The kernel knows at once: the client's FIN puts HAProxy's end of the connection in
CLOSE_WAIT (host/portowner.clients_gone). The watch (abandon_watch.py) looks for such
connections that the front door's listening sockets accepted (never another local user's
on the same port), finds their streams in `show sess` by the client's address, and ends
them with `shutdown session`: HAProxy then closes its connection to the instance (the
engine stops, the slot is free) or drops the request from its queue.

A client that half-closes (shuts its sending side) and still reads is cut too, as HAProxy's
own `abortonclose` would. HTTP clients do not do that; docs/frontdoor.md says so.

Pure: text in, decisions out.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from numad_infer.util.addresses import unmapped

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Peer = tuple[IPAddress, int]

# One stream per line of `show sess`: "0x55dd2ec98800: proto=tcpv4 src=127.0.0.1:55584 fe=openai
# be=m srv=infer_0 ts=00 ... age=4s ...". A unix-socket client (the runtime API itself) has
# `src=unix:1`; an IPv6 one `src=::1:55584`.
_SESSION = re.compile(r"^(0x[0-9a-f]+): .*?\bsrc=(\S+) fe=(\S+) be=(\S+) srv=(\S+)(?: .*?\bage=(\S+))?")


@dataclass(frozen=True)
class Session:
    """One of HAProxy's streams: a request on its way (queued, or at an instance)."""

    id: str  # what `shutdown session` takes
    client: Peer
    frontend: str
    backend: str
    server: str  # "<none>" while the request waits in the queue
    age: str  # HAProxy's own notation ("4s", "1m2s"), for the log

    @property
    def queued(self) -> bool:
        return self.server in ("<none>", "<NONE>")


def parse_sessions(text: str) -> list[Session]:
    """The TCP clients' streams in `show sess`'s answer; other lines (the runtime API's own
    session, an applet's) are skipped."""
    found = []
    for line in text.splitlines():
        match = _SESSION.match(line.strip())
        if match is None:
            continue
        client = _peer(match.group(2))
        if client is not None:
            found.append(Session(match.group(1), client, match.group(3), match.group(4), match.group(5),
                                 match.group(6) or "?"))
    return found


def left_by_client(sessions: Iterable[Session], frontend: str, gone: set[Peer]) -> list[Session]:
    """The streams of `frontend` whose client's connection is half closed by the client."""
    return [s for s in sessions if s.frontend == frontend and s.client in gone]


# `show sess ID`'s line for the client's side: "  frontend=openai (id=2 mode=http), listener=?
# (id=1) addr=127.0.0.1:8000", the local address the client connected to.
_FRONT_ADDRESS = re.compile(r"^\s*frontend=\S+ .*?\baddr=(\S+)", re.MULTILINE)


def local_address(detail: str) -> Peer | None:
    """The local address and port of the stream `show sess ID` describes (None: not said,
    or the stream is gone)."""
    match = _FRONT_ADDRESS.search(detail)
    return _peer(match.group(1)) if match else None


def _peer(text: str) -> Peer | None:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or host.startswith("unix"):
        return None
    try:
        return unmapped(ipaddress.ip_address(host.strip("[]"))), int(port)
    except ValueError:
        return None
