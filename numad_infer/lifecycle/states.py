"""Instance states, the moves between them, and the supervision rules.

Pure: time is passed in, and what the monitor saw arrives as a `Seen` record. Every
state change goes through `Supervision.change_state`, which refuses a move that
`ENTERED_FROM` does not list (supervisor's `_assertInState`, as one table) and logs the
others once (instance, from, to, why); each call site names its move in a `# FROM -> TO`
comment. What to do with an instance in a pass, given its state and
what was seen, is `next_step`: the priority rules (held, released, failed, not running,
draining, probe), testable without a backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `numa-infer status` reads states without loading pydantic
    from numad_infer.config.schema import MonitorSection

from numad_infer.errors import NumaInferError

log = logging.getLogger(__name__)


class State(str, Enum):
    """An instance's lifecycle, after supervisor's (STARTING, BACKOFF, FATAL ...):

        STOPPED -> STARTING -> HEALTHY <-> UNHEALTHY
        UNHEALTHY / EXITED -> (BACKOFF ->) RESTARTING -> STARTING
        HEALTHY / UNHEALTHY -> DRAINING -> RESTARTING   (behind a front door)
        any -> FAILED (restart budget spent; a reload clears it: FAILED -> STOPPED)
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


_SUPERVISED = frozenset(State) - {State.UNSUPERVISED}  # UNSUPERVISED is status's word, never a move's

# Each state and the states it may be entered from; staying in a state is always allowed.
# "Any" is any supervised state: the asker (a restart, a hold, a stop, the budget) decides
# whatever the instance was doing. The guards in `Supervision`'s methods keep to this table,
# and tests/lifecycle/test_states.py walks it.
ENTERED_FROM: dict[State, frozenset[State]] = {
    # a start, an adoption, a new main PID, a release, a hold dropped mid-drain; never out
    # of FAILED (only a reload clears it, through STOPPED)
    State.STARTING: _SUPERVISED - {State.FAILED},
    # a probe answered: only a process that is up and not being drained or held
    State.HEALTHY: frozenset({State.STARTING, State.RESTARTING, State.UNHEALTHY, State.BACKOFF}),
    # a probe failed after the grace period (in BACKOFF the instance stays there)
    State.UNHEALTHY: frozenset({State.STARTING, State.RESTARTING, State.HEALTHY}),
    # out of the front door before a restart or a hold; a held instance is stopped already
    State.DRAINING: _SUPERVISED - {State.HELD},
    State.RESTARTING: _SUPERVISED,
    # the main process went away on its own: not while stopped, held, failed or restarting
    State.EXITED: frozenset({State.STARTING, State.HEALTHY, State.UNHEALTHY, State.DRAINING, State.BACKOFF}),
    # a restart is due but backed off: not for a held or failed instance
    State.BACKOFF: _SUPERVISED - {State.FAILED, State.HELD},
    State.FAILED: _SUPERVISED,
    State.HELD: _SUPERVISED,
    State.STOPPED: _SUPERVISED,
    State.UNSUPERVISED: frozenset(),
}


class TransitionError(NumaInferError):
    """A move `ENTERED_FROM` does not list: a bug in the caller, refused before it happens.
    The reconcile pass logs it for that instance and goes on with the others."""


def is_legal(current: State, to: State) -> bool:
    return (current == to and current != State.UNSUPERVISED) or current in ENTERED_FROM[to]


# States in which an instance is being (re)started: a rolling restart waits for them.
IN_TRANSITION = frozenset({State.STARTING, State.RESTARTING, State.DRAINING})


class RestartDecision(Enum):
    RESTART = "restart"
    WAIT = "wait"  # backing off
    FAIL = "fail"  # restart budget exhausted


@dataclass(frozen=True)
class Drain:
    """A drain under way: what ends it, and until when it may wait for the requests."""

    until: float
    reason: str
    counted: bool  # a repair (counts against max_restarts), not a definition change
    hold_by: str | None = None  # set: the drain ends in a stop for this holder, not a restart


