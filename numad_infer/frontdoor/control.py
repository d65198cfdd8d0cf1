"""The front door at run time: the daemon's handle on the running HAProxy.

`Frontdoor` applies a plan (writes the haproxy.cfg that validation rendered for its
directory and `haproxy -c` passed: checked_config.py; then starts or reloads HAProxy
seamlessly), reads the live counters once a pass, and moves servers in and out of rotation
through the runtime API. How HAProxy runs (a systemd unit, or a child process) is a
`FrontdoorRunner` from the backend. Why the configuration says what it says:
haproxy_config.py.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from numad_infer.config.models import ServedModel
from numad_infer.config.schema import Config
from numad_infer.frontdoor.checked_config import put_keys, put_lua
from numad_infer.frontdoor.haproxy import (
    AdminState,
    BackendStat,
    FrontendStat,
    HaproxyError,
    NoRuntimeAnswer,
    RuntimeAPI,
    merged,
)
from numad_infer.frontdoor.haproxy_config import (
    BACKEND,
    FRONTEND,
    CheckedConfig,
    Paths,
    paths_in,
    server_name,
)
from numad_infer.frontdoor.listener import HeldListener
from numad_infer.frontdoor.reload_watch import ReloadWatch
from numad_infer.frontdoor.request_log import RequestLog
from numad_infer.frontdoor.routing import backends
from numad_infer.frontdoor.tenants import TABLE, TenantCount, parse_usage
from numad_infer.plan.model import Instance, Plan
from numad_infer.util.atomicfile import write_atomic
from numad_infer.util.histogram import Histogram
from numad_infer.util.printable import printable

log = logging.getLogger(__name__)

_STATUS_OF = {AdminState.READY: "UP", AdminState.DRAIN: "DRAIN", AdminState.MAINT: "MAINT"}


class FrontdoorRunner(Protocol):
    """How HAProxy runs: a systemd unit, or a child of the daemon (process backend)."""

    socket_path: Path
    run_dir: Path  # where the daemon writes haproxy.cfg and the saved server states
    # Something else (systemd's Restart=) brings HAProxy back if it dies; otherwise the daemon does.
    restarted_by_manager: bool
    # The listening socket the daemon holds, and HAProxy accepts on (listener.py says why).
    listener: HeldListener
    # Who HAProxy runs as (and root): only their timing lines count (request_log.py).
    haproxy_uids: frozenset[int]
    haproxy_gid: int | None  # HAProxy's group, which may read the key files (None: it runs as the daemon's user)

    def running(self) -> bool: ...
    def start(self, binary: str, config_path: Path) -> None: ...
    def reload(self) -> None: ...
    def stop(self) -> None: ...
    # The daemon stops for good: whoever keeps the port while it is away takes it over
    # (numa-infer-port.socket under systemd; no one else, under the process backend).
    def hand_back(self) -> None: ...


class Frontdoor:
    def __init__(self, runner: FrontdoorRunner, clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.paths = paths_in(runner.run_dir, runner.socket_path)
        self.api = RuntimeAPI(str(runner.socket_path))
        self.reloads = ReloadWatch(self.api.worker_pid, lambda: self.runner.reload(), clock)
        self.listen = self.binary = ""
        self.stats: BackendStat | None = None  # last pass's counters, None when unreadable (every model's)
        self.model_stats: dict[str, BackendStat] = {}  # the same per model key; empty when unreadable
        self.backends: dict[str, str] = {"": BACKEND}  # model key (Instance.model) -> its backend, as applied
        self.answers: FrontendStat | None = None  # the listener's answers by class, read with `stats`
        self.queue_size = 0  # frontend.queue_size of the applied config: a full queue answers 503
        self.tenants: tuple[str, ...] = ()  # [[tenants]] of the applied config, by name
        self.tenant_counts: dict[str, TenantCount] = {}  # their stick table entries, read each pass
        self.error = ""  # why the last apply or read failed, for status
        assert self.paths.requests is not None
        self.requests = RequestLog(self.paths.requests, runner.haproxy_uids, runner.haproxy_gid)  # per-request timings

    def apply(self, config: Config, plan: Plan, served: tuple[ServedModel, ...], checked: CheckedConfig | None) -> bool:
        """Bring HAProxy to this plan (`served`: as validated; `checked`: the haproxy.cfg
        validation rendered for this front door's files and `haproxy -c` passed, written
        here as it is). HaproxyError leaves the running front door untouched. True when
        HAProxy was started or reloaded."""
        # HAProxy answers its runtime API at once; one that does not is a peer to give up on
        # as soon as an instance's probe is: a pass then costs at most one probe timeout more,
        # whichever of the two drips.
        self.api.timeout_s = config.monitor.probe_timeout_s
        if not config.frontend.enabled:
            if self.runner.running():
                log.info("front door off (frontend.listen = \"\"): stopping haproxy")
                self.runner.stop()
            self.runner.listener.release()
            self.listen, self.stats, self.answers = "", None, None
            self.model_stats = {}
            return False
        if checked is None or checked.paths != self.paths:
            raise HaproxyError(f"no haproxy.cfg was checked for {self.paths.config} (validation was not given "
                               "this front door's directory): nothing changed")
        try:
            self.requests.start()
        except OSError as exc:  # the front door works without its timings; say why they are missing
            log.error("front door: cannot receive request timings on %s: %s", self.paths.requests, exc.strerror)
        running = self.runner.running()
        if _hold(self.runner, config) and running:
            # A new address is a new socket: HAProxy cannot take it on a reload.
            log.info("front door: listening on %s now: restarting haproxy", config.frontend.listen)
            self.runner.stop()
            running = False
        text = checked.text
        try:
            current = self.paths.config.read_text(encoding="utf-8")
        except OSError:
            current = ""
        self.binary = config.frontend.haproxy
        self.queue_size, self.tenants = config.frontend.queue_size, tuple(t.name for t in config.tenants)
        keys_changed = put_keys(self.paths, checked.keys, self.runner.haproxy_gid)
        if running and current == text and not keys_changed:
            self.listen = config.frontend.listen
            self.backends = backends(served)
            return False
        self._write(text, running)
        # From here on the running HAProxy has (or is about to have) these backends.
        self.backends = backends(served)
        if running:
            # The same rules over other keys: HAProxy reads the key files again on a reload.
            log.info("front door: %s: reloading haproxy seamlessly",
                     "tenant keys changed" if current == text else "plan changed")
            self.reloads.ask()  # and each pass sees it taken, or asks again (reload_watch.py)
        else:
            log.info("front door: starting haproxy on %s over %d instance(s)", config.frontend.listen,
                     len(plan.instances))
            self.reloads.forget()
            self.runner.start(config.frontend.haproxy, self.paths.config)
        self.listen = config.frontend.listen
        self.error = ""
        return True

    def _write(self, text: str, running: bool) -> None:
        """The checked text in place, with what the reload reads back (server states, homes)."""
        if running:
            _save_for_reload(self.api, self.paths, self.runner.haproxy_gid)
        elif not self.paths.state.exists():
            # An empty state file (version line only): HAProxy warns about a missing one.
            write_atomic(self.paths.state, "1\n", durable=False)
        # Renamed into place, never written through: a link planted under these names is
        # replaced, not followed. 0644: HAProxy runs as another user (numa-infer-frontdoor).
        put_lua(self.paths)
        write_atomic(self.paths.config, text, durable=False)

    def observe(self) -> BackendStat | None:
        """Read the counters once for this pass (None while HAProxy is not answering)."""
        if not self.listen:
            self._unread()
            return None
        self.reloads.check()
        if not self.runner.restarted_by_manager and not self.runner.running():
            log.error("front door: haproxy exited: starting it again")
            try:
                # On the held socket: what clients sent while it was dead waits there for it.
                self.reloads.forget()
                self.runner.start(self.binary, self.paths.config)
            except HaproxyError as exc:
                self._unread(str(exc))
                log.error("front door: %s", exc)
                return None
        try:
            per_backend, self.answers = self.api.backends(list(self.backends.values()), FRONTEND)
            self.tenant_counts = parse_usage(self.api.command(f"show table {TABLE}")) if self.tenants else {}
        except HaproxyError as exc:
            self._unread(str(exc))
            return None
        self.model_stats = {model: per_backend[backend] for model, backend in self.backends.items()}
        self.stats = merged(list(per_backend.values()))
        self.error = ""
        return self.stats

    def _unread(self, error: str | None = None) -> None:
        """No counters this pass (HAProxy off, or not answering: `error` says why)."""
        self.stats = self.answers = None
        self.model_stats = {}
        if error is not None:
            self.error = error

    def backend_of(self, instance: Instance) -> str | None:
        """The backend that held the instance's server when last read (None: none did)."""
        held = [m for m, stat in self.model_stats.items() if server_name(instance.name) in stat.servers]
        return self.backends.get(held[0] if held else instance.model)

    def timings(self, instance: Instance) -> tuple[Histogram, Histogram] | None:
        """The instance's time to first token and request duration, from HAProxy's log."""
        return self.requests.timings.snapshot().get(server_name(instance.name))

    def in_flight(self, instance: Instance) -> int | None:
        stat = None if self.stats is None else self.stats.servers.get(server_name(instance.name))
        return None if stat is None else stat.in_flight

    def set_state(self, instance: Instance, state: AdminState) -> None:
        """Move one server in or out of rotation, if it is not there already."""
        self.set_server(self.backend_of(instance), server_name(instance.name), state)

    def set_server(self, backend: str | None, name: str, state: AdminState) -> bool:
        """One server of `backend` to `state` through the runtime API; True when it is there."""
        if self.stats is None or backend is None:
            return False
        stat = self.stats.servers.get(name)
        if stat is None:
            return False
        if stat.admin == state:
            return True
        try:
            self.api.set_state(backend, name, state)
        except NoRuntimeAnswer as exc:
            # Not answering now: so for the rest of the pass (later calls would wait for nothing).
            log.error("front door: %s", exc)
            self._unread(str(exc))
            return False
        except HaproxyError as exc:
            log.error("front door: %s", exc)
            return False
        log.info("front door: %s -> %s", name, state.value)
        # Until the next pass reads HAProxy again, this pass's view shows the new state.
        now = replace(stat, status=_STATUS_OF[state])
        self.stats.servers[name] = now
        for model in self.model_stats.values():
            if name in model.servers:
                model.servers[name] = now
        return True

    def close(self) -> bool:
        """Stop taking connections, keep serving the ones open: the port is closed, so a
        client (or a Service) is refused at once and tries elsewhere. True when it closed."""
        if not self.listen or not self.runner.running():
            return False
        try:
            answer = self.api.command(f"disable frontend {FRONTEND}").strip()
        except HaproxyError as exc:
            log.error("front door: cannot close the listener: %s", exc)
            answer = str(exc)
        if answer:  # HAProxy answers nothing on success
            log.error("front door: disable frontend %s: %s", FRONTEND, printable(answer))
        # HAProxy's pause alone would leave the inherited socket queueing connections that
        # no one accepts; shut down, it refuses them in every process holding it.
        self.runner.listener.refuse()
        log.info("front door: listener on %s closed: new connections are refused", self.listen)
        return True

    def requests_left(self) -> int | None:
        """Requests queued or in flight through HAProxy now (None: it does not answer)."""
        try:
            per_backend, _ = self.api.backends(list(self.backends.values()), FRONTEND)
        except HaproxyError:
            return None
        return sum(stat.queued + stat.in_flight for stat in per_backend.values())

    def stop(self) -> None:
        if self.runner.running():
            log.info("front door: stopping haproxy")
            self.runner.stop()
        self.runner.hand_back()
        self.runner.listener.release()


