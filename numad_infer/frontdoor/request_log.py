"""HAProxy's per-request log line, sent to the daemon: time to first token and request
duration per instance, as histograms.

Why HAProxy's timings and not the engines': every request goes through it whichever
engine answers, its clock includes the wait in its own queue (which no engine sees), and
llama-server's own metrics have totals, not one figure per request. A stream's response
headers leave llama-server at once, before any token, so HAProxy's header time (%Tr)
would say nothing; haproxy_config.py makes HAProxy wait for the first byte of the body
(`wait-for-body at-least 1`) and note the time then. That first chunk holds the first
token: for a stream it is the time to first token a client sees, for an answer sent
whole it is the whole answer, which is when such a client gets its first token too.

Edge: a unix datagram socket the daemon binds in its run directory. HAProxy sends one
line per request (haproxy_config.REQUEST_LOG_FORMAT: "<server> <status>/<how it ended>
<ttft ms> <active ms>"; with `[[tenants]]`, then "<tenant> <prompt tokens> <completion
tokens>", "-" where not known). Only HAProxy (through its group, or as the daemon's own
user) and root may send to it (the file's mode, `RequestLog.start`), and a datagram counts
only when the kernel says (SCM_CREDENTIALS) its sender is HAProxy's user or root: another
local user can neither write figures into the metrics nor crowd HAProxy's lines out of the
socket's queue.

A request whose client left before its answer (HAProxy's termination state: the client
aborted, or the daemon's watch ended the stream, frontdoor/abandoned.py) is its tenant's
`left`, not an answer by status: HAProxy logs such a stream with the 502 it never sent, and
an alert on 5xx must not fire because users gave up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

from numad_infer.util.histogram import (
    REQUEST_DURATION_BOUNDS,
    TIME_TO_FIRST_TOKEN_BOUNDS,
    Histogram,
    Recorder,
)

log = logging.getLogger(__name__)

_MAX_DATAGRAM = 1024  # the line is ~40 bytes; HAProxy's `len` is set to this too
_CREDENTIALS = struct.calcsize("3i")
# %ts's first character when the client went away first: "C", it aborted; "K", an admin
# ended the stream, which only the daemon's abandon watch does, and only for a client that
# left (`shutdown session`). Not "c", a client too slow to send its request (HAProxy's 408).
_CLIENT_LEFT = frozenset("CK")


@dataclass(frozen=True)
class TenantUsage:
    """One tenant's requests as the front door answered them (frontdoor/tenants.py)."""

    answers: dict[str, int]  # by HTTP status ("200", "429"...), HAProxy's own refusals included
    time_to_first_token: Histogram  # requests an instance answered
    request_duration: Histogram
    # Tokens as the engine reported them, in answers sent whole or streamed (token_count.py),
    # and how many answers those are.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counted_answers: int = 0
    # Requests whose client left before the answer's end: not in `answers` under the status
    # HAProxy logged for them (a 502 no one was sent, or the 200 of a stream cut short).
    left: int = 0


@dataclass
class _Tally:
    answers: dict[str, int] = field(default_factory=dict)
    first: Recorder = field(default_factory=lambda: Recorder(TIME_TO_FIRST_TOKEN_BOUNDS))
    whole: Recorder = field(default_factory=lambda: Recorder(REQUEST_DURATION_BOUNDS))
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counted_answers: int = 0
    left: int = 0


def _count(word: str) -> int | None:
    return int(word) if word.isdigit() else None  # "-": not read (a stream, a refusal)


