"""The daemon: one loop that applies the plan, monitors, repairs and reports.

Signal handlers only set flags (and wake the loop through a pipe); all work happens
in the loop, one small step at a time. What the plan is and how it changes lives in
`desired.py`; what is published each pass, in `publish.py`.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType

from numad_infer import __version__
from numad_infer.backends.base import Backend
from numad_infer.config.schema import MonitorSection
from numad_infer.daemon import publish
from numad_infer.daemon.desired import PlanState, Validation
from numad_infer.daemon.restarts import Restarts
from numad_infer.errors import NumaInferError
from numad_infer.frontdoor.abandon_watch import AbandonWatch
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.host.procfs import ProcReader
from numad_infer.lifecycle.states import IN_TRANSITION
from numad_infer.status import metrics
from numad_infer.status.records import DaemonState, DaemonStatus, Status
from numad_infer.status.statefile import check_state_dir, write_status
from numad_infer.supervision.instance import Runtime
from numad_infer.supervision.reconcile import Reconciler
from numad_infer.systemd.notify import Notifier
from numad_infer.topology.sysfs import SysfsReader
from numad_infer.tune import bandwidth_file

log = logging.getLogger(__name__)


class Daemon:
    def __init__(self, config_path: str, fsroot: str, backend: Backend, state_file: Path,
                 notifier: Notifier | None = None, validation: Validation | None = None) -> None:
        """`validation`: the pipeline the re-plan reads through (desired.Pipeline unless a
        test stands in for the machine)."""
        self.config_path = config_path
        self.backend = backend
        self.state_file = state_file
        self.notifier = notifier or Notifier()
        self.frontdoor = Frontdoor(backend.frontdoor_runner(state_file.parent))
        self.abandon = AbandonWatch(self.frontdoor)
        # Processes are always this machine's, even with --fsroot. The pass pings the
        # watchdog while it waits on its probes, each bounded (reconcile.py).
        self.reconciler = Reconciler(backend, ProcReader("/"), frontdoor=self.frontdoor,
                                     keepalive=self.notifier.keepalive)
        self.latest: Status | None = None  # last published snapshot (immutable), read by the metrics thread
        self.metrics = metrics.Endpoint(lambda: self.latest)
        self.plan = PlanState(config_path, SysfsReader(fsroot), backend, self.reconciler, self.frontdoor, self.metrics,
                              state_file, validation)
        self.tuned = bandwidth_file.Results(state_file.parent / bandwidth_file.RESULTS_NAME)  # what tune measured
        self.started_at = time.time()
        self.state = DaemonState.STARTING
        self.pass_duration_s: float | None = None
        self.pass_started_at: float | None = None  # wall clock
        self.restarts = Restarts(self.reconciler, state_file)  # `numa-infer restart`
        self._flags: set[str] = set()
        self._wake_r, self._wake_w = os.pipe()

    # -- signals --------------------------------------------------------------------------------
    def _install_signals(self) -> None:
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

        def flag(name: str) -> Callable[[int, FrameType | None], None]:
            return lambda signum, frame: self._flags.add(name)

        def stop(signum: int, frame: object) -> None:
            # A second SIGTERM (or ^C) cuts the drain short: stop the instances now.
            self._flags.add("stop now" if "stop" in self._flags else "stop")

        signal.signal(signal.SIGHUP, flag("reload"))
        signal.signal(signal.SIGUSR1, flag("restart"))  # `numa-infer restart` left a request (restart_request.py)
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)

    def _sleep(self, seconds: float) -> None:
        if self._flags or seconds <= 0:
            return
        ready, _, _ = select.select([self._wake_r], [], [], seconds)
        if ready:
            os.read(self._wake_r, 4096)

    # -- reporting --------------------------------------------------------------------------------------
    def reload(self) -> None:
        self.notifier.keepalive()
        self.notifier.reloading()
        self.plan.reload()
        self.notifier.ready(self.status_line())

    def status_line(self) -> str:
        plan = self.plan
        return publish.status_line([*self.reconciler.runtimes.values()], plan.last_reload, self.frontdoor, plan.loaded)

    def snapshot(self, now: float) -> Status:
        config = self.plan.config
        daemon = DaemonStatus(
            state=self.state, config=self.config_path, pid=os.getpid(), version=__version__, backend=self.backend.name,
            started_at=self.started_at, updated_at=time.time(),
            interval_s=config.monitor.interval_s if config else None, generation=self.plan.generation,
            last_reload=self.plan.last_reload, last_restart=self.restarts.follow(), warnings=self.plan.warnings,
            status=self.status_line(), pass_duration_s=self.pass_duration_s, pass_started_at=self.pass_started_at,
            metrics=self.metrics.listen or None,
            allowed=publish.allowed_line(self.plan.loaded),
            min_local_fraction=config.monitor.min_local_fraction if config else None)
        runtimes = list(self.reconciler.runtimes.values())
        instances = publish.instances(runtimes, now, self.frontdoor, self.plan.loaded, self.tuned)
        return Status(daemon, instances, publish.frontdoor_status(self.frontdoor, self.abandon.ended),
                      publish.models(instances, self.frontdoor, self.plan.loaded))

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
        try:
            check_state_dir(self.state_file)
            loaded = self.plan.load()
        except NumaInferError as exc:
            # One line, nothing before it: a bad mount (config, model, state directory) reads
            # at a glance in `kubectl logs` or the journal.
            log.error("%s", exc)
            self.notifier.send(f"STATUS=configuration error: {exc}", "ERRNO=22")
            return 1
        log.info("numa-infer %s starting (backend %s, config %s)", __version__, self.backend.name, self.config_path)
        if not self.plan.apply(loaded, "start"):
            assert self.plan.last_reload is not None
            self.notifier.send(f"STATUS={self.plan.last_reload.error}", "ERRNO=5")
            return 1
        self.state = DaemonState.RUNNING
        self.abandon.start()  # its own thread: a pass comes every monitor.interval_s
        self.plan.generation += 1
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
            if "restart" in self._flags:
                self._flags.discard("restart")
                self.restarts.take()
                self.publish(time.monotonic())
            now = time.monotonic()
            if now >= next_pass:
                self.monitor_pass(now)
                # No plan applied yet (the start was refused): the schema's interval.
                monitor = self.plan.config.monitor if self.plan.config is not None else MonitorSection()
                next_pass = now + next_interval(monitor, self.reconciler.runtimes.values())
            if self.notifier.watchdog_due(time.monotonic()):
                self.notifier.watchdog(time.monotonic())
            wait = next_pass - time.monotonic()
            if self.notifier.watchdog_s:
                wait = min(wait, self.notifier.watchdog_s / 4)
            self._sleep(wait)
        return self.shutdown()

    def monitor_pass(self, now: float) -> None:
        """One pass: re-plan if the machine or the model changed (a failure there keeps the
        running plan, PlanState.replan), then monitor and repair the instances, publish."""
        # Published: what the pass says is true of the fleet as of this moment, not of when
        # it published (a fault that struck while it ran may not be in it).
        self.pass_started_at = time.time()
        self.plan.replan(now)
        self.plan.read_holds()
        self.reconciler.monitor(now)
        self.pass_duration_s = time.monotonic() - now
        self.publish(now)

    def _drain_frontdoor(self) -> None:
        """Close the front door's listener and wait, up to frontend.drain_timeout_s, for the
        requests it is carrying. Requests sent to an instance's own port are not waited for."""
        config = self.plan.config
        if config is None or not self.frontdoor.close():
            return
        deadline = time.monotonic() + config.frontend.drain_timeout_s
        published = time.monotonic()
        left = self.frontdoor.requests_left()
        if left:
            log.info("front door: waiting up to %.0f s for %d request(s)", config.frontend.drain_timeout_s, left)
        while left:
            now = time.monotonic()
            if "stop now" in self._flags or now >= deadline:
                log.warning("front door: %d request(s) still running: stopping anyway", left)
                return
            if self.notifier.watchdog_due(now):
                self.notifier.watchdog(now)
            if now - published >= 1.0:  # `status` follows the drain (and `health --ready` says no)
                self.publish(now)
                published = now
            time.sleep(0.2)
            left = self.frontdoor.requests_left()
        log.info("front door: drained" if left == 0 else "front door: not answering: not waiting")

    def shutdown(self) -> int:
        self.state = DaemonState.STOPPING
        self.notifier.stopping("stopping instances")
        stop_all = True
        try:
            stop_all = self.backend.stop_all_on_exit()
        except NumaInferError as exc:
            log.error("cannot tell a stop from a restart (%s): stopping the instances", exc)
        if stop_all:
            # New work is refused at once (a client tries another pod); what is under way
            # finishes; then the instances stop, then HAProxy, which carried the last bytes.
            self._drain_frontdoor()
            log.info("stopping %d instance(s)", len(self.reconciler.runtimes))
            self.reconciler.stop_all()
            self.frontdoor.stop()
            if self.plan.config is not None:
                try:
                    self.backend.forget(self.plan.config)
                except Exception as exc:  # stopping must finish even if cleanup cannot
                    log.error("cannot remove rendered units: %s", exc)
        self.abandon.stop()
        self.state = DaemonState.STOPPED
        self.publish(time.monotonic())
        self.reconciler.close()
        self.metrics.listen_on("")
        log.info("stopped")
        return 0


def next_interval(monitor: MonitorSection, runtimes: Iterable[Runtime]) -> float:
    """While an instance is starting, look again within a second: it answers as soon as its
    model is loaded, and status should say so without waiting a whole interval. A draining
    one restarts as soon as its last request ends."""
    interval = monitor.interval_s
    waiting = any(rt.supervision.state in IN_TRANSITION for rt in runtimes)
    return min(interval, 1.0) if waiting else interval
