"""Whether HAProxy took the reload the daemon asked for, and asking again when it did not.

HAProxy's master drops a SIGUSR2 that arrives while it is still starting, though its worker
already answers the runtime API: measured, 63 of 100 reloads sent right after the first
answer, under load, were never taken, and the front door kept serving the previous plan.
A reload that took hands the runtime API to a new worker, so a new PID in `show info` is
the sign; until it shows, each pass asks again once RELOAD_TAKEN_S has passed.
No I/O of its own: it is handed how to read the PID and how to send the reload.
Clocked by the caller's passes (`check`), never waiting itself."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from numad_infer.errors import NumaInferError

log = logging.getLogger(__name__)

# Longer than a reload takes on a loaded 2-core machine (parse, fork, hand over: well under
# a second), so a slow reload is not asked for twice; a second ask would be harmless anyway.
RELOAD_TAKEN_S = 2.0


class ReloadSeen(str, Enum):
    NONE = "none"  # no reload pending
    TAKEN = "taken"  # another worker answers now
    WAITING = "waiting"  # not yet, and not long enough to ask again
    ASK_AGAIN = "ask again"  # not taken after RELOAD_TAKEN_S: send it again


@dataclass(frozen=True)
class PendingReload:
    """A reload asked for and not yet seen taken: the worker that answered before it."""

    worker_pid: int
    asked_at: float  # the clock's reading when last asked
    asks: int


def asked(pending: PendingReload | None, before: int | None, now: float) -> PendingReload | None:
    """The pending reload once one more is asked for (`before`: the worker answering then;
    None when none answered, so there is nothing to tell a new worker from)."""
    asks = 1 if pending is None else pending.asks + 1
    return None if before is None else PendingReload(before, now, asks)


def seen(pending: PendingReload | None, worker_pid: int, now: float) -> ReloadSeen:
    """What the worker answering now says of the pending reload."""
    if pending is None:
        return ReloadSeen.NONE
    if worker_pid != pending.worker_pid:
        return ReloadSeen.TAKEN
    return ReloadSeen.ASK_AGAIN if now - pending.asked_at >= RELOAD_TAKEN_S else ReloadSeen.WAITING


class ReloadWatch:
    """The front door's reloads, from asked to taken. `worker_pid`: the PID of the worker
    answering the runtime API (a NumaInferError when none answers); `send`: the reload."""

    def __init__(self, worker_pid: Callable[[], int], send: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_pid, self.send, self.clock = worker_pid, send, clock
        self.pending: PendingReload | None = None  # asked, not yet seen taken

    def ask(self) -> None:
        try:
            before: int | None = self.worker_pid()
        except NumaInferError:
            before = None  # not answering: nothing to tell a new worker from
        self.send()
        self.pending = asked(self.pending, before, self.clock())

    def forget(self) -> None:
        """A new HAProxy reads the file as it is: nothing asked of the old one is pending."""
        self.pending = None

    def check(self) -> None:
        """Once a pass: a pending reload seen taken, or asked for again."""
        if self.pending is None:
            return
        try:
            worker = self.worker_pid()
        except NumaInferError:
            return  # between workers, or not answering: the next pass looks again
        verdict = seen(self.pending, worker, self.clock())
        if verdict == ReloadSeen.TAKEN:
            self.pending = None
        elif verdict == ReloadSeen.ASK_AGAIN:
            log.warning("front door: haproxy has not taken the reload asked %d time(s) (worker %d still answers): "
                        "asking again", self.pending.asks, worker)
            self.send()
            self.pending = asked(self.pending, worker, self.clock())
