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
line per request (haproxy_config.REQUEST_LOG_FORMAT: "<server> <status> <ttft ms> <active
ms>"; with `[[tenants]]`, then "<tenant> <prompt tokens> <completion tokens>", "-" where
not known); a datagram counts only when the kernel says (SCM_CREDENTIALS) its sender is
HAProxy's user or root, so another local user cannot write figures into the metrics.
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


@dataclass
class _Tally:
    answers: dict[str, int] = field(default_factory=dict)
    first: Recorder = field(default_factory=lambda: Recorder(TIME_TO_FIRST_TOKEN_BOUNDS))
    whole: Recorder = field(default_factory=lambda: Recorder(REQUEST_DURATION_BOUNDS))
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counted_answers: int = 0


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
        # 4: a HAProxy started before tenants were logged; 5: before their tokens were.
        if len(words) not in (4, 5, 7):
            return False
        server, status, first_ms, active_ms = words[:4]
        tenant = words[4] if len(words) >= 5 and words[4] != "-" else None
        tokens = (_count(words[5]), _count(words[6])) if len(words) == 7 else (None, None)
        try:
            first, whole = int(first_ms) / 1000, int(active_ms) / 1000
        except ValueError:
            first = whole = -1.0  # "-": no answer came from the server (cut, timed out, refused)
        served = not server.startswith("<") and first >= 0 and whole >= 0  # <NOSRV>: HAProxy's own answer
        with self._lock:
            if tenant is not None and status.isdigit():
                tally = self._tenants.setdefault(tenant, _Tally())
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
                                      t.completion_tokens, t.counted_answers)
                    for name, t in self._tenants.items()}


class RequestLog:
    """The socket HAProxy logs to, and the thread that reads it into `timings`."""

    def __init__(self, path: Path, senders: frozenset[int]) -> None:
        self.path, self.senders = path, senders
        self.timings = Timings()
        self._sock: socket.socket | None = None

    def start(self) -> None:
        if self._sock is not None:
            return
        self.path.unlink(missing_ok=True)  # a previous daemon's
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        old = os.umask(0o111)  # HAProxy's user must write to it; the senders' check keeps others out
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        self._sock = sock
        threading.Thread(target=self._serve, args=(sock,), name="request-log", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
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