@dataclass
class Supervision:
    """Health bookkeeping for one instance, after supervisor's process state machine."""

    name: str = ""  # the instance, for the transition log
    state: State = State.STOPPED
    started_at: float | None = None
    failures: int = 0  # consecutive failed probes after the grace period
    restarts: int = 0  # total, for status
    restart_times: list[float] = field(default_factory=list)
    next_restart_at: float = 0.0
    last_error: str = ""
    drain: Drain | None = None  # only while DRAINING
    held_by: str | None = None  # only while HELD

    def change_state(self, to: State, why: str) -> None:
        """The one place a state changes: refused when the table forbids it (TransitionError,
        nothing changed), else logged once, with the reason."""
        if not is_legal(self.state, to):
            raise TransitionError(f"{self.name or 'instance'}: {self.state.value} -> {to.value} is not a legal move "
                                  f"({why}); left {self.state.value}")
        if to != self.state:
            log.info("%s: %s -> %s (%s)", self.name or "instance", self.state.value, to.value, why)
        self.state = to
        if to != State.DRAINING:
            self.drain = None
        if to != State.HELD:
            self.held_by = None

    def on_started(self, now: float, why: str = "started") -> None:
        self.change_state(State.STARTING, why)  # any -> STARTING
        self.started_at, self.failures = now, 0

    def on_stopped(self) -> None:
        self.change_state(State.STOPPED, "stopped")  # any -> STOPPED
        self.started_at, self.failures = None, 0

    def on_reload(self) -> None:
        """A reload clears FAILED: the instance gets a fresh restart budget (its count stays)."""
        if self.state != State.FAILED:
            return
        self.change_state(State.STOPPED, "a reload clears failed")  # FAILED -> STOPPED
        self.started_at, self.failures, self.last_error = None, 0, ""
        self.restart_times, self.next_restart_at = [], 0.0

    # -- the main process, as the backend reports it ----------------------------------------------
    def on_exit(self) -> None:
        """The main process is gone. During a restart (or a hold) that is the asker's doing."""
        if self.state not in (State.FAILED, State.STOPPED, State.RESTARTING, State.HELD):
            self.change_state(State.EXITED, "main process gone")  # any running -> EXITED

    def on_new_pid(self, had_process: bool, now: float) -> bool:
        """A main PID not seen before (a restart's result, a crash's replacement, adoption).

        True when it replaces a process that died on its own and the service manager
        brought back (systemd's Restart=): that restart is counted, though not ours.
        """
        crashed = self.state != State.RESTARTING and (had_process or self.state == State.EXITED)
        if crashed:
            self.restarts += 1
        if self.state not in (State.FAILED, State.DRAINING):  # a drain still ends in its restart
            self.on_started(now, "new main process")  # RESTARTING / EXITED / ... -> STARTING
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
            self.change_state(State.HEALTHY, "probe answered")  # STARTING / UNHEALTHY / BACKOFF -> HEALTHY
            self.failures, self.last_error = 0, ""
            return False
        self.last_error = error
        if in_grace:
            return False
        self.failures += 1
        if self.state != State.BACKOFF:
            self.change_state(State.UNHEALTHY, f"probe failed: {error}")  # STARTING / HEALTHY -> UNHEALTHY
        return self.failures >= monitor.unhealthy_after

    def restart_decision(self, now: float, monitor: MonitorSection) -> RestartDecision:
        """May the instance be restarted now? Moves it to BACKOFF when not yet."""
        if self.state == State.FAILED:
            return RestartDecision.FAIL
        self.restart_times = [t for t in self.restart_times if now - t < monitor.restart_window_s]
        if len(self.restart_times) >= monitor.max_restarts:
            return RestartDecision.FAIL
        if now < self.next_restart_at:
            # UNHEALTHY / EXITED -> BACKOFF
            # A wait, not a moment on the monotonic clock (seconds since boot, meaningless in a log).
            self.change_state(State.BACKOFF, f"next restart in {self.next_restart_at - now:.1f} s")
            return RestartDecision.WAIT
        return RestartDecision.RESTART

    def on_restart(self, now: float, monitor: MonitorSection | None, why: str = "restart") -> None:
        """A restart was asked for; `monitor` given: a repair, counted against the budget."""
        if monitor is not None:
            self.restart_times.append(now)
            self.restarts += 1
            # Exponential backoff from the second restart in the window on.
            self.next_restart_at = now + monitor.restart_backoff_s * 2 ** (len(self.restart_times) - 1)
        self.change_state(State.RESTARTING, why)  # any -> RESTARTING
        self.started_at, self.failures = now, 0

    def on_drain(self, now: float, timeout_s: float, reason: str, counted: bool, hold_by: str | None = None) -> None:
        self.change_state(State.DRAINING, reason)  # HEALTHY / UNHEALTHY -> DRAINING
        self.drain = Drain(now + timeout_s, reason, counted, hold_by)

    def on_held(self, by: str) -> None:
        self.change_state(State.HELD, f"held by {by}")  # any -> HELD
        self.started_at, self.failures, self.last_error, self.held_by = None, 0, f"held by {by}", by

    def on_released(self, now: float) -> None:
        self.last_error = ""
        self.on_started(now, "hold released")  # HELD -> STARTING

    def on_hold_dropped(self, now: float) -> None:
        """The hold went away before its drain ended: back in service, no stop."""
        self.on_started(now, "hold released before the drain ended")  # DRAINING -> STARTING

    def on_failed(self, reason: str) -> None:
        self.change_state(State.FAILED, reason)  # any -> FAILED
        self.last_error = reason


