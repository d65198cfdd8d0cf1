"""One reconcile pass: desired plan vs what runs, per instance, each isolated from the others.

`Reconciler.apply(config, plan)` brings the running set to a plan (start, reload,
adoption); `Reconciler.monitor(now)` is one monitoring pass: health, affinity drift,
memory drift, restarts. Both log what they found and what they did, and return it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from numad_infer import drift, pinning
from numad_infer.drift import EventKind
from numad_infer.engines import engine_of
from numad_infer.backends import Backend, Observation
from numad_infer.config import Config
from numad_infer.cpuset import format_list
from numad_infer.frontdoor import Frontdoor
from numad_infer.haproxy import AdminState
from numad_infer.apikey import read_api_key
from numad_infer.health import EngineCounters, KeyCheck, ProbeResult, check_key, probe, read_engine_metrics
from numad_infer.planner import Instance, Plan, PlanDiff, Policy, diff_plans
from numad_infer.procfs import ProcReader
from numad_infer.states import IN_TRANSITION, RestartDecision, State, Supervision
from numad_infer.status import Event

log = logging.getLogger(__name__)


# CPU seconds a generating server uses per pass at the very least (one token takes more).
PROGRESS_CPU_S = 0.01
# Requests in flight and no CPU used for this long: the generation is wedged, not slow.
STALL_AFTER_S = 30.0

@dataclass
class Runtime:
    instance: Instance
    supervision: Supervision = field(default_factory=Supervision)
    pid: int | None = None
    good_masks: dict[int, frozenset[int]] = field(default_factory=dict)
    memory: drift.MemoryVerdict | None = None
    memory_checked_at: float = 0.0
    last_probe: ProbeResult | None = None
    last_drift: Event | None = None
    last_repair: Event | None = None
    drift_counts: dict[str, int] = field(default_factory=dict)
    repair_counts: dict[str, int] = field(default_factory=dict)
    # Measurements of the current process (its lifecycle is `supervision.state`):
    drifting: bool = False
    migrated_from: int | None = None  # remote anonymous bytes before our last migrate_pages
    cpu_seen: float | None = None  # the process's CPU seconds at the last pass
    progress: bool | None = None  # did it use CPU since the last pass (None: not known yet)
    stalled_since: float | None = None  # requests in flight and no CPU used since then
    key_check: KeyCheck = KeyCheck.UNKNOWN  # does this process take server.api_key_file's key
    # Engines with counters of their own (llama-server): the last reading, and the decode
    # rate between the last two (tokens generated per second of wall time, all slots).
    counters: EngineCounters | None = None
    counters_at: float = 0.0
    decode_tokens_per_s: float | None = None

    def new_process(self, pid: int | None) -> None:
        """Forget everything measured on the previous process (a restart, a crash, adoption)."""
        self.pid, self.good_masks, self.memory, self.memory_checked_at = pid, {}, None, 0.0
        self.migrated_from, self.cpu_seen, self.progress, self.stalled_since = None, None, None, None
        self.key_check = KeyCheck.UNKNOWN
        self.counters, self.counters_at, self.decode_tokens_per_s = None, 0.0, None

    def on_counters(self, counters: EngineCounters | None, now: float) -> None:
        if counters is None:
            self.decode_tokens_per_s = None
            return
        previous, previous_at = self.counters, self.counters_at
        if previous is not None and now > previous_at and counters.tokens_predicted >= previous.tokens_predicted:
            self.decode_tokens_per_s = (counters.tokens_predicted - previous.tokens_predicted) / (now - previous_at)
        self.counters, self.counters_at = counters, now


class Reconciler:
    def __init__(self, backend: Backend, proc: ProcReader | None = None, wall=time.time,
                 frontdoor: Frontdoor | None = None) -> None:
        self.backend = backend
        self.frontdoor = frontdoor
        self.proc = proc or ProcReader()
        self.wall = wall
        self.config: Config | None = None
        self.plan: Plan | None = None
        self.specs: dict[str, str] = {}
        self.runtimes: dict[str, Runtime] = {}
        self.rolling: list[str] = []  # definition changed, restart still to come (one at a time)
        self.rolled: list[str] = []  # restarted by the current rollout: must be healthy before the next
        self._rollout_stopped = False  # said so in the journal once
        self.holds: dict[str, str] = {}  # instance -> who holds it stopped (holds.py), from the daemon each pass
        self.api_key: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="probe")

    # -- applying a plan --------------------------------------------------------------------
    def apply(self, config: Config, plan: Plan, now: float) -> PlanDiff:
        new_specs = self.backend.specs(config, plan)
        old_specs = self.specs if self.plan is not None else self.backend.current_specs(config)
        diff = diff_plans(old_specs, new_specs)
        # Definitions first: if they cannot be written (or systemd cannot reload them),
        # this raises before anything running was touched, and the old plan stays whole.
        self.backend.sync(config, plan)
        self.api_key = read_api_key(config, "server.api_key_file")
        for name in diff.removed:
            self._isolated(name, "stop", lambda n=name: self.backend.stop(n))
            self.runtimes.pop(name, None)
        self.config, self.plan, self.specs = config, plan, new_specs
        try:
            running = {name: seen.pid for name, seen in self.backend.observe([i.name for i in plan.instances]).items()}
        except Exception as exc:  # unknown: start (a no-op on a running unit); monitoring adopts the PID later
            log.error("cannot read instance states before starting them: %s", exc)
            running = {}
        for instance in plan.instances:
            runtime = self.runtimes.get(instance.name)
            if runtime is None or instance.name in diff.changed:
                # Same process until the restart below (or the drain before it) replaces it.
                runtime = self.runtimes[instance.name] = Runtime(
                    instance, supervision=runtime.supervision if runtime else Supervision(),
                    pid=runtime.pid if runtime else None)
            runtime.instance = instance
            if runtime.supervision.state == State.FAILED:
                runtime.supervision = Supervision(restarts=runtime.supervision.restarts)  # a reload clears FAILED
            if instance.name in diff.changed:
                if instance.name not in self.rolling:
                    self.rolling.append(instance.name)
            elif instance.name in self.holds:
                pass  # stays stopped until released (monitor starts it then)
            else:
                already = running.get(instance.name)
                self._isolated(instance.name, "start", lambda i=instance: self.backend.start(i))
                if already is not None:
                    if runtime.pid is None:
                        log.info("%s: adopted running pid %d", instance.name, already)
                    runtime.pid = already
                    if runtime.supervision.state == State.STOPPED:
                        # Adopted: give it the grace period, the first good probe makes it healthy.
                        runtime.supervision.on_started(now)
                elif runtime.supervision.state in (State.STOPPED, State.FAILED):
                    runtime.supervision.on_started(now)
        self.rolling = [name for name in self.rolling if name in self.runtimes]
        if diff.changed:  # a new rollout; one still under way continues with the new definition
            self.rolled, self._rollout_stopped = [], False
        self._roll(now)
        return diff

    def _roll(self, now: float) -> None:
        """Restart instances whose definition changed: behind a front door one at a time, so
        the others keep serving; without one, all at once (nothing routes around them).

        The next one goes only once every instance restarted so far is healthy on the new
        definition: one that does not come up (a bad extra_args, a model the engine cannot
        load) stops the rollout there, with the others still serving on the old one.
        """
        while self.rolling:
            if self.frontdoor is not None and self.frontdoor.listen:
                if any(rt.supervision.state in IN_TRANSITION for rt in self.runtimes.values()):
                    return
                stuck = [n for n in self.rolled if n in self.runtimes
                         and self.runtimes[n].supervision.state != State.HEALTHY]
                if stuck:
                    if not self._rollout_stopped:
                        log.error("rolling restart stopped: %s not healthy on the new definition; %s keep the old one "
                                  "until it is (or until a reload fixes the configuration)", ", ".join(stuck),
                                  ", ".join(self.rolling))
                        self._rollout_stopped = True
                    return
            if self.rolling[0] in self.holds:
                return  # held: its restart waits for the release (it starts on the new definition then)
            name = self.rolling.pop(0)
            self.rolled.append(name)
            log.info("%s: definition changed: restarting", name)
            self._restart(self.runtimes[name], now, "definition changed", counted=False)

    def stop_all(self) -> None:
        for name in list(self.runtimes):
            self._isolated(name, "stop", lambda n=name: self.backend.stop(n))
            self.runtimes[name].supervision.on_stopped()
            self.runtimes[name].pid = None

    # -- monitoring -----------------------------------------------------------------------------
    def monitor(self, now: float) -> None:
        assert self.config is not None
        cfg = self.config
        try:
            observed = self.backend.observe(list(self.runtimes))
        except Exception as exc:
            # Not knowing is not "not running": act on nothing this pass.
            log.error("cannot read instance states, skipping this pass: %s", exc)
            return
        if self.frontdoor is not None:
            self.frontdoor.observe()
        engine = engine_of(cfg)
        probes = {
            name: self._pool.submit(probe, cfg.server.host, rt.instance.port, cfg.monitor.probe_timeout_s,
                                    engine.liveness_path)
            for name, rt in self.runtimes.items() if observed[name].pid
        }
        counters = {
            name: self._pool.submit(read_engine_metrics, engine, cfg.server.host, rt.instance.port, self.api_key,
                                    cfg.monitor.probe_timeout_s)
            for name, rt in self.runtimes.items() if observed[name].pid and engine.metrics_path is not None
        }
        for name, runtime in self.runtimes.items():
            try:
                if name in counters:
                    runtime.on_counters(counters[name].result(), now)
                self._monitor_one(runtime, observed[name], probes.get(name), now)
            except Exception:  # one instance's trouble never stops the others' monitoring
                log.exception("%s: monitoring failed", name)
            self._rotate(runtime)
        self._roll(now)

    def _rotate(self, rt: Runtime) -> None:
        """In the front door only while healthy; draining while a restart waits for it."""
        if self.frontdoor is None:
            return
        state = rt.supervision.state
        wanted = (AdminState.READY if state == State.HEALTHY
                  else AdminState.DRAIN if state == State.DRAINING else AdminState.MAINT)
        self.frontdoor.set_state(rt.instance, wanted)

    def _monitor_one(self, rt: Runtime, seen: Observation, pending, now: float) -> None:
        cfg = self.config
        assert cfg is not None
        sup = rt.supervision
        pid = seen.pid
        if pid != rt.pid:
            if pid is None:
                if sup.state != State.RESTARTING:
                    self._drift(rt, EventKind.EXIT, f"main process {rt.pid} is gone")
                sup.on_exit()
            else:
                exited = rt.pid or "that exited"
                if sup.on_new_pid(rt.pid is not None, now):
                    # Nobody here restarted it: it died and systemd (Restart=) brought it back.
                    self._drift(rt, EventKind.EXIT, f"main process {exited} replaced by {pid}")
            rt.new_process(pid)
        held_by = self.holds.get(rt.instance.name)
        if held_by is not None:
            self._hold(rt, pid, now, held_by)
            return
        if sup.state == State.HELD:
            log.info("%s: released: starting it again", rt.instance.name)
            self._isolated(rt.instance.name, "start", lambda: self.backend.start(rt.instance))
            sup.on_released(now)
            return
        if sup.state == State.DRAINING and sup.drain_then_hold:
            log.info("%s: the hold was released before the drain ended: back in service", rt.instance.name)
            sup.drain_then_hold = False
            sup.on_started(now)
        if sup.state == State.FAILED:
            return
        if pid is None:
            if not seen.pending:
                self._maybe_restart(rt, now, f"not running ({seen.description})")
            return
        self._track_progress(rt, pid, now)
        if sup.state == State.DRAINING:
            self._continue_drain(rt, now)
            return
        result: ProbeResult = pending.result() if pending is not None else ProbeResult(False, 0.0, "not probed")
        if result.ok and rt.stalled_since is not None and now - rt.stalled_since >= STALL_AFTER_S:
            # The event loop answers, but the generation thread is wedged: requests are
            # in flight and the process has not used any CPU for a long while.
            result = ProbeResult(False, result.latency_s, f"stalled: requests in flight and no CPU used for "
                                                          f"{now - rt.stalled_since:.0f}s")
        rt.last_probe = result
        if sup.on_probe(result.ok, now, cfg.monitor, result.error):
            self._maybe_restart(rt, now, f"{sup.failures} failed probes: {result.error}")
            return
        rt.drifting = False
        self._check_key(rt)
        self._check_affinity(rt, pid, now)
        self._check_memory(rt, pid, now)

    def _maybe_restart(self, rt: Runtime, now: float, reason: str) -> None:
        cfg = self.config
        assert cfg is not None
        sup = rt.supervision
        decision = sup.restart_decision(now, cfg.monitor)
        if decision == RestartDecision.FAIL:
            if sup.state != State.FAILED:
                sup.on_failed(f"{cfg.monitor.max_restarts} restarts within {cfg.monitor.restart_window_s:g}s; last: {reason}")
                log.error("%s: marked failed after %d restarts within %gs (%s); left alone until a reload",
                          rt.instance.name, cfg.monitor.max_restarts, cfg.monitor.restart_window_s, reason)
            return
        if decision == RestartDecision.WAIT:
            return
        self._restart(rt, now, reason, counted=True)

    # -- restarts, drained out of the front door first --------------------------------------------
    def _restart(self, rt: Runtime, now: float, reason: str, counted: bool) -> None:
        """Restart one instance; with requests in flight at the front door, drain it first.

        `counted`: a repair, which counts against monitor.max_restarts (a definition
        change does not). An unhealthy instance is drained only while it still uses CPU:
        a stopped or wedged one would never finish what it has.
        """
        cfg = self.config
        assert cfg is not None
        busy = self.frontdoor.in_flight(rt.instance) if self.frontdoor is not None else None
        worth_waiting = not counted or rt.progress is True
        if busy and worth_waiting and cfg.frontend.drain_timeout_s > 0:
            assert self.frontdoor is not None
            self.frontdoor.set_state(rt.instance, AdminState.DRAIN)
            rt.supervision.on_drain(now, cfg.frontend.drain_timeout_s, reason, counted)
            log.info("%s: %s: draining %d request(s) before the restart (at most %gs)", rt.instance.name, reason, busy,
                     cfg.frontend.drain_timeout_s)
            return
        self._restart_now(rt, now, reason, counted)

    def _hold(self, rt: Runtime, pid: int | None, now: float, by: str) -> None:
        """Held by another process: out of the front door (drained first, as for a restart),
        then stopped until the hold is released."""
        cfg = self.config
        assert cfg is not None
        sup = rt.supervision
        if sup.state == State.HELD:
            if pid is not None:  # started by someone else meanwhile: stop it again
                self._isolated(rt.instance.name, "stop", lambda: self.backend.stop(rt.instance.name))
            return
        if sup.state == State.DRAINING and sup.drain_then_hold:
            if pid is not None:
                self._track_progress(rt, pid, now)
            self._continue_drain(rt, now)
            return
        busy = self.frontdoor.in_flight(rt.instance) if self.frontdoor is not None and pid is not None else None
        if busy and cfg.frontend.drain_timeout_s > 0:
            assert self.frontdoor is not None
            self.frontdoor.set_state(rt.instance, AdminState.DRAIN)
            sup.on_drain(now, cfg.frontend.drain_timeout_s, f"held by {by}", counted=False, then_hold=True)
            log.info("%s: held by %s: draining %d request(s) first (at most %gs)", rt.instance.name, by, busy,
                     cfg.frontend.drain_timeout_s)
            return
        self._stop_held(rt, by)

    def _stop_held(self, rt: Runtime, by: str) -> None:
        if self.frontdoor is not None:
            self.frontdoor.set_state(rt.instance, AdminState.MAINT)
        log.info("%s: held by %s: stopping it until the hold is released", rt.instance.name, by)
        self._isolated(rt.instance.name, "stop", lambda: self.backend.stop(rt.instance.name))
        rt.supervision.on_held(by)

    def _continue_drain(self, rt: Runtime, now: float) -> None:
        sup = rt.supervision
        left = self.frontdoor.in_flight(rt.instance) if self.frontdoor is not None else None
        if left and now < sup.drain_until and (rt.progress is not False or not sup.drain_counted):
            return
        why = ("drained" if not left else
               f"{left} request(s) still running at the drain deadline" if now >= sup.drain_until else
               f"{left} request(s) in flight but no progress")
        if sup.drain_then_hold:
            log.info("%s: %s", rt.instance.name, why)
            self._stop_held(rt, sup.drain_reason.removeprefix("held by "))
            return
        log.info("%s: %s: restarting", rt.instance.name, why)
        self._restart_now(rt, now, sup.drain_reason, sup.drain_counted)

    def _restart_now(self, rt: Runtime, now: float, reason: str, counted: bool) -> None:
        cfg = self.config
        assert cfg is not None
        if self.frontdoor is not None:
            self.frontdoor.set_state(rt.instance, AdminState.MAINT)
        if counted:
            log.warning("%s: %s: restarting", rt.instance.name, reason)
            self._repaired(rt, EventKind.HEALTH, f"restarted: {reason}")
        self._isolated(rt.instance.name, "restart", lambda: self.backend.restart(rt.instance))
        rt.supervision.on_restart(now, cfg.monitor if counted else None)
        rt.new_process(rt.pid)

    def _track_progress(self, rt: Runtime, pid: int, now: float) -> None:
        cpu = self.proc.cpu_seconds(pid)
        rt.progress = None if cpu is None or rt.cpu_seen is None else cpu - rt.cpu_seen >= PROGRESS_CPU_S
        rt.cpu_seen = cpu
        busy = self.frontdoor.in_flight(rt.instance) if self.frontdoor is not None else None
        if busy and rt.progress is False:
            rt.stalled_since = rt.stalled_since if rt.stalled_since is not None else now
        else:
            rt.stalled_since = None

    def _check_key(self, rt: Runtime) -> None:
        """Once per process: does it take the configured API key? A refused key is reported as
        such (the instance is healthy, its clients' requests would fail), never restarted."""
        if self.api_key is None or rt.key_check == KeyCheck.ACCEPTED or rt.supervision.state != State.HEALTHY:
            return
        if self.frontdoor is not None and self.frontdoor.in_flight(rt.instance):
            return  # busy: the check would wait on the model; ask when it is idle
        cfg = self.config
        assert cfg is not None
        verdict = check_key(cfg.server.host, rt.instance.port, self.api_key, min(cfg.monitor.probe_timeout_s, 0.5),
                            engine_of(cfg).key_check_path)
        if verdict == KeyCheck.REJECTED and rt.key_check != KeyCheck.REJECTED:
            log.error("%s: refuses the API key of server.api_key_file (it runs with another one): restart it "
                      "(systemctl restart %s) to give it the current key", rt.instance.name, rt.instance.unit)
        if verdict != KeyCheck.UNKNOWN:
            rt.key_check = verdict

    def _check_affinity(self, rt: Runtime, pid: int, now: float) -> None:
        cfg = self.config
        assert cfg is not None
        cpus = frozenset(rt.instance.cpus)
        verdict = drift.check_affinity(cpus, self.proc.threads(pid), rt.good_masks)
        rt.good_masks = verdict.good_masks
        if not verdict.drifted:
            return
        rt.drifting = True
        found = "; ".join(
            f"thread {d.tid} ({d.name}) allowed {format_list(d.allowed)}, last ran on {d.last_cpu}" for d in verdict.drifted[:4]
        ) + (f" and {len(verdict.drifted) - 4} more" if len(verdict.drifted) > 4 else "")
        self._drift(rt, EventKind.AFFINITY, f"outside CPUs {format_list(cpus)}: {found}")
        if not cfg.monitor.repair:
            log.warning("%s: affinity drift: %s (repair = false: not fixed)", rt.instance.name, found)
            return
        fixed, gone = [], 0
        for d in verdict.drifted:
            try:
                if pinning.set_thread_affinity(d.tid, d.target):
                    fixed.append(f"{d.tid}->{format_list(d.target)}")
                    rt.good_masks[d.tid] = d.target
                else:
                    gone += 1
            except OSError as exc:
                log.error("%s: cannot re-pin thread %d: %s", rt.instance.name, d.tid, exc.strerror)
        detail = f"re-pinned {len(fixed)} thread(s): {', '.join(fixed[:8])}" + (f"; {gone} exited meanwhile" if gone else "")
        log.warning("%s: affinity drift: %s; %s", rt.instance.name, found, detail)
        self._repaired(rt, EventKind.AFFINITY, detail)
        rt.drifting = False

    def _check_memory(self, rt: Runtime, pid: int, now: float) -> None:
        cfg = self.config
        assert cfg is not None
        usage = self.proc.cgroup_numa_stat(pid) if self.backend.instance_cgroups else None
        if usage is None:
            # numa_maps walks every page table of the process: only every numa_maps_interval_s.
            if rt.memory is not None and now - rt.memory_checked_at < cfg.monitor.numa_maps_interval_s:
                rt.drifting = rt.drifting or rt.memory.drifted
                return
            usage = self.proc.numa_maps(pid)
            if usage is None:
                return
        rt.memory_checked_at = now
        mems = frozenset(rt.instance.mems)
        verdict = drift.check_memory(usage, mems, cfg.monitor.min_local_fraction)
        rt.memory = verdict
        if rt.migrated_from is not None:
            # The reading after a migration: kernel counters (memory.numa_stat) settle
            # within a pass, so what moved is measured here rather than right after the call.
            moved = max(rt.migrated_from - verdict.remote_bytes, 0)
            detail = (f"migrate_pages moved {moved / 2**20:.1f} MiB back to node(s) {format_list(mems)}; "
                      f"now {verdict.local_fraction or 0:.1%} local")
            log.info("%s: memory repair result: %s", rt.instance.name, detail)
            rt.last_repair = Event(self.wall(), EventKind.MEMORY.value, detail)
            rt.migrated_from = None
        if not verdict.drifted:
            return
        found = (f"{verdict.local_fraction:.1%} of {verdict.anon_bytes / 2**20:.0f} MiB anonymous memory on nodes "
                 f"{format_list(mems)}; {verdict.remote_bytes / 2**20:.0f} MiB on node(s) {format_list(verdict.remote_nodes)}")
        self._drift(rt, EventKind.MEMORY, found)
        rt.drifting = True
        if not cfg.monitor.repair or rt.instance.policy == Policy.INTERLEAVE:
            log.warning("%s: memory drift: %s (not repaired)", rt.instance.name, found)
            return
        try:
            left = pinning.migrate_pages(pid, verdict.remote_nodes, rt.instance.mems)
        except OSError as exc:
            log.error("%s: memory drift: %s; migrate_pages failed: %s", rt.instance.name, found, exc.strerror)
            return
        detail = (f"migrate_pages from node(s) {format_list(verdict.remote_nodes)} to {format_list(mems)}"
                  + (f"; {left} page(s) could not move" if left else ""))
        log.warning("%s: memory drift: %s; %s", rt.instance.name, found, detail)
        self._repaired(rt, EventKind.MEMORY, detail)
        rt.migrated_from = verdict.remote_bytes
        # Measure the result at the next pass, even with numa_maps (whatever the clock reads:
        # a monotonic clock is small on a host that booted minutes ago).
        rt.memory_checked_at = float("-inf")

    # -- helpers ------------------------------------------------------------------------------------
    def _drift(self, rt: Runtime, kind: EventKind, detail: str) -> None:
        rt.last_drift = Event(self.wall(), kind.value, detail)
        rt.drift_counts[kind.value] = rt.drift_counts.get(kind.value, 0) + 1

    def _repaired(self, rt: Runtime, kind: EventKind, detail: str) -> None:
        rt.last_repair = Event(self.wall(), kind.value, detail)
        rt.repair_counts[kind.value] = rt.repair_counts.get(kind.value, 0) + 1

    def _isolated(self, name: str, action: str, call):
        try:
            return call()
        except Exception as exc:  # one unit's failure is logged; the others go on
            log.error("%s: %s failed: %s", name, action, exc)
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
