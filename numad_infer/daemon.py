"""The daemon: one loop that applies the plan, monitors, repairs and reports.

Signal handlers only set flags (and wake the loop through a pipe); all work happens
in the loop, one small step at a time.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
from pathlib import Path

from numad_infer import __version__, bandwidthfile, holds, loading, metrics
from numad_infer.backends import Backend
from numad_infer.config import Config
from numad_infer.cpuset import format_list
from numad_infer.errors import NumaInferError
from numad_infer.frontdoor import Frontdoor
from numad_infer.haproxycfg import server_name
from numad_infer.health import KeyCheck
from numad_infer.engines import Engine
from numad_infer.identity import RunAs
from numad_infer.notify import Notifier
from numad_infer.planner import Plan
from numad_infer.procfs import ProcReader
from numad_infer.reconcile import Reconciler, Runtime
from numad_infer.states import IN_TRANSITION, State
from numad_infer.statefile import write_status
from numad_infer.status import (DaemonState, DaemonStatus, FrontdoorStatus, InstanceStatus, MemoryStatus, ReloadResult,
                                Status)
from numad_infer.sysfs import SysfsReader
from numad_infer.unitdir import check_private_dir

log = logging.getLogger(__name__)


class Daemon:
    def __init__(self, config_path: str, fsroot: str, backend: Backend, state_file: Path,
                 notifier: Notifier | None = None) -> None:
        self.config_path = config_path
        self.sysfs = SysfsReader(fsroot)
        self.proc = ProcReader("/")  # processes are always this machine's, even with --fsroot
        self.backend = backend
        self.state_file = state_file
        self.notifier = notifier or Notifier()
        self.frontdoor = Frontdoor(backend.frontdoor_runner(state_file.parent))
        self.reconciler = Reconciler(backend, self.proc, frontdoor=self.frontdoor)
        self.config: Config | None = None
        self.online: frozenset[int] | None = None
        self.generation = 0
        self.last_reload: ReloadResult | None = None
        self.warnings: list[str] = []
        self.started_at = time.time()
        self.state = DaemonState.STARTING
        self._flags: set[str] = set()
        self._wake_r, self._wake_w = os.pipe()
        self.runs_as: RunAs | None = None  # who the instances run as, None: the daemon's user
        self.model_bytes = 0
        self.engine: Engine | None = None
        self.load_warnings: tuple[str, ...] = ()
        self.tuned = bandwidthfile.Results(state_file.parent / bandwidthfile.RESULTS_NAME)  # what `numa-infer tune` measured
        self.latest: Status | None = None  # last published snapshot (immutable), read by the metrics thread
        self.pass_duration_s: float | None = None
        self.metrics = metrics.Endpoint(lambda: self.latest)

    # -- signals --------------------------------------------------------------------------------
    def _install_signals(self) -> None:
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

        def flag(name: str):
            return lambda signum, frame: self._flags.add(name)

        signal.signal(signal.SIGHUP, flag("reload"))
        signal.signal(signal.SIGTERM, flag("stop"))
        signal.signal(signal.SIGINT, flag("stop"))

    def _sleep(self, seconds: float) -> None:
        if self._flags or seconds <= 0:
            return
        ready, _, _ = select.select([self._wake_r], [], [], seconds)
        if ready:
            os.read(self._wake_r, 4096)

    # -- loading ----------------------------------------------------------------------------------
    def _load(self) -> tuple[Config, Plan]:
        """The pipeline every command uses (loading.py); refused there, nothing changes here."""
        loaded = loading.load(self.config_path, self.backend.kind, self.sysfs)
        self.online = loaded.topology.online_cpus
        self.runs_as, self.model_bytes, self.engine = loaded.runs_as, loaded.model_bytes, loaded.engine
        self.load_warnings = loaded.warnings
        return loaded.config, loaded.plan

    def _apply(self, config: Config, plan: Plan, why: str) -> bool:
        """Bring everything to the plan; False (reported like a refused reload) if the unit
        definitions could not be written, with the running instances left alone."""
        try:
            self._read_holds()
            result = self.reconciler.apply(config, plan, time.monotonic())
        except (NumaInferError, OSError) as exc:
            log.error("%s failed, still running the previous configuration: cannot apply the plan: %s", why, exc)
            self.last_reload = ReloadResult(time.time(), False, why, f"cannot apply the plan: {exc}")
            return False
        self.config = config
        try:
            self.frontdoor.apply(config, plan)
        except NumaInferError as exc:
            self.frontdoor.error = str(exc)
            log.error("front door: %s", exc)
        self.metrics.listen_on(config.metrics.listen)
        self.warnings = list(self.load_warnings)
        for warning in self.warnings:
            log.warning("%s", warning)
        log.info("%s: %d instance(s): added %s, changed %s, removed %s, unchanged %s", why, len(plan.instances),
                 _names(result.added), _names(result.changed), _names(result.removed), _names(result.unchanged))
        self.last_reload = ReloadResult(time.time(), True, why, None, result.added, result.changed, result.removed,
                                        result.unchanged)
        return True

    def _read_holds(self) -> None:
        self.reconciler.holds = {h.instance: f"{h.by} (pid {h.pid})" for h in holds.active(holds.hold_dir(self.state_file)).values()}

    def reload(self) -> None:
        self.notifier.reloading()
        log.info("reloading %s", self.config_path)
        try:
            config, plan = self._load()
        except NumaInferError as exc:
            # Keep running the old plan untouched; say why everywhere an operator looks.
            log.error("reload failed, still running the previous configuration: %s", exc)
            self.last_reload = ReloadResult(time.time(), False, "reload", str(exc))
        else:
            self._apply(config, plan, "reload")
        self.generation += 1
        self.notifier.ready(self.status_line())

    def _check_machine(self) -> None:
        online = self.sysfs.online_cpus()
        if online is None or self.online is None or online == self.online:
            return
        gone, came = self.online - online, online - self.online
        log.warning("CPUs changed: %s%s; re-planning",
                    f"offline {format_list(gone)} " if gone else "", f"online {format_list(came)}" if came else "")
        try:
            config, plan = self._load()
        except NumaInferError as exc:
            log.error("the machine changed and the configuration no longer fits: %s", exc)
            self.online = online
            self.last_reload = ReloadResult(time.time(), False, "cpu hotplug", str(exc))
            return
        self._apply(config, plan, "cpu hotplug")

    # -- reporting --------------------------------------------------------------------------------------
    def status_line(self) -> str:
        runtimes = list(self.reconciler.runtimes.values())
        healthy = sum(rt.supervision.state == State.HEALTHY for rt in runtimes)
        text = f"{healthy}/{len(runtimes)} instances healthy"
        by_state: dict[str, int] = {}
        for rt in runtimes:
            if rt.supervision.state != State.HEALTHY:
                by_state[rt.supervision.state.value] = by_state.get(rt.supervision.state.value, 0) + 1
        drifting = sum(rt.drifting for rt in runtimes)
        extras = [f"{n} {s}" for s, n in sorted(by_state.items())] + ([f"{drifting} drifting"] if drifting else [])
        if extras:
            text += " (" + ", ".join(extras) + ")"
        if self.last_reload is not None and not self.last_reload.ok:
            text += f"; config error, running previous plan: {self.last_reload.error}"
        return text

    def snapshot(self, now: float) -> Status:
        wall = time.time()
        daemon = DaemonStatus(
            state=self.state, config=self.config_path, pid=os.getpid(), version=__version__, backend=self.backend.name,
            started_at=self.started_at, updated_at=wall,
            interval_s=self.config.monitor.interval_s if self.config else None, generation=self.generation,
            last_reload=self.last_reload, warnings=tuple(self.warnings), status=self.status_line(),
            pass_duration_s=self.pass_duration_s, metrics=self.metrics.listen or None)
        # The slots column only for an engine that reports its busy slots.
        engine = self.engine
        slots = engine.slots(self.config) if engine is not None and self.config is not None and engine.metrics_path else None
        return Status(daemon, tuple(_instance_status(rt, now, self.frontdoor, slots, self._efficiency(rt))
                                    for rt in self.reconciler.runtimes.values()), self._frontdoor_status())

    def _efficiency(self, rt: Runtime) -> float | None:
        """Decode tokens/s x bytes of weights read per token / the node's measured bandwidth."""
        if rt.decode_tokens_per_s is None or rt.instance.node is None or not self.model_bytes:
            return None
        gbs = self.tuned.local_gbs(rt.instance.node)
        return None if not gbs else rt.decode_tokens_per_s * self.model_bytes / (gbs * 1e9)

    def _frontdoor_status(self) -> FrontdoorStatus | None:
        fd = self.frontdoor
        if not fd.listen:
            return None
        stats = fd.stats
        return FrontdoorStatus(fd.listen, stats is not None, None if stats is None else stats.queued,
                               None if stats is None else stats.in_flight, fd.error or None)

    def publish(self, now: float) -> None:
        self.latest = self.snapshot(now)
        try:
            write_status(self.state_file, self.latest)
        except OSError as exc:
            log.error("cannot write %s: %s", self.state_file, exc.strerror)
        self.notifier.status(self.status_line())

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self) -> int:
        self._install_signals()
        log.info("numa-infer %s starting (backend %s, config %s)", __version__, self.backend.name, self.config_path)
        try:
            check_private_dir(self.state_file.parent)
            config, plan = self._load()
        except NumaInferError as exc:
            log.error("%s", exc)
            self.notifier.send(f"STATUS=configuration error: {exc}", "ERRNO=22")
            return 1
        if not self._apply(config, plan, "start"):
            assert self.last_reload is not None
            self.notifier.send(f"STATUS={self.last_reload.error}", "ERRNO=5")
            return 1
        self.state = DaemonState.RUNNING
        self.generation += 1
        now = time.monotonic()
        self.publish(now)
        self.notifier.ready(self.status_line())
        next_pass = now
        while True:
            if "stop" in self._flags:
                break
            if "reload" in self._flags:
                self._flags.discard("reload")
                self.reload()
                self.publish(time.monotonic())
            now = time.monotonic()
            if now >= next_pass:
                assert self.config is not None
                self._check_machine()
                self._read_holds()
                self.reconciler.monitor(now)
                self.pass_duration_s = time.monotonic() - now
                self.publish(now)
                next_pass = now + self._next_interval()
            if self.notifier.watchdog_due(time.monotonic()):
                self.notifier.watchdog(time.monotonic())
            wait = next_pass - time.monotonic()
            if self.notifier.watchdog_s:
                wait = min(wait, self.notifier.watchdog_s / 4)
            self._sleep(wait)
        return self.shutdown()

    def _next_interval(self) -> float:
        # While an instance is starting, look again within a second: it answers as soon as
        # its model is loaded, and status should say so without waiting a whole interval.
        # A draining one restarts as soon as its last request ends.
        assert self.config is not None
        interval = self.config.monitor.interval_s
        waiting = any(rt.supervision.state in IN_TRANSITION for rt in self.reconciler.runtimes.values())
        return min(interval, 1.0) if waiting else interval

    def shutdown(self) -> int:
        self.state = DaemonState.STOPPING
        self.notifier.stopping("stopping instances")
        stop_all = True
        try:
            stop_all = self.backend.stop_all_on_exit()
        except NumaInferError as exc:
            log.error("cannot tell a stop from a restart (%s): stopping the instances", exc)
        if stop_all:
            # The front door first: clients are refused at once rather than queued for nothing.
            self.frontdoor.stop()
            log.info("stopping %d instance(s)", len(self.reconciler.runtimes))
            self.reconciler.stop_all()
            if self.config is not None:
                try:
                    self.backend.forget(self.config)
                except Exception as exc:  # stopping must finish even if cleanup cannot
                    log.error("cannot remove rendered units: %s", exc)
        self.state = DaemonState.STOPPED
        self.publish(time.monotonic())
        self.reconciler.close()
        self.metrics.listen_on("")
        log.info("stopped")
        return 0


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(names) if names else "none"


