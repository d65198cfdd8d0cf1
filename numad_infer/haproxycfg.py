"""haproxy.cfg from the plan: pure (config + plan -> text). The daemon's `frontdoor.Frontdoor`
writes it and drives the running HAProxy; `numa-infer check` validates it.

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

from dataclasses import dataclass
from pathlib import Path

from numad_infer.addresses import connect_host, host_port
from numad_infer.config import Affinity, Config, FrontendSection
from numad_infer.engines import engine_of
from numad_infer.planner import Plan

BACKEND = "instances"
MARKER = "# Managed by numa-infer: rewritten by the daemon on every plan change; do not edit."
# llama-cpp-python runs one request at a time (it serialises on its model lock).
# Connections a client may hold open beyond the instances and the queue (idle keep-alives).
SPARE_CONNECTIONS = 256

_BUSY_BODY = ('{"error":{"message":"numa-infer: every instance is busy and the queue is full or the wait ran out; '
              'retry later","type":"server_busy","code":503}}')


def server_name(instance_name: str) -> str:
    # HAProxy names allow letters, digits, - _ . : (not the "@" of a unit instance name).
    return instance_name.replace("@", "-")


CONFIG_NAME = "haproxy.cfg"
STATE_NAME = "haproxy.state"


@dataclass(frozen=True)
class Paths:
    config: Path  # haproxy.cfg
    state: Path  # server states kept across reloads
    socket: Path  # runtime API (admin level)


def paths_in(run_dir: Path, socket: Path) -> Paths:
    """The files in the directory the daemon (or `check`, in a scratch one) writes them to."""
    return Paths(run_dir / CONFIG_NAME, run_dir / STATE_NAME, socket)


def render_haproxy(config: Config, plan: Plan, paths: Paths) -> str:
    front: FrontendSection = config.frontend
    host, port = front.address
    bind = host_port(host, port)
    target = connect_host(config.server.host)
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
    lines += _affinity(front)
    for instance in plan.instances:
        lines.append(f"    server {server_name(instance.name)} {host_port(target, instance.port)}")
    return "\n".join(lines) + "\n"


def _affinity(front: FrontendSection) -> list[str]:
    """The first turn goes where leastconn sends it; later turns follow it (stick table),
    to the instance whose KV cache already holds the conversation's prompt prefix."""
    if front.affinity == Affinity.NONE:
        return []
    key = (f"req.hdr({front.affinity_header})" if front.affinity == Affinity.HEADER
           else "req.body,json_query('$.user')")
    return [f"    stick-table type string len 128 size 1m expire {_ms(front.affinity_expire_s)}", f"    stick on {key}"]


def _ms(seconds: float) -> str:
    return f"{max(int(seconds * 1000), 1)}ms"