class Timings:
    """Per server: time to first token and request duration; per tenant, the same, the
    answers by status and the tokens HAProxy read. Filled from log lines."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: dict[str, Recorder] = {}
        self._whole: dict[str, Recorder] = {}
        self._tenants: dict[str, _Tally] = {}

    def record(self, line: str) -> bool:
        """One log line; False for one that is not a served request's (nothing recorded per
        server; a tenant's refusal is still counted for the tenant)."""
        words = line.split()
        # 4: without tenants; 5: a HAProxy started before tenants' tokens were logged; 7: with them.
        if len(words) not in (4, 5, 7):
            return False
        server, ended, first_ms, active_ms = words[:4]
        # "502/KD"; "502" alone from a HAProxy started before the ending was logged: not known.
        status, _, how = ended.partition("/")
        left = how[:1] in _CLIENT_LEFT
        tenant = words[4] if len(words) >= 5 and words[4] != "-" else None
        tokens = (_count(words[5]), _count(words[6])) if len(words) == 7 else (None, None)
        try:
            first, whole = int(first_ms) / 1000, int(active_ms) / 1000
        except ValueError:
            first = whole = -1.0  # "-": no answer came from the server (cut, timed out, refused)
        served = not server.startswith("<") and first >= 0 and whole >= 0  # <NOSRV>: HAProxy's own answer
        with self._lock:
            if tenant is not None and (status.isdigit() or left):
                tally = self._tenants.setdefault(tenant, _Tally())
                if left:
                    tally.left += 1
                else:
                    tally.answers[status] = tally.answers.get(status, 0) + 1
                if served:
                    tally.first.observe(first)
                    tally.whole.observe(whole)
                if served and tokens[0] is not None and tokens[1] is not None:
                    tally.prompt_tokens += tokens[0]
                    tally.completion_tokens += tokens[1]
                    tally.counted_answers += 1
            if served:
                self._first.setdefault(server, Recorder(TIME_TO_FIRST_TOKEN_BOUNDS)).observe(first)
                self._whole.setdefault(server, Recorder(REQUEST_DURATION_BOUNDS)).observe(whole)
        return served

    def snapshot(self) -> dict[str, tuple[Histogram, Histogram]]:
        """server -> (time to first token, request duration)."""
        with self._lock:
            return {name: (first.snapshot(), self._whole[name].snapshot()) for name, first in self._first.items()}

    def tenants(self) -> dict[str, TenantUsage]:
        """tenant -> its usage since the daemon started."""
        with self._lock:
            return {name: TenantUsage(dict(t.answers), t.first.snapshot(), t.whole.snapshot(), t.prompt_tokens,
                                      t.completion_tokens, t.counted_answers, t.left)
                    for name, t in self._tenants.items()}


class RequestLog:
    """The socket HAProxy logs to, and the thread that reads it into `timings`.

    `senders`: the uids whose lines count (HAProxy's user, root). `group`: HAProxy's group,
    which may send to the socket besides its owner; None where HAProxy runs as the daemon's
    own user (or as root), and the owner alone may."""

    def __init__(self, path: Path, senders: frozenset[int], group: int | None = None) -> None:
        self.path, self.senders, self.group = path, senders, group
        self.timings = Timings()
        self._sock: socket.socket | None = None

    def start(self) -> None:
        if self._sock is not None:
            return
        self.path.unlink(missing_ok=True)  # a previous daemon's
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            # Sending to a unix socket needs write permission on its file. The senders' check
            # alone refuses a stranger's lines only once they are read: meanwhile they fill
            # the socket's queue, and HAProxy, which never waits for room, loses its own.
            old = os.umask(0o177)  # 0600 from the moment it exists, never a moment wider
            try:
                sock.bind(str(self.path))
            finally:
                os.umask(old)
            if self.group is not None:
                os.chown(self.path, -1, self.group)  # the daemon is root, or in that group
                os.chmod(self.path, 0o660)
        except OSError:
            sock.close()
            with contextlib.suppress(OSError):
                self.path.unlink()
            raise
        self._sock = sock
        threading.Thread(target=self._serve, args=(sock,), name="request-log", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        # What remains: Linux queues at most net.unix.max_dgram_qlen datagrams (10 unless
        # raised) on a unix datagram socket, whatever SO_RCVBUF says (measured: a larger
        # buffer queues no more lines), and HAProxy drops a line it cannot send at once. So
        # this loop does nothing else (a line from another sender is dropped undecoded), and a
        # burst of more answers than that ending while the thread waits for the GIL loses
        # some; root, and users in HAProxy's group, can still crowd the queue.
        while True:
            try:
                data, ancillary, _, _ = sock.recvmsg(_MAX_DATAGRAM, socket.CMSG_SPACE(_CREDENTIALS))
            except OSError:
                return  # closed
            if self._sender(ancillary) not in self.senders:
                continue
            self.timings.record(data.decode("ascii", errors="replace"))

    @staticmethod
    def _sender(ancillary: list[tuple[int, int, bytes]]) -> int | None:
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _CREDENTIALS:
                uid: int = struct.unpack("3i", payload[:_CREDENTIALS])[1]  # struct ucred: pid, uid, gid
                return uid
        return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(OSError):
                self.path.unlink()