def _instance_status(rt: Runtime, now: float, frontdoor: Frontdoor, slots: int | None,
                     efficiency: float | None) -> InstanceStatus:
    """`slots`: requests an instance works on at once, where its engine reports them."""
    sup, inst, mem = rt.supervision, rt.instance, rt.memory
    stat = None if frontdoor.stats is None else frontdoor.stats.servers.get(server_name(inst.name))
    return InstanceStatus.planned(
        inst, rt.pid, sup.state,
        uptime_s=round(now - sup.started_at, 1) if sup.started_at is not None and rt.pid else None,
        restarts=sup.restarts, consecutive_failures=sup.failures,
        error=("refuses the API key of server.api_key_file: restart it to give it the current key"
               if rt.key_check == KeyCheck.REJECTED else sup.last_error or None), drifting=rt.drifting,
        local_memory_fraction=None if mem is None or mem.local_fraction is None else round(mem.local_fraction, 4),
        memory=None if mem is None else MemoryStatus(
            mem.anon_bytes, mem.remote_bytes, mem.file_bytes,
            None if mem.file_local_fraction is None else round(mem.file_local_fraction, 4), mem.source),
        probe_latency_ms=None if rt.last_probe is None or not rt.last_probe.ok else round(rt.last_probe.latency_s * 1000, 1),
        last_drift=rt.last_drift, last_repair=rt.last_repair,
        drift_events=dict(rt.drift_counts), repairs=dict(rt.repair_counts),
        rotation=None if stat is None else stat.status, in_flight=None if stat is None else stat.in_flight,
        queued=None if stat is None else stat.queued, served=None if stat is None else stat.served,
        slots=slots, busy_slots=None if rt.counters is None else rt.counters.busy_slots,
        decode_tokens_per_s=None if rt.decode_tokens_per_s is None else round(rt.decode_tokens_per_s, 1),
        decode_efficiency=None if efficiency is None else round(efficiency, 4))