# -- what to do with an instance this pass: the priority rules, pure ----------------------------------

@dataclass(frozen=True)
class Seen:
    """What the monitor saw of one instance this pass (after its main PID was accounted for)."""

    held_by: str | None  # another process holds it stopped (holds.py)
    running: bool  # a main process is there
    pending: bool  # none yet, but the service manager is bringing one up


class Step(Enum):
    KEEP_HELD = "keep held"  # held and stopped: stop it again if someone started it
    HOLD = "hold"  # newly held: drain it (busy) or stop it
    DRAIN = "drain"  # a drain is under way (to a restart or to a hold): see if it is over
    RELEASE = "release"  # was held, is not any more: start it
    RESUME = "resume"  # the hold went away during its drain: back in service, then decide again
    LEAVE = "leave"  # failed: left alone until a reload
    WAIT = "wait"  # not running yet, but coming up: nothing to judge
    RESTART_GONE = "restart gone"  # not running and nothing is bringing it up
    PROBE = "probe"  # running: judge its probe, then check it for drift


def next_step(sup: Supervision, seen: Seen) -> Step:
    """The first rule that applies wins: a hold outranks everything, FAILED outranks the process."""
    drain_to_hold = sup.state == State.DRAINING and sup.drain is not None and sup.drain.hold_by is not None
    if seen.held_by is not None:
        if sup.state == State.HELD:
            return Step.KEEP_HELD
        return Step.DRAIN if drain_to_hold else Step.HOLD
    if sup.state == State.HELD:
        return Step.RELEASE
    if drain_to_hold:
        return Step.RESUME
    if sup.state == State.FAILED:
        return Step.LEAVE
    if not seen.running:
        return Step.WAIT if seen.pending else Step.RESTART_GONE
    if sup.state == State.DRAINING:
        return Step.DRAIN
    return Step.PROBE


def drain_first(busy: int | None, drain_timeout_s: float, counted: bool = False, progress: bool | None = None,
                serving: bool = False) -> bool:
    """Wait for requests in flight before stopping? Not for a repair of a process that makes
    no progress: a stopped or wedged one would never finish what it has.

    `busy` is the count HAProxy gave at the last pass, up to a pass old: a request sent
    since would be cut by a restart made on a 0. So an instance still `serving` (in rotation)
    is drained even then; the next pass, with it out of rotation, reads the count that
    holds (a `numa-infer restart` in the VM cut one request this way: 502)."""
    worth_waiting = not counted or progress is True
    return (bool(busy) or (serving and busy is not None)) and worth_waiting and drain_timeout_s > 0


def drain_over(drain: Drain, left: int | None, now: float, progress: bool | None) -> str | None:
    """Why the drain ends now, or None while it should go on waiting."""
    if left and now < drain.until and (progress is not False or not drain.counted):
        return None
    if not left:
        return "drained"
    if now >= drain.until:
        return f"{left} request(s) still running at the drain deadline"
    return f"{left} request(s) in flight but no progress"
