"""One reconcile pass: desired plan vs what runs, per instance, each isolated from the others.

`Reconciler` only coordinates; each job is a module of its own:

- rollout.py: `apply` brings the running set to a plan (start, adoption, one-at-a-time restarts);
- supervisor.py: probe results and process changes -> restart, drain, hold, backoff, failed
  (the rules themselves are pure, in lifecycle/states.py);
- drift_checks.py: one class per drift kind, each with its own memory of the process;
- keycheck.py: does the process take the configured API key.

`Reconciler.apply(loaded)` holds the pipeline's value (validate/loaded.py) as the one
applied configuration, `self.loaded`; the supervisor and the rollout keep no copy of it or
of its parts: each call is handed it.

`Reconciler.monitor(now)` is one monitoring pass: it returns each instance's state after
the pass (empty when nothing is applied yet, or when the instance states could not be read
and nothing was acted on).

A pass has a deadline: every probe and counter read runs at once, each bounded by its own
deadline (health.py), and the pass waits for them until `probe_timeout_s` + PASS_SLACK_S;
a probe not in by then is a failed one, a counter read not in is no reading, and the pass
goes on. While it waits, and between instances, it calls `keepalive` (the daemon's
watchdog ping): the wait is bounded, so a ping there hides no hang.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from numad_infer.backends.base import Backend, Observation
from numad_infer.engines import EngineCounters
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.host.portowner import Listeners
from numad_infer.host.procfs import ProcReader
from numad_infer.lifecycle.states import State
from numad_infer.plan.model import PlanDiff
from numad_infer.supervision.drift_checks import CheckContext, HostPinner, Pinner, run_checks
from numad_infer.supervision.health import ProbeResult, probe, read_engine_metrics
from numad_infer.supervision.instance import Runtime
from numad_infer.supervision.keycheck import check_api_key
from numad_infer.supervision.rollout import Rollout
from numad_infer.supervision.supervisor import Supervisor, isolated
from numad_infer.validate.loaded import Loaded

__all__ = ["Reconciler", "Runtime"]

log = logging.getLogger(__name__)

# How long past `probe_timeout_s` a pass waits for its probes: each call ends by its own
# deadline, and this covers what comes before it (the port-owner read) and a thread that
# starts late on a loaded machine.
PASS_SLACK_S = 1.0
# The longest a pass waits without calling `keepalive`.
_KEEPALIVE_EVERY_S = 1.0

T = TypeVar("T")


class Reconciler:
    def __init__(self, backend: Backend, proc: ProcReader | None = None, wall: Callable[[], float] = time.time,
                 frontdoor: Frontdoor | None = None, keepalive: Callable[[], None] = lambda: None,
                 probe: Callable[[str, int, float, str], ProbeResult] = probe, pinner: Pinner | None = None) -> None:
        """`probe`: asks an instance whether it is alive (host, port, timeout, path); the
        real one (health.probe) unless a test stands in for the servers. `pinner`: the
        calls a repair makes (drift_checks.HostPinner unless a test stands in for them)."""
        self.pinner: Pinner = pinner or HostPinner()
        self.backend = backend
        self.liveness_probe = probe
        self.frontdoor = frontdoor
        self.proc = proc or ProcReader()
        self.wall = wall
        # The applied value (apply), the daemon's one configuration: what everything below
        # reads its settings, key, engine and model files from. None until a plan is applied.
        self.loaded: Loaded | None = None
        self.runtimes: dict[str, Runtime] = {}
        self.holds: dict[str, str] = {}  # instance -> who holds it stopped (holds.py), from the daemon each pass
        self.supervisor = Supervisor(backend, self.proc, frontdoor, wall, lambda *a: self.liveness_probe(*a))
        self.rollout = Rollout(backend, frontdoor, self.supervisor)
        self.keepalive = keepalive
        self._workers = 8
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="probe")

    def apply(self, loaded: Loaded, now: float, why: str = "definition changed") -> PlanDiff:
        """Bring the instances to `loaded`, the pipeline's value: its key and engine are the
        ones checked, not read or looked up again. `why`: what the restarts of changed
        instances say in the journal."""
        diff, specs = self.rollout.sync(loaded)  # raises before anything running was touched
        if self.supervisor.keeper is not None:
            self.supervisor.keeper.forget_all_but({i.name for i in loaded.plan.instances})
        self.rollout.apply(loaded, diff, specs, self.runtimes, self.holds, now, why)
        # The one place it is set: an apply that raised leaves the previous one applied, as
        # the daemon then says (daemon/desired.py), everywhere at once.
        self.loaded = loaded
        return diff

    def roll(self, now: float) -> None:
        """Go on with the rolling restart under way, if any (`numa-infer restart`'s first
        restart goes at once, not a pass later). Nothing applied: nothing runs to restart."""
        if self.loaded is not None:
            self.rollout.roll(self.loaded, self.runtimes, self.holds, now)

    def stop_all(self) -> None:
        # All at once: a stop then takes one instance's stop timeout, however many there are.
        leaving = list(self.rollout.retiring)
        self.rollout.retiring.clear()
        if self.supervisor.surges is not None:  # copies of a surge under way
            leaving += [s.copy.name for s in self.supervisor.surges.active.values()]
            self.supervisor.surges.active.clear()
        list(self._pool.map(lambda n: isolated(n, "stop", lambda: self.backend.stop(n)), [*self.runtimes, *leaving]))
        for rt in self.runtimes.values():
            rt.supervision.on_stopped()
            rt.pid = None

    def monitor(self, now: float) -> dict[str, State]:
        loaded = self.loaded
        if loaded is None:  # nothing applied: no instance to look at
            return {}
        try:
            observed = self.backend.observe(list(self.runtimes))
        except Exception as exc:
            # Not knowing is not "not running": act on nothing this pass.
            log.error("cannot read instance states, skipping this pass: %s", exc)
            return {}
        if self.frontdoor is not None:
            self.frontdoor.observe()  # bounded by the runtime API's deadline
            self.keepalive()
        limit = loaded.config.tuning.probe_timeout_s + PASS_SLACK_S
        deadline = time.monotonic() + limit
        probes, counters = self._dispatch(loaded, observed)
        self._await([*probes.values(), *counters.values()], deadline)
        late = ProbeResult(False, limit, f"probe did not finish within {limit:g}s")
        for name, rt in self.runtimes.items():
            try:
                if name in counters:
                    rt.on_counters(_outcome(counters[name], None), now)
                probed = _outcome(probes[name], late) if name in probes else None
                self._monitor_one(loaded, rt, observed[name], probed, now)
            except Exception:  # one instance's trouble never stops the others' monitoring
                log.exception("%s: monitoring failed", name)
            self.supervisor.rotate(rt)
            self.keepalive()
        self.supervisor.step_surges(loaded, self.runtimes, now)
        self.rollout.roll(loaded, self.runtimes, self.holds, now)
        self.rollout.retire(self.proc, now)
        return {name: rt.supervision.state for name, rt in self.runtimes.items()}

    def _dispatch(self, loaded: Loaded, observed: dict[str, Observation]) -> tuple[
            dict[str, Future[ProbeResult]], dict[str, Future[EngineCounters | None]]]:
        """Every running instance probed (and its counters read) at once: a slow one holds up none."""
        up = {name: (rt.instance.port, pid) for name, rt in self.runtimes.items() if (pid := observed[name].pid)}
        reads_counters = loaded.engine.metrics_path is not None
        pool = self._pool_for(len(up) * (2 if reads_counters else 1))
        table = self.proc.listeners() if up else None  # once for the pass (host/portowner.Listeners)
        probes = {name: pool.submit(self._probe, loaded, port, pid, table) for name, (port, pid) in up.items()}
        counters = {name: pool.submit(self._counters, loaded, port, pid, table) for name, (port, pid) in up.items()
                    if reads_counters}
        return probes, counters

    def _pool_for(self, calls: int) -> ThreadPoolExecutor:
        """A thread for every call of the pass: one queued behind a dripping peer would wait
        out that peer's deadline and miss the pass's own."""
        if calls > self._workers:
            self._pool.shutdown(wait=False)  # its threads end with their calls, each bounded
            self._workers = calls
            self._pool = ThreadPoolExecutor(max_workers=calls, thread_name_prefix="probe")
        return self._pool

    def _await(self, futures: Iterable[Future[Any]], deadline: float) -> None:
        """Until every call is in, or the pass's deadline: whatever the peers do."""
        pending = set(futures)
        while pending and (left := deadline - time.monotonic()) > 0:
            _, pending = wait(pending, timeout=min(left, _KEEPALIVE_EVERY_S))
            self.keepalive()
        for future in pending:
            future.cancel()  # one not started yet never starts; a running one ends by its deadline

    # Both ask first whether the port is the instance's: a process that took it while the
    # instance restarted must not be marked healthy (clients' keys would go to it) nor be
    # sent the API key.
    def _probe(self, loaded: Loaded, port: int, pid: int, table: Listeners | None) -> ProbeResult:
        cfg = loaded.config
        owner = self.proc.port_owner(cfg.server.host, port, pid, table)
        if not owner.ours:
            return ProbeResult(False, 0.0, owner.detail)
        return self.liveness_probe(cfg.server.host, port, cfg.tuning.probe_timeout_s, loaded.engine.liveness_path)

    def _counters(self, loaded: Loaded, port: int, pid: int, table: Listeners | None) -> EngineCounters | None:
        cfg = loaded.config
        if not self.proc.port_owner(cfg.server.host, port, pid, table).ours:
            return None
        return read_engine_metrics(loaded.engine, cfg.server.host, port, loaded.api_key, cfg.tuning.probe_timeout_s)

    def _monitor_one(self, loaded: Loaded, rt: Runtime, seen: Observation, probed: ProbeResult | None,
                     now: float) -> None:
        cfg = loaded.config
        if not self.supervisor.step(loaded, rt, seen, self.holds.get(rt.instance.name), probed, now):
            return
        assert seen.pid is not None  # a passed probe is of a running process
        if loaded.api_key is not None:
            check_api_key(rt, cfg, loaded.api_key, self.frontdoor, self.proc, loaded.engine.key_check_path)
        ctx = CheckContext(rt.instance, seen.pid, now, self.wall, cfg.monitor, self.proc,
                           self.backend.instance_cgroups, rt, self.pinner)
        rt.drifting = run_checks(rt.checks, ctx)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _outcome(future: Future[T], late: T) -> T:
    """The call's result (its exception raised), or `late` when it is not in yet."""
    return future.result() if future.done() and not future.cancelled() else late
