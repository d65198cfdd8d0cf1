"""The front door: one OpenAI endpoint over every instance, served by HAProxy.

`render_haproxy(config, plan, paths)` is pure: plan -> haproxy.cfg. `Frontdoor` is the
daemon's handle on the running HAProxy: it applies a plan (validate with `haproxy -c`,
then start or reload seamlessly), reads the live counters once a pass, and moves
servers in and out of rotation through the runtime API. How HAProxy runs (a systemd
unit, or a child process) is a `FrontdoorRunner` from the backend.

Why these HAProxy settings (each one is a finding, see issue 9):
- `maxconn` per server = what the engine serves at once (`Engine.slots`: 1 for
  llama-cpp-python, `server.parallel` for llama-server): one more request would wait
  inside the server, where no other instance can take it. HAProxy queues it instead and
  gives it to whichever instance frees up first (`balance leastconn`).
- `observe layer4 ... on-error mark-down`: with least connections a dead server has the
  fewest connections, so retries would go straight back to it; a refused connection
  takes it out of rotation at once.
- `retry-on conn-failure empty-response` + `option redispatch 1`: a request that got no
  byte back is sent again, to another server every time.
- health checks on the engine's path that never waits on the model
  (`Engine.liveness_path`): a busy server is not a down server.
- `load-server-state-from-file`: a reload keeps the drain/maint states the daemon set.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from numad_infer import haproxy
from numad_infer.config import Affinity, Config, ConfigError, FrontendSection
from numad_infer.haproxy import AdminState, BackendStat, HaproxyError, RuntimeAPI
from numad_infer.engines import engine_of
from numad_infer.planner import Instance, Plan

log = logging.getLogger(__name__)

BACKEND = "instances"
MARKER = "# Managed by numa-infer: rewritten by the daemon on every plan change; do not edit."
# llama-cpp-python runs one request at a time (it serialises on its model lock).
# Connections a client may hold open beyond the instances and the queue (idle keep-alives).
SPARE_CONNECTIONS = 256

_BUSY_BODY = ('{"error":{"message":"numa-infer: every instance is busy and the queue is full or the wait ran out; '
              'retry later","type":"server_busy","code":503}}')


_STATUS_OF = {AdminState.READY: "UP", AdminState.DRAIN: "DRAIN", AdminState.MAINT: "MAINT"}


def server_name(instance_name: str) -> str:
    # HAProxy names allow letters, digits, - _ . : (not the "@" of a unit instance name).
    return instance_name.replace("@", "-")


@dataclass(frozen=True)
class Paths:
    config: Path  # haproxy.cfg
    state: Path  # server states kept across reloads
    socket: Path  # runtime API (admin level)


def render_haproxy(config: Config, plan: Plan, paths: Paths) -> str:
    front: FrontendSection = config.frontend
    host, port = front.address
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    target = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(config.server.host, config.server.host)
    target = f"[{target}]" if ":" in target else target
    queue_s = _ms(front.queue_timeout_s)
    request_s = _ms(front.request_timeout_s)
    engine = engine_of(config)
    per_server = engine.slots(config)
    maxconn = len(plan.instances) * per_server + front.queue_size + SPARE_CONNECTIONS
    lines = [
        MARKER,
        "global",
        f"    maxconn {maxconn}",
        f"    stats socket {paths.socket} mode 600 level admin",
        f"    server-state-file {paths.state}",
        # Server up/down changes reach the journal (or the process backend's log file).
        "    log stderr format short local0 notice",
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option dontlognull",
        "    timeout connect 2s",
        f"    timeout client {request_s}",
        f"    timeout server {request_s}",
        f"    timeout queue {queue_s}",
        "    timeout http-request 30s",
        "    timeout http-keep-alive 10s",
        "    timeout check 2s",
        "    load-server-state-from-file global",
        "",
        "frontend openai",
        f"    bind {bind}",
        f"    default_backend {BACKEND}",
        "",
        f"backend {BACKEND}",
        "    balance leastconn",
        # Needed for retries (the request is replayed from the buffer) and for json_query.
        "    option http-buffer-request",
        "    retries 3",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response",
        f"    http-request return status 503 content-type application/json string '{_BUSY_BODY}' "
        f"hdr Retry-After 1 if {{ queue({BACKEND}) ge {front.queue_size} }}",
        f"    http-error status 503 content-type application/json string '{_BUSY_BODY}' hdr Retry-After 1",
        f"    option httpchk GET {engine.liveness_path}",
        "    http-check expect status 200",
        f"    default-server check inter 2s fastinter 500ms fall 2 rise 1 maxconn {per_server} "
        "observe layer4 error-limit 1 on-error mark-down",
    ]
    if front.affinity != Affinity.NONE:
        expire = _ms(front.affinity_expire_s)
        # The first turn goes where leastconn sends it; later turns follow it (stick table),
        # to the instance whose KV cache already holds the conversation's prompt prefix.
        lines.append(f"    stick-table type string len 128 size 1m expire {expire}")
        if front.affinity == Affinity.HEADER:
            lines.append(f"    stick on req.hdr({front.affinity_header})")
        else:
            lines.append("    stick on req.body,json_query('$.user')")
    for instance in plan.instances:
        lines.append(f"    server {server_name(instance.name)} {target}:{instance.port}")
    return "\n".join(lines) + "\n"


def _ms(seconds: float) -> str:
    return f"{max(int(seconds * 1000), 1)}ms"


def check_haproxy(config: Config, source: str) -> None:
    """The configured haproxy exists and is recent enough (a ConfigError naming the key otherwise)."""
    if not config.frontend.enabled:
        return
    binary = config.frontend.haproxy
    off = 'or set frontend.listen = "" to run without a front door'
    try:
        found = haproxy.version(binary)
    except HaproxyError as exc:
        raise ConfigError(source, "frontend.haproxy", f"{exc}; install it (apt-get install haproxy) {off}",
                          binary, True) from None
    if found < haproxy.MIN_VERSION:
        need = ".".join(map(str, haproxy.MIN_VERSION))
        raise ConfigError(source, "frontend.haproxy", f"is HAProxy {found[0]}.{found[1]}, older than {need}; "
                          f"install {need} or newer {off}", binary, True)


class FrontdoorRunner(Protocol):
    """How HAProxy runs: a systemd unit, or a child of the daemon (process backend)."""

    socket_path: Path
    run_dir: Path  # where the daemon writes haproxy.cfg and the saved server states
    # Something else (systemd's Restart=) brings HAProxy back if it dies; otherwise the daemon does.
    restarted_by_manager: bool

    def running(self) -> bool: ...
    def start(self, binary: str, config_path: Path) -> None: ...
    def reload(self) -> None: ...
    def stop(self) -> None: ...


class Frontdoor:
    def __init__(self, runner: FrontdoorRunner) -> None:
        self.runner = runner
        run_dir = runner.run_dir
        self.paths = Paths(run_dir / "haproxy.cfg", run_dir / "haproxy.state", runner.socket_path)
        self.api = RuntimeAPI(str(runner.socket_path))
        self.listen = ""
        self.binary = ""
        self.stats: BackendStat | None = None  # last pass's counters, None when unreadable
        self.error = ""  # why the last apply or read failed, for status

    def validate(self, config: Config, plan: Plan) -> None:
        """Refuse (HaproxyError) a plan whose HAProxy configuration `haproxy -c` rejects; changes nothing."""
        if config.frontend.enabled:
            self._candidate(config, plan).unlink()

    def _candidate(self, config: Config, plan: Plan) -> Path:
        candidate = self.paths.config.with_name(f".{self.paths.config.name}.new")
        candidate.parent.mkdir(parents=True, exist_ok=True)
        candidate.write_text(render_haproxy(config, plan, self.paths), encoding="utf-8")
        os.chmod(candidate, 0o644)  # HAProxy may run as another user (systemd DynamicUser)
        try:
            haproxy.validate(config.frontend.haproxy, str(candidate))
        except HaproxyError:
            candidate.unlink(missing_ok=True)
            raise
        return candidate

    def apply(self, config: Config, plan: Plan) -> bool:
        """Bring HAProxy to this plan. HaproxyError leaves the running front door untouched.

        True when HAProxy was started or reloaded.
        """
        if not config.frontend.enabled:
            if self.runner.running():
                log.info("front door off (frontend.listen = \"\"): stopping haproxy")
                self.runner.stop()
            self.listen, self.stats = "", None
            return False
        text = render_haproxy(config, plan, self.paths)
        running = self.runner.running()
        try:
            current = self.paths.config.read_text(encoding="utf-8")
        except OSError:
            current = ""
        self.binary = config.frontend.haproxy
        if running and current == text:
            self.listen = config.frontend.listen
            return False
        candidate = self._candidate(config, plan)
        if running:
            self._save_server_states()
        elif not self.paths.state.exists():
            # An empty state file (version line only): HAProxy warns about a missing one.
            self.paths.state.write_text("1\n", encoding="utf-8")
        os.replace(candidate, self.paths.config)
        if running:
            log.info("front door: plan changed: reloading haproxy seamlessly")
            self.runner.reload()
        else:
            log.info("front door: starting haproxy on %s over %d instance(s)", config.frontend.listen, len(plan.instances))
            self.runner.start(config.frontend.haproxy, self.paths.config)
        self.listen = config.frontend.listen
        self.error = ""
        return True

    def _save_server_states(self) -> None:
        # Read back by `load-server-state-from-file`: drain/maint survive the reload.
        try:
            self.paths.state.write_text(self.api.servers_state(), encoding="utf-8")
            os.chmod(self.paths.state, 0o644)
        except (HaproxyError, OSError) as exc:
            log.warning("front door: cannot save server states before the reload: %s", exc)

    def observe(self) -> BackendStat | None:
        """Read the counters once for this pass (None while HAProxy is not answering)."""
        if not self.listen:
            self.stats = None
            return None
        if not self.runner.restarted_by_manager and not self.runner.running():
            log.error("front door: haproxy exited: starting it again")
            self.runner.start(self.binary, self.paths.config)
        try:
            self.stats = self.api.backend(BACKEND)
            self.error = ""
        except HaproxyError as exc:
            self.stats = None
            self.error = str(exc)
        return self.stats

    def in_flight(self, instance: Instance) -> int | None:
        if self.stats is None:
            return None
        stat = self.stats.servers.get(server_name(instance.name))
        return None if stat is None else stat.in_flight

    def set_state(self, instance: Instance, state: AdminState) -> None:
        """Move one server in or out of rotation, if it is not there already."""
        if self.stats is None:
            return
        name = server_name(instance.name)
        stat = self.stats.servers.get(name)
        if stat is None or stat.admin == state:
            return
        try:
            self.api.set_state(BACKEND, name, state)
        except HaproxyError as exc:
            log.error("front door: %s", exc)
            return
        log.info("front door: %s -> %s", name, state.value)
        # Until the next pass reads HAProxy again, this pass's view shows the new state.
        self.stats.servers[name] = replace(stat, status=_STATUS_OF[state])

    def stop(self) -> None:
        if self.runner.running():
            log.info("front door: stopping haproxy")
            self.runner.stop()

