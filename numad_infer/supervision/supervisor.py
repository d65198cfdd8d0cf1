"""Supervision: what the monitor saw of one instance -> the lifecycle's next step, acted on.

The rules (which step comes first, when a drain is over) are pure, in states.py; this
module carries them out against the backend and the front door: restart, drain, hold,
backoff, failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from numad_infer.backends.base import Backend, Observation
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.frontdoor.haproxy import AdminState
from numad_infer.host.procfs import ProcReader
from numad_infer.lifecycle.drift import EventKind
from numad_infer.lifecycle.states import RestartDecision, Seen, State, Step, drain_first, drain_over, next_step
from numad_infer.supervision.health import ProbeResult, probe
from numad_infer.supervision.instance import Runtime
from numad_infer.supervision.slot_keeper import SlotKeeper
from numad_infer.supervision.surge import Surges
from numad_infer.validate.loaded import Loaded

log = logging.getLogger(__name__)

# Requests in flight and no CPU used for this long: the generation is wedged, not slow.
STALL_AFTER_S = 30.0

T = TypeVar("T")


def isolated(name: str, action: str, call: Callable[[], T]) -> T | None:
    try:
        return call()
    except Exception as exc:  # one unit's failure is logged; the others go on
        log.error("%s: %s failed: %s", name, action, exc)
        return None


def judge_probe(result: ProbeResult, stalled_since: float | None, now: float) -> ProbeResult:
    """The event loop may answer while the generation thread is wedged: requests in flight
    and no CPU used for STALL_AFTER_S is a failed probe, whatever the probe said."""
    if result.ok and stalled_since is not None and now - stalled_since >= STALL_AFTER_S:
        return ProbeResult(False, result.latency_s, f"stalled: requests in flight and no CPU used for "
                                                    f"{now - stalled_since:.0f}s")
    return result


class Supervisor:
    """Holds no configuration of its own: every step is handed the applied `Loaded` (the
    one Reconciler.apply took), and reads the settings, key and model files from it."""

    def __init__(self, backend: Backend, proc: ProcReader, frontdoor: Frontdoor | None,
                 wall: Callable[[], float], probe: Callable[[str, int, float, str], ProbeResult] = probe) -> None:
        self.backend, self.proc, self.frontdoor, self.wall = backend, proc, frontdoor, wall
        # Copies started for a restart of a model's only instance in rotation (surge.py).
        self.surges = Surges(backend, frontdoor, proc, probe) if frontdoor is not None else None
        # Prompt caches kept across the restarts made here, where the backend gives the
        # engine a directory for them (slot_keeper.py); with the applied key and model files.
        self.keeper = SlotKeeper(backend.slots_dir, "127.0.0.1") if backend.slots_dir is not None else None

    def step(self, loaded: Loaded, rt: Runtime, seen: Observation, held_by: str | None, probed: ProbeResult | None,
             now: float) -> bool:
        """One pass for one instance, under `loaded` (the applied value). True when its probe
        passed judgement (it is up and not being restarted): then its process is the caller's
        to check for drift. `probed`: this pass's probe (None: not probed), already in or
        already given up on."""
        self._follow_pid(rt, seen.pid, now)
        step = next_step(rt.supervision, Seen(held_by, seen.pid is not None, seen.pending))
        if step == Step.RESUME:
            log.info("%s: the hold was released before the drain ended: back in service", rt.instance.name)
            rt.supervision.on_hold_dropped(now)
            step = next_step(rt.supervision, Seen(held_by, seen.pid is not None, seen.pending))
        if step in (Step.DRAIN, Step.PROBE) and seen.pid is not None:
            self._track_progress(rt, seen.pid, now)
        if step == Step.KEEP_HELD and seen.pid is not None:  # started by someone else meanwhile: stop it again
            isolated(rt.instance.name, "stop", lambda: self.backend.stop(rt.instance.name))
        elif step == Step.HOLD:
            assert held_by is not None
            self._hold(loaded, rt, seen.pid, now, held_by)
        elif step == Step.RELEASE:
            log.info("%s: released: starting it again", rt.instance.name)
            isolated(rt.instance.name, "start", lambda: self.backend.start(rt.instance))
            rt.supervision.on_released(now)
        elif step == Step.RESTART_GONE:
            self._maybe_restart(loaded, rt, now, f"not running ({seen.description})")
        elif step == Step.DRAIN:
            self._continue_drain(loaded, rt, now)
        elif step == Step.PROBE:
            return self._probe(loaded, rt, probed, now)
        return False

    def _follow_pid(self, rt: Runtime, pid: int | None, now: float) -> None:
        """A main PID other than the last one seen: the process exited, or another replaced it."""
        if pid == rt.pid:
            return
        sup = rt.supervision
        if pid is None:
            if sup.state not in (State.RESTARTING, State.HELD, State.STOPPED):  # not stopped on purpose
                rt.record_drift(EventKind.EXIT, f"main process {rt.pid} is gone", self.wall())
            sup.on_exit()
        else:
            exited = rt.pid or "that exited"
            if sup.on_new_pid(rt.pid is not None, now):
                # Nobody here restarted it: it died and systemd (Restart=) brought it back.
                rt.record_drift(EventKind.EXIT, f"main process {exited} replaced by {pid}", self.wall())
        rt.new_process(pid)

    def _probe(self, loaded: Loaded, rt: Runtime, probed: ProbeResult | None, now: float) -> bool:
        sup = rt.supervision
        result = probed if probed is not None else ProbeResult(False, 0.0, "not probed")
        result = rt.last_probe = judge_probe(result, rt.cpu.stalled_since, now)
        was = sup.state
        if sup.on_probe(result.ok, now, loaded.config.monitor, result.error):
            self._maybe_restart(loaded, rt, now, f"{sup.failures} failed probes: {result.error}")
            return False
        if was != State.HEALTHY and sup.state == State.HEALTHY:
            self._healthy_again(loaded, rt)  # before this pass puts it back in rotation (rotate)
        return True

    # -- prompt caches kept across a restart (slot_keeper.py) ----------------------------------------
    def _keeps_slots(self, loaded: Loaded, name: str) -> SlotKeeper | None:
        if not loaded.keeps_slots(name):
            return None  # numa-infer gave it no --slot-save-path: nothing of its to save or restore
        if self.keeper is not None:
            self.keeper.host = loaded.config.server.host
        return self.keeper

    def _healthy_again(self, loaded: Loaded, rt: Runtime) -> None:
        keeper, path = self._keeps_slots(loaded, rt.instance.name), _model_path(loaded, rt.instance.model)
        if keeper is not None and path is not None:
            # Out of rotation until this returns: never longer than a drain may take.
            timeout_s, inst, key = loaded.config.frontend.drain_timeout_s, rt.instance, loaded.api_key
            isolated(inst.name, "restore of its prompt cache",
                     lambda: keeper.after_start(inst.name, inst.port, key, path, timeout_s))

    def _save_slots(self, loaded: Loaded, rt: Runtime) -> None:
        keeper, path = self._keeps_slots(loaded, rt.instance.name), _model_path(loaded, rt.instance.model)
        answers = rt.pid is not None and rt.last_probe is not None and rt.last_probe.ok  # a hung one cannot save
        if keeper is not None and path is not None and answers:
            timeout_s, inst, key = loaded.config.frontend.drain_timeout_s, rt.instance, loaded.api_key
            isolated(inst.name, "save of its prompt cache",
                     lambda: keeper.before_restart(inst.name, inst.port, key, path, timeout_s))

    def _maybe_restart(self, loaded: Loaded, rt: Runtime, now: float, reason: str) -> None:
        cfg = loaded.config
        sup = rt.supervision
        decision = sup.restart_decision(now, cfg.monitor)
        if decision == RestartDecision.FAIL:
            if sup.state != State.FAILED:
                sup.on_failed(f"{cfg.monitor.max_restarts} restarts within {cfg.monitor.restart_window_s:g}s; "
                              f"last: {reason}")
                log.error("%s: marked failed after %d restarts within %gs (%s); left alone until a reload",
                          rt.instance.name, cfg.monitor.max_restarts, cfg.monitor.restart_window_s, reason)
            return
        if decision == RestartDecision.RESTART:
            self.restart(loaded, rt, now, reason, counted=True)

    # -- restarts and holds, drained out of the front door first ------------------------------------
    def restart(self, loaded: Loaded, rt: Runtime, now: float, reason: str, counted: bool,
                covered: bool = False) -> None:
        """Restart one instance; with requests in flight at the front door, drain it first.

        `counted`: a repair, which counts against monitor.max_restarts (a definition
        change does not). `covered`: its surge's copy serves now (surge.py): go on.
        """
        if not covered and self.surges is not None and self.surges.first(loaded, rt, now, reason, counted):
            return
        timeout_s = loaded.config.frontend.drain_timeout_s
        busy = self.frontdoor.in_flight(rt.instance) if self.frontdoor is not None else None
        serving = rt.supervision.state == State.HEALTHY
        if self.frontdoor is not None and drain_first(busy, timeout_s, counted, rt.cpu.progress, serving):
            self.frontdoor.set_state(rt.instance, AdminState.DRAIN)
            rt.supervision.on_drain(now, timeout_s, reason, counted)  # -> DRAINING
            log.info("%s: %s: draining before the restart (%d request(s) in flight at the last pass; at most %gs)",
                     rt.instance.name, reason, busy, timeout_s)
            return
        self._restart_now(loaded, rt, now, reason, counted)

    def step_surges(self, loaded: Loaded, runtimes: dict[str, Runtime], now: float) -> None:
        """Each surge under way one step on; the restarts whose copy now serves go."""
        if self.surges is None:
            return
        for name, reason in self.surges.step(loaded, runtimes, now):
            self.restart(loaded, runtimes[name], now, reason, counted=False, covered=True)

    def _hold(self, loaded: Loaded, rt: Runtime, pid: int | None, now: float, by: str) -> None:
        """Held by another process: out of the front door (drained first, as for a restart),
        then stopped until the hold is released."""
        timeout_s = loaded.config.frontend.drain_timeout_s
        busy = self.frontdoor.in_flight(rt.instance) if self.frontdoor is not None and pid is not None else None
        if self.frontdoor is not None and drain_first(busy, timeout_s, serving=rt.supervision.state == State.HEALTHY):
            self.frontdoor.set_state(rt.instance, AdminState.DRAIN)
            rt.supervision.on_drain(now, timeout_s, f"held by {by}", counted=False, hold_by=by)  # -> DRAINING
            log.info("%s: held by %s: draining %d request(s) first (at most %gs)", rt.instance.name, by, busy,
                     timeout_s)
            return
        self._stop_held(rt, by)

    def _stop_held(self, rt: Runtime, by: str) -> None:
        if self.frontdoor is not None:
            self.frontdoor.set_state(rt.instance, AdminState.MAINT)
        log.info("%s: held by %s: stopping it until the hold is released", rt.instance.name, by)
        isolated(rt.instance.name, "stop", lambda: self.backend.stop(rt.instance.name))
        rt.supervision.on_held(by)  # -> HELD

    def _continue_drain(self, loaded: Loaded, rt: Runtime, now: float) -> None:
        drain = rt.supervision.drain
        assert drain is not None
        left = self.frontdoor.in_flight(rt.instance) if self.frontdoor is not None else None
        why = drain_over(drain, left, now, rt.cpu.progress)
        if why is None:
            return
        if drain.hold_by is not None:
            log.info("%s: %s", rt.instance.name, why)
            self._stop_held(rt, drain.hold_by)  # DRAINING -> HELD
            return
        log.info("%s: %s: restarting", rt.instance.name, why)
        self._restart_now(loaded, rt, now, drain.reason, drain.counted)  # DRAINING -> RESTARTING

    def _restart_now(self, loaded: Loaded, rt: Runtime, now: float, reason: str, counted: bool) -> None:
        if self.frontdoor is not None:
            self.frontdoor.set_state(rt.instance, AdminState.MAINT)
        if counted:
            log.warning("%s: %s: restarting", rt.instance.name, reason)
            rt.record_repair(EventKind.HEALTH, f"restarted: {reason}", self.wall())
        self._save_slots(loaded, rt)
        isolated(rt.instance.name, "restart", lambda: self.backend.restart(rt.instance))
        rt.supervision.on_restart(now, loaded.config.monitor if counted else None, reason)  # -> RESTARTING
        rt.new_process(rt.pid)

    def _track_progress(self, rt: Runtime, pid: int, now: float) -> None:
        busy = self.frontdoor.in_flight(rt.instance) if self.frontdoor is not None else None
        rt.cpu.update(self.proc.cpu_seconds(pid), busy, now)

    def rotate(self, rt: Runtime) -> None:
        """In the front door only while healthy; draining while a restart waits for it."""
        if self.frontdoor is None:
            return
        state = rt.supervision.state
        wanted = (AdminState.READY if state == State.HEALTHY
                  else AdminState.DRAIN if state == State.DRAINING else AdminState.MAINT)
        self.frontdoor.set_state(rt.instance, wanted)


def _model_path(loaded: Loaded, ident: str) -> str | None:
    """The model file an instance (by `Instance.model`) loads, as the applied value says; None
    for a model it does not serve."""
    try:
        return loaded.model(ident).served.view.model.path
    except KeyError:
        return None
