"""Instance states and the supervision rules that move between them. Pure: time is passed in."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `numa-infer status` reads states without loading pydantic
    from numad_infer.config import MonitorSection


class State(str, Enum):
    """An instance's lifecycle, after supervisor's (STARTING, BACKOFF, FATAL ...):

        STOPPED -> STARTING -> HEALTHY <-> UNHEALTHY
        UNHEALTHY / EXITED -> (BACKOFF ->) RESTARTING -> STARTING
        HEALTHY / UNHEALTHY -> DRAINING -> RESTARTING   (behind a front door)
        any -> FAILED (restart budget spent; a reload clears it)
        any -> (DRAINING ->) HELD -> STARTING   (a hold, taken and released by another process)
    """

    STARTING = "starting"  # started, model loading, within the grace period
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # probes failing, restart pending
    DRAINING = "draining"  # out of the front door, finishing its requests before a restart
    RESTARTING = "restarting"  # a restart was asked for: the next main PID is its result, not a crash
    EXITED = "exited"  # the main process is gone and nothing has replaced it yet
    BACKOFF = "backoff"  # waiting out restart_backoff_s before the next restart
    FAILED = "failed"  # too many restarts: left alone until a reload
    HELD = "held"  # stopped on request (holds.py: `numa-infer tune` measures its node)
    STOPPED = "stopped"
    UNSUPERVISED = "unsupervised"  # running, but no daemon watches it (status with the daemon down)


# States in which an instance is being (re)started: a rolling restart waits for them.
IN_TRANSITION = frozenset({State.STARTING, State.RESTARTING, State.DRAINING})


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
    drain_then_hold: bool = False  # the drain ends in a stop (a hold), not a restart

    def on_started(self, now: float) -> None:
        self.state, self.started_at, self.failures = State.STARTING, now, 0

    def on_stopped(self) -> None:
        self.state, self.started_at, self.failures = State.STOPPED, None, 0

    # -- the main process, as the backend reports it ----------------------------------------------
    def on_exit(self) -> None:
        """The main process is gone. During a restart (or a hold) that is the asker's doing."""
        if self.state not in (State.FAILED, State.STOPPED, State.RESTARTING, State.HELD):
            self.state = State.EXITED

    def on_new_pid(self, had_process: bool, now: float) -> bool:
        """A main PID not seen before (a restart's result, a crash's replacement, adoption).

        True when it replaces a process that died on its own and the service manager
        brought back (systemd's Restart=): that restart is counted, though not ours.
        """
        crashed = self.state != State.RESTARTING and (had_process or self.state == State.EXITED)
        if crashed:
            self.restarts += 1
        if self.state not in (State.FAILED, State.DRAINING):  # a drain still ends in its restart
            self.on_started(now)
        return crashed

    def on_probe(self, ok: bool, now: float, monitor: MonitorSection, error: str = "") -> bool:
        """Record one probe; True when the instance should now be restarted."""
        if self.state in (State.FAILED, State.STOPPED, State.DRAINING, State.EXITED, State.HELD):
            return False
        in_grace = (self.state in (State.STARTING, State.RESTARTING) and self.started_at is not None
                    and now - self.started_at < monitor.startup_grace_s)
        if self.state == State.RESTARTING and in_grace:
            return False  # the process probed is the one being replaced
        if ok:
            self.state, self.failures, self.last_error = State.HEALTHY, 0, ""
            return False
        self.last_error = error
        if in_grace:
            return False
        self.failures += 1
        if self.state != State.BACKOFF:
            self.state = State.UNHEALTHY
        return self.failures >= monitor.unhealthy_after

    def restart_decision(self, now: float, monitor: MonitorSection) -> RestartDecision:
        """May the instance be restarted now? Moves it to BACKOFF or FAILED when not."""
        if self.state == State.FAILED:
            return RestartDecision.FAIL
        self.restart_times = [t for t in self.restart_times if now - t < monitor.restart_window_s]
        if len(self.restart_times) >= monitor.max_restarts:
            return RestartDecision.FAIL
        if now < self.next_restart_at:
            self.state = State.BACKOFF
            return RestartDecision.WAIT
        return RestartDecision.RESTART

    def on_restart(self, now: float, monitor: MonitorSection | None) -> None:
        """A restart was asked for; `monitor` given: a repair, counted against the budget."""
        if monitor is not None:
            self.restart_times.append(now)
            self.restarts += 1
            # Exponential backoff from the second restart in the window on.
            self.next_restart_at = now + monitor.restart_backoff_s * 2 ** (len(self.restart_times) - 1)
        self.state, self.started_at, self.failures = State.RESTARTING, now, 0

    def on_drain(self, now: float, timeout_s: float, reason: str, counted: bool, then_hold: bool = False) -> None:
        self.state, self.drain_until, self.drain_reason, self.drain_counted = State.DRAINING, now + timeout_s, reason, counted
        self.drain_then_hold = then_hold

    def on_held(self, by: str) -> None:
        self.state, self.started_at, self.failures, self.last_error = State.HELD, None, 0, f"held by {by}"
        self.drain_then_hold = False

    def on_released(self, now: float) -> None:
        self.last_error = ""
        self.on_started(now)

    def on_failed(self, reason: str) -> None:
        self.state, self.last_error = State.FAILED, reason
