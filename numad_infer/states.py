"""Instance states and the supervision rules that move between them. Pure: time is passed in."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from numad_infer.config import MonitorSection


class State(str, Enum):
    STARTING = "starting"  # started, model loading, within the grace period
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # probes failing, restart pending
    FAILED = "failed"  # too many restarts: left alone until a reload
    STOPPED = "stopped"


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

    def on_started(self, now: float) -> None:
        self.state, self.started_at, self.failures = State.STARTING, now, 0

    def on_stopped(self) -> None:
        self.state, self.started_at, self.failures = State.STOPPED, None, 0

    def on_probe(self, ok: bool, now: float, monitor: MonitorSection, error: str = "") -> bool:
        """Record one probe; True when the instance should now be restarted."""
        if self.state in (State.FAILED, State.STOPPED):
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

    def restart_decision(self, now: float, monitor: MonitorSection) -> str:
        """"restart", "wait" (backing off) or "fail" (budget exhausted)."""
        if self.state == State.FAILED:
            return "fail"
        self.restart_times = [t for t in self.restart_times if now - t < monitor.restart_window_s]
        if len(self.restart_times) >= monitor.max_restarts:
            return "fail"
        return "wait" if now < self.next_restart_at else "restart"

    def on_restart(self, now: float, monitor: MonitorSection) -> None:
        self.restart_times.append(now)
        self.restarts += 1
        # Exponential backoff from the second restart in the window on.
        self.next_restart_at = now + monitor.restart_backoff_s * 2 ** (len(self.restart_times) - 1)
        self.on_started(now)

    def on_failed(self, reason: str) -> None:
        self.state, self.last_error = State.FAILED, reason
