"""Instance states and the supervision rules that move between them. Pure: time is passed in."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `numa-infer status` reads states without loading pydantic
    from numad_infer.config import MonitorSection


class State(str, Enum):
    STARTING = "starting"  # started, model loading, within the grace period
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # probes failing, restart pending
    DRAINING = "draining"  # out of the front door, finishing its requests before a restart
    FAILED = "failed"  # too many restarts: left alone until a reload
    STOPPED = "stopped"
    UNSUPERVISED = "unsupervised"  # running, but no daemon watches it (status with the daemon down)


class RestartDecision(Enum):
    RESTART = "restart"
    WAIT = "wait"  # backing off
    FAIL = "fail"  # restart budget exhausted


@dataclass
class Supervision:
    """Health bookkeeping for one instance, after supervisor's process state machine."""

    state: State = State.STOPPED
    started_at: float | None = None
    failures: int = 0  # consecutive failed probes after the grace period
    restarts: int = 0  # total, for status
    restart_times: list[float] = field(default_factory=list)
    next_restart_at: float = 0.0
    last_error: str = ""
    # While DRAINING: the restart that waits, and until when it may wait.
    drain_until: float = 0.0
    drain_reason: str = ""
    drain_counted: bool = False  # a repair (counts against max_restarts), not a definition change

    def on_started(self, now: float) -> None:
        self.state, self.started_at, self.failures = State.STARTING, now, 0

    def on_stopped(self) -> None:
        self.state, self.started_at, self.failures = State.STOPPED, None, 0

    def on_probe(self, ok: bool, now: float, monitor: MonitorSection, error: str = "") -> bool:
        """Record one probe; True when the instance should now be restarted."""
        if self.state in (State.FAILED, State.STOPPED, State.DRAINING):
            return False
        if ok:
            self.state, self.failures, self.last_error = State.HEALTHY, 0, ""
            return False
        self.last_error = error
        in_grace = self.state == State.STARTING and self.started_at is not None and now - self.started_at < monitor.startup_grace_s
        if in_grace:
            return False
        self.failures += 1
        self.state = State.UNHEALTHY
        return self.failures >= monitor.unhealthy_after

    def restart_decision(self, now: float, monitor: MonitorSection) -> RestartDecision:
        if self.state == State.FAILED:
            return RestartDecision.FAIL
        self.restart_times = [t for t in self.restart_times if now - t < monitor.restart_window_s]
        if len(self.restart_times) >= monitor.max_restarts:
            return RestartDecision.FAIL
        return RestartDecision.WAIT if now < self.next_restart_at else RestartDecision.RESTART

    def on_restart(self, now: float, monitor: MonitorSection) -> None:
        self.restart_times.append(now)
        self.restarts += 1
        # Exponential backoff from the second restart in the window on.
        self.next_restart_at = now + monitor.restart_backoff_s * 2 ** (len(self.restart_times) - 1)
        self.on_started(now)

    def on_drain(self, now: float, timeout_s: float, reason: str, counted: bool) -> None:
        self.state, self.drain_until, self.drain_reason, self.drain_counted = State.DRAINING, now + timeout_s, reason, counted

    def on_failed(self, reason: str) -> None:
        self.state, self.last_error = State.FAILED, reason
