"""One reconcile pass: desired plan vs what runs, per instance, each isolated from the others.

`Reconciler` only coordinates; each job is a module of its own:

- rollout.py: `apply` brings the running set to a plan (start, adoption, one-at-a-time restarts);
- supervise.py: probe results and process changes -> restart, drain, hold, backoff, failed
  (the rules themselves are pure, in states.py);
- driftchecks.py: one class per drift kind, each with its own memory of the process;
- keycheck.py: does the process take the configured API key.

`Reconciler.monitor(now)` is one monitoring pass: it returns each instance's state after
the pass (empty when the instance states could not be read and nothing was acted on).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from numad_infer.backends.base import Backend, Observation
from numad_infer.config.schema import Config
from numad_infer.engines import Engine, EngineCounters
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.host.procfs import ProcReader
from numad_infer.lifecycle.states import State
from numad_infer.plan.model import PlanDiff
from numad_infer.supervision.drift_checks import CheckContext, run_checks
from numad_infer.supervision.health import ProbeResult, probe, read_engine_metrics
from numad_infer.supervision.instance import Runtime
from numad_infer.supervision.keycheck import check_api_key
from numad_infer.supervision.rollout import Rollout
from numad_infer.supervision.supervisor import Supervisor, isolated

__all__ = ["Reconciler", "Runtime"]

from numad_infer.validate.loaded import Loaded

log = logging.getLogger(__name__)


class Reconciler:
    def __init__(self, backend: Backend, proc: ProcReader | None = None, wall: Callable[[], float] = time.time,
                 frontdoor: Frontdoor | None = None) -> None:
        self.backend = backend
        self.frontdoor = frontdoor
        self.proc = proc or ProcReader()
        self.wall = wall
        self.config: Config | None = None
        self.runtimes: dict[str, Runtime] = {}
        self.holds: dict[str, str] = {}  # instance -> who holds it stopped (holds.py), from the daemon each pass
        self.api_key: str | None = None
        self.engine: Engine | None = None  # the applied one's (with `config`)
        self.supervisor = Supervisor(backend, self.proc, frontdoor, wall)
        self.rollout = Rollout(backend, frontdoor, self.supervisor)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="probe")

    def apply(self, loaded: Loaded, now: float) -> PlanDiff:
        """Bring the instances to `loaded`, the pipeline's value: its key and engine are the
        ones checked, not read or looked up again."""
        diff, specs = self.rollout.sync(loaded)
        self.api_key, self.engine = loaded.api_key, loaded.engine
        self.config = self.supervisor.config = loaded.config
        self.rollout.apply(loaded.plan, diff, specs, self.runtimes, self.holds, now,
                           loaded.config.frontend.drain_timeout_s)
        return diff

    def stop_all(self) -> None:
        # All at once: a stop then takes one instance's stop timeout, however many there are.
        leaving = list(self.rollout.retiring)
        self.rollout.retiring.clear()
        list(self._pool.map(lambda n: isolated(n, "stop", lambda: self.backend.stop(n)), [*self.runtimes, *leaving]))
        for rt in self.runtimes.values():
            rt.supervision.on_stopped()
            rt.pid = None

    def monitor(self, now: float) -> dict[str, State]:
        assert self.config is not None
        try:
            observed = self.backend.observe(list(self.runtimes))
        except Exception as exc:
            # Not knowing is not "not running": act on nothing this pass.
            log.error("cannot read instance states, skipping this pass: %s", exc)
            return {}
        if self.frontdoor is not None:
            self.frontdoor.observe()
        probes, counters = self._dispatch(observed)
        for name, rt in self.runtimes.items():
            try:
                if name in counters:
                    rt.on_counters(counters[name].result(), now)
                self._monitor_one(rt, observed[name], probes.get(name), now)
            except Exception:  # one instance's trouble never stops the others' monitoring
                log.exception("%s: monitoring failed", name)
            self.supervisor.rotate(rt)
        self.rollout.roll(self.runtimes, self.holds, now)
        self.rollout.retire(self.proc, now)
        return {name: rt.supervision.state for name, rt in self.runtimes.items()}

    def _dispatch(self, observed: dict[str, Observation]) -> tuple[dict[str, Future[ProbeResult]],
                                                                    dict[str, Future[EngineCounters | None]]]:
        """Every running instance probed (and its counters read) at once: a slow one holds up none."""
        cfg = self.config
        assert cfg is not None
        up = {name: (rt.instance.port, pid) for name, rt in self.runtimes.items() if (pid := observed[name].pid)}
        probes = {name: self._pool.submit(self._probe, port, pid) for name, (port, pid) in up.items()}
        reads_counters = self.engine is not None and self.engine.metrics_path is not None
        counters = {name: self._pool.submit(self._counters, port, pid) for name, (port, pid) in up.items()
                    if reads_counters}
        return probes, counters

    # Both ask first whether the port is the instance's: a process that took it while the
    # instance restarted must not be marked healthy (clients' keys would go to it) nor be
    # sent the API key.
    def _probe(self, port: int, pid: int) -> ProbeResult:
        cfg = self.config
        assert cfg is not None
        owner = self.proc.port_owner(cfg.server.host, port, pid)
        if not owner.ours:
            return ProbeResult(False, 0.0, owner.detail)
        assert self.engine is not None
        return probe(cfg.server.host, port, cfg.monitor.probe_timeout_s, self.engine.liveness_path)

    def _counters(self, port: int, pid: int) -> EngineCounters | None:
        cfg = self.config
        assert cfg is not None
        if not self.proc.port_owner(cfg.server.host, port, pid).ours:
            return None
        assert self.engine is not None
        return read_engine_metrics(self.engine, cfg.server.host, port, self.api_key, cfg.monitor.probe_timeout_s)

    def _monitor_one(self, rt: Runtime, seen: Observation, probed: Future[ProbeResult] | None, now: float) -> None:
        cfg = self.config
        assert cfg is not None
        if not self.supervisor.step(rt, seen, self.holds.get(rt.instance.name), probed, now):
            return
        assert seen.pid is not None
        if self.api_key is not None:
            check_api_key(rt, cfg, self.api_key, self.frontdoor, self.proc)
        ctx = CheckContext(rt.instance, seen.pid, now, self.wall, cfg.monitor, self.proc,
                           self.backend.instance_cgroups, rt)
        rt.drifting = run_checks(rt.checks, ctx)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
