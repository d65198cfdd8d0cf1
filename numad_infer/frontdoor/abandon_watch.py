"""The daemon's watch for clients that left before their answer (abandoned.py says why).

Twice a second it reads the kernel's TCP tables for half-closed connections that the front
door's listening sockets took (at its address or its loopback twin's, accepted by HAProxy's
user): another local user's on the same port at another address never count. Only when
there are some does it ask HAProxy for its streams (`show sess`) and end theirs
(`shutdown session`). A thread of its own: the monitoring pass comes every
`monitor.interval_s` (5 s by default), too rarely for a slot to be free within a second, and
a pass may wait on probes. The usual poll reads two small tables and asks HAProxy nothing.

An edge: /proc and the runtime API. What to end is abandoned.py's.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path
from typing import Protocol

from numad_infer.config.values import parse_listen
from numad_infer.frontdoor.abandoned import Peer, Session, left_by_client, local_address, parse_sessions
from numad_infer.frontdoor.haproxy import HaproxyError
from numad_infer.frontdoor.haproxy_config import FRONTEND
from numad_infer.host.portowner import gone_at
from numad_infer.util.addresses import loopback_twin

log = logging.getLogger(__name__)

POLL_S = 0.5


class Commands(Protocol):
    def command(self, line: str) -> str: ...


class Runner(Protocol):
    @property
    def haproxy_uids(self) -> frozenset[int]: ...  # who HAProxy runs as (and root)


class Door(Protocol):
    """What the watch reads of the front door (control.Frontdoor)."""

    @property
    def listen(self) -> str: ...  # "" while there is no front door

    @property
    def api(self) -> Commands: ...

    @property
    def runner(self) -> Runner: ...


class AbandonWatch:
    def __init__(self, door: Door, proc: Path = Path("/proc"), poll_s: float = POLL_S) -> None:
        self.door = door
        self.proc = proc
        self.poll_s = poll_s
        # Requests ended because their client left, by backend, since the daemon started.
        # Written by the watch's thread only; the publisher reads a copy (`ended`).
        self._ended: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ended(self) -> dict[str, int]:
        with self._lock:
            return dict(self._ended)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="abandon-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # never let the watch die silently: the next poll tries again
                log.exception("the watch for clients that left failed")

    def poll(self) -> list[Session]:
        """One look: the streams ended this time."""
        if not self.door.listen:  # no front door
            return []
        host, port = parse_listen(self.door.listen)  # as validated: never refused here
        # Its loopback twin too: the front door serves both (frontdoor/listener.py). Only
        # connections its own listeners took count, accepted by HAProxy (as its user), never
        # another local user's on the same port at another address (portowner.clients_gone).
        twin = loopback_twin(host)
        gone = gone_at(self.proc, [host] if twin is None else [host, twin], port, self.door.runner.haproxy_uids)
        if not gone:
            return []
        try:
            sessions = parse_sessions(self.door.api.command("show sess"))
        except HaproxyError as exc:
            log.debug("clients left, but HAProxy's streams cannot be read: %s", exc)
            return []
        # The queued first: ending a request at an instance frees its slot, and HAProxy would
        # hand that slot at once to a queued request whose client has left too.
        left = sorted(left_by_client(sessions, FRONTEND, set(gone)), key=lambda s: not s.queued)
        ended = [s for s in left if self._connected_to(s, gone[s.client]) and self._shut(s)]
        if ended:
            with self._lock:
                self._ended.update(s.backend for s in ended)
            log.info("%d client(s) left before their answer: stopped %s", len(ended),
                     ", ".join(f"{s.backend}/{s.server} (queued)" if s.queued else f"{s.backend}/{s.server}"
                               f" (after {s.age})" for s in ended))
        return ended

    def _connected_to(self, session: Session, locals_gone: set[Peer]) -> bool:
        """Did the stream's client connect to one of these local addresses? `show sess`
        names a stream's client only: on a wildcard front door, a client with a key could
        connect at another local address from the address and port of someone else's
        request, and close. The kernel's tuple is whole only with the local address."""
        try:
            local = local_address(self.door.api.command(f"show sess {session.id}"))
        except HaproxyError as exc:
            log.debug("cannot read the stream %s: %s", session.id, exc)
            return False
        return local in locals_gone

    def _shut(self, session: Session) -> bool:
        try:
            answer = self.door.api.command(f"shutdown session {session.id}").strip()
        except HaproxyError as exc:
            log.debug("cannot stop the stream %s: %s", session.id, exc)
            return False
        # HAProxy answers nothing on success; "No such session" when it ended meanwhile.
        return not answer