def _hold(runner: FrontdoorRunner, config: Config) -> bool:
    """Hold the listening sockets at the configured address. True when one is new: a
    HAProxy running on the old ones must be restarted."""
    listener = runner.listener
    address = config.frontend.address
    if listener.address == address:
        return False
    try:
        return listener.hold(*address)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE and runner.running():
            # A HAProxy started by an older numa-infer binds the port itself: once, it
            # is restarted on the daemon's socket (its open connections are cut).
            log.warning("front door: haproxy holds %s itself: restarting it on the daemon's socket",
                        config.frontend.listen)
            runner.stop()
            return _hold(runner, config)
        raise HaproxyError(f"cannot listen on frontend.listen = \"{config.frontend.listen}\": {exc.strerror}; "
                           "free the port or choose another") from None


def _save_for_reload(api: RuntimeAPI, paths: Paths, group: int | None) -> None:
    """What the running HAProxy knows that its next process reads back: the server states
    (`load-server-state-from-file`: drain/maint survive the reload, every backend's) and the
    prefix keys' homes (affinity.py: conversations keep their instances). The homes are
    hashes of prompts' first bytes: readable by HAProxy's group only."""
    for what, path, read, mode, owners in (("server states", paths.state, api.servers_state, 0o644, None),
                                           ("the prefix keys' homes", paths.homes, api.homes, 0o640, group)):
        try:
            write_atomic(path, read(), durable=False, mode=mode, group=owners)
        except (HaproxyError, OSError) as exc:
            log.warning("front door: cannot save %s before the reload: %s", what, exc)
