"""haproxy.cfg from the plan: pure (config + plan -> text). The daemon's `frontdoor.Frontdoor`
writes it and drives the running HAProxy; `numa-infer check` validates it.

Why these HAProxy settings:
- `maxconn` per server = what the engine serves at once (`Engine.slots`: 1 for
  llama-cpp-python, `server.parallel` for llama-server): one more request would wait
  inside the server, where no other instance can take it. HAProxy queues it instead and
  gives it to whichever instance frees up first (`balance leastconn`).
- `observe layer4 ... on-error mark-down`: with least connections a dead server has the
  fewest connections, so retries would go straight back to it; a refused connection
  takes it out of rotation at once.
- `retry-on conn-failure empty-response` + `option redispatch 1` +
  `http-request disable-l7-retry` for all but GET/HEAD (nginx's default for
  non-idempotent requests): a request that never reached a server (connection refused)
  is sent again, to another server every time; a POST that reached one is never replayed,
  so a prompt that crashes llama.cpp crashes one instance, not every instance in turn.
  Its client gets a JSON 502. Where no other server is in rotation (a model's
  only instance died), "another server" is the hold server, which waits for one (hold.py).
- every answer HAProxy makes itself (400, 408, 429, 500, 501, 502, 503, 504) is JSON in
  OpenAI's error shape: an OpenAI client parses the body of a failure, and HAProxy's
  default pages are HTML.
- affinity on the `user` field or on the prompt's prefix (affinity.py): HAProxy reads the
  body from its buffer only, sized for the longest prompt an instance accepts (`body_buffer`).
- with `[[models]]`, one backend per model and the frontend routes by the body's `model`
  (routing.py says why).
- health checks on the engine's path that never waits on the model
  (`Engine.liveness_path`): a busy server is not a down server.
- `load-server-state-from-file`: a reload keeps the drain/maint states the daemon set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from numad_infer.config.frontend import Affinity, FrontendSection
from numad_infer.config.models import ServedModel
from numad_infer.config.schema import Config
from numad_infer.engines import Engine
from numad_infer.errors import ConfigError
from numad_infer.frontdoor import (
    affinity,
    answers,
    api_paths,
    batch_wait,
    client_limits,
    hold,
    lua,
    names,
    phases,
    routing,
    tenants,
    token_count,
)
from numad_infer.frontdoor.phases import Section, rules
from numad_infer.frontdoor.routing import BACKEND as BACKEND  # the single form's, named here first
from numad_infer.frontdoor.routing import BODY_TIMEOUT, backend_of, routed
from numad_infer.plan.model import Instance, Plan
from numad_infer.systemd.unitnames import FRONTDOOR_FD_VARIABLE as FD_VARIABLE
from numad_infer.systemd.unitnames import FRONTDOOR_TWIN_FD_VARIABLE as TWIN_FD_VARIABLE
from numad_infer.util.addresses import connect_host, host_port

OWNER = "haproxy_config"  # this module, as phases.Rules name it
FRONTEND = "openai"  # the one listener; the daemon closes it first on stop (Frontdoor.close)
MARKER = "# Managed by numa-infer: rewritten by the daemon on every plan change; do not edit."
# llama-cpp-python runs one request at a time (it serialises on its model lock).
# Connections a client may hold open beyond the instances and the queue (idle keep-alives).
SPARE_CONNECTIONS = 256


# affinity = "user": HAProxy's json_query sees only the body in its buffer (16 KiB by
# default), and OpenAI clients send `user` after `messages`. The buffer holds the longest
# prompt an instance accepts: context_size tokens at 8 bytes each (JSON escapes, non-Latin
# scripts), plus room for the headers. A longer body is served, by the least busy instance.
_BYTES_PER_TOKEN = 8
_HEADER_ROOM = 16 * 1024
_MIN_BUFFER = 64 * 1024


def server_name(instance_name: str) -> str:
    # HAProxy names allow letters, digits, - _ . : (not the "@" of a unit instance name).
    return instance_name.replace("@", "-")


SPARE_PREFIX = "surge-"  # an instance's server is named by its unit: "infer-0", never this


def surge_server(backend: str) -> str:
    """The backend's spare server, where a copy of the model's only instance serves while
    that instance restarts (supervision/surge.py). Declared disabled at a placeholder
    address: the daemon points it at the copy's port and puts it in rotation."""
    return f"{SPARE_PREFIX}{backend}"


CONFIG_NAME = "haproxy.cfg"
# HAProxy's timing line per request, to the daemon's socket of this name (request_log.py
# reads it): the server, the status/how the stream ended (%ts: "C" or "K" first, its client
# left), in one word so that old lines keep their length, the time to the first byte of the
# answer's body (a variable the backend sets) and %Ta, the request's whole active time, both
# in ms. With [[tenants]], then the tenant whose key it carried ("-": none), from the key
# file's map, and the answer's prompt and completion tokens as the engine reported them (token_count.py).
REQUEST_LOG_NAME = "requests.sock"
REQUEST_LOG_FORMAT = f"%s %ST/%ts %[var({names.FIRST_BYTE_MS})] %Ta"
TENANT_LOG_FORMAT = (f"{REQUEST_LOG_FORMAT} %[var({tenants.VARIABLE})] "
                     + " ".join(f"%[var({v})]" for v in token_count.TOKEN_VARIABLES))  # "-" where not read
STATE_NAME = "haproxy.state"


@dataclass(frozen=True)
class Paths:
    config: Path  # haproxy.cfg
    state: Path  # server states kept across reloads
    socket: Path  # runtime API (admin level)
    requests: Path | None = None  # where HAProxy sends one timing line per request (request_log.py)

    @property
    def lua(self) -> Path:
        """The Lua file HAProxy loads (lua.py), beside haproxy.cfg: whoever writes the one writes the other."""
        return self.config.with_name(lua.NAME)

    @property
    def homes(self) -> Path:
        """The prefix keys' homes the last HAProxy had, read by the next (affinity.py)."""
        return self.config.with_name(affinity.HOMES_NAME)

    @property
    def keys(self) -> tuple[Path, Path]:
        """The tenants' keys and the instances' key, beside haproxy.cfg (tenants.py)."""
        return tenants.files(self.config.parent)


@dataclass(frozen=True)
class CheckedConfig:
    """haproxy.cfg as `haproxy -c` passed it (checked_config.py), and the files it names."""

    paths: Paths  # the directory it was rendered for: the front door writes it only there
    text: str
    # tenant-keys.map and upstream-key.map's texts (tenants.py), written with it, readable by
    # HAProxy's user alone; never in a repr.
    keys: tuple[str, str] = field(default=(tenants.HEADER, tenants.HEADER), repr=False)


def write_config(paths: Paths, text: str) -> None:
    """haproxy.cfg and its Lua (lua.files) written in place (`check`'s scratch copy, tests; control.py renames)."""
    for name, lua_text in lua.files().items():
        paths.config.with_name(name).write_text(lua_text, encoding="utf-8")
    for path in paths.keys:
        if not path.exists():
            path.write_text(tenants.HEADER, encoding="utf-8")
    paths.config.write_text(text, encoding="utf-8")


def paths_in(run_dir: Path, socket: Path) -> Paths:
    """The files in the directory the daemon (or `check`, in a scratch one) writes them to."""
    return Paths(run_dir / CONFIG_NAME, run_dir / STATE_NAME, socket, run_dir / REQUEST_LOG_NAME)


# HAProxy expands the variable in a quoted word: its copy of the daemon's socket, and of the
# one on the other loopback address (listener.py).
HELD_BIND = '"fd@${' + FD_VARIABLE + '}"'
TWIN_BIND = '"fd@${' + TWIN_FD_VARIABLE + '}"'


def render_haproxy(config: Config, plan: Plan, paths: Paths, held: bool = False, twin: bool = False, *,
                   served: tuple[ServedModel, ...], engine: Engine) -> str:
    """haproxy.cfg for this plan. `held`: the daemon holds the listening socket and HAProxy
    takes it as the inherited descriptor that NUMA_INFER_FRONTDOOR_FD names (listener.py
    says why), instead of binding the address itself (`check`'s scratch copy does). `twin`:
    it holds one on the other loopback address too, in NUMA_INFER_FRONTDOOR_TWIN_FD.

    One backend per model (routing.py), named by the model's key: the single `[model]`
    form's is `instances`. `served`, `engine`: the models and engine the one load worked
    out (validate/pipeline.py)."""
    return phases.render(MARKER, sections(config, plan, paths, held, twin, served=served, engine=engine))


def sections(config: Config, plan: Plan, paths: Paths, held: bool = False, twin: bool = False, *,
             served: tuple[ServedModel, ...], engine: Engine) -> list[Section]:
    """haproxy.cfg as data (phases.py): each section's phases and the rules each feature gives
    them, in the file's order (render_haproxy's arguments)."""
    front: FrontendSection = config.frontend
    # Each backend queues up to queue_size requests of its own, holds as many arriving, and
    # as many more on its hold server, each of those two connections (hold.py).
    maxconn = (sum(len(_instances_of(plan, s)) * engine.slots(s.view) for s in served)
               + 4 * len(served) * front.queue_size + SPARE_CONNECTIONS)
    holds = [(backend_of(s), quoted(hold.socket_of(paths.socket.parent, n))) for n, s in enumerate(served)]
    result = [phases.section("global", phases.SETTINGS, rules("settings", OWNER, _global(config, served, paths,
                                                                                         maxconn))),
              phases.section("defaults", phases.SETTINGS, rules("settings", OWNER, _defaults(front)),
                             rules("answers", "answers", answers.http_errors())),
              _frontend(config, served, paths, held, twin)]
    result += [_backend(config, engine, model, _instances_of(plan, model), socket)
               for model, (_, socket) in zip(served, holds, strict=True)]
    batch = tenants.HELD_BATCH if batch_wait.applies(front, config.tenants) else None
    hold_rules = hold.hold_frontend(holds, front, tenants.held_priority(config.tenants, front.batch_delay_s), batch)
    result.append(phases.section(f"frontend {hold.FRONTEND}", phases.HOLD,
                                 *(rules(phase, "tenants" if phase == "classify" else "hold", lines)
                                   for phase, lines in hold_rules.items())))
    tables = [("tenants", tenants.table(config.tenants)),
              ("batch_wait", batch_wait.tables(front, config.tenants, len(served))),
              ("client_limits", client_limits.table(front))]
    result += [phases.section(f"backend {name}", phases.TABLE, rules("table", owner, [line]))
               for owner, found in tables for name, line in found]
    return result


def _frontend(config: Config, models: tuple[ServedModel, ...], paths: Paths, held: bool, twin: bool) -> Section:
    """The one listener: where a request is accepted, checked and sent to its model's backend."""
    front = config.frontend
    host, port = front.address
    by_model = routed(models)
    to = (routing.to_backend(models, body_buffer(models)) if by_model
          else [f"    default_backend {backend_of(models[0])}"])
    return phases.section(
        f"frontend {FRONTEND}", phases.FRONTEND,
        rules("accept", OWNER, [f"    bind {HELD_BIND if held else host_port(host, port)}",
                                *([f"    bind {TWIN_BIND}"] if held and twin else []),
                                *_timing_log(paths, bool(config.tenants))]),
        rules("accept", "client_limits", client_limits.rules(front)),
        rules("health", "routing", routing.health(models, front.health_path) if front.health_path else []),
        # Only the inference API reaches an instance (api_paths.py), whoever sends it.
        rules("paths", "api_paths", api_paths.rules(by_model)),
        rules("authenticate", "tenants", tenants.gate(config.tenants, quoted(paths.keys[0]), quoted(paths.keys[1]),
                                                      bool(config.server.api_key_file), front.batch_delay_s)),
        rules("models", "tenants", tenants.model_lists(config.tenants, models)),
        rules("models", "routing", routing.model_answers(models) if by_model else []),
        rules("route", "routing", to))


def _instances_of(plan: Plan, model: ServedModel) -> list[Instance]:
    return [i for i in plan.instances if i.model == model.ident]


def _backend(config: Config, engine: Engine, model: ServedModel, instances: list[Instance],
             hold_socket: str) -> Section:
    """One model's backend: its servers, each taking as many requests as that model's engine
    has slots (`parallel` of its view), and its hold server (`hold_socket`: the hold
    listener's path as an HAProxy word)."""
    front = config.frontend
    backend = backend_of(model)
    target = connect_host(config.server.host)
    batch = batch_wait.applies(front, config.tenants)
    servers = [server_name(i.name) for i in instances]
    return phases.section(
        f"backend {backend}", phases.BACKEND,
        rules("balance", "affinity", [affinity.BALANCE]),
        rules("authorize", "tenants", tenants.model_rule(config.tenants, model)),
        rules("answer", OWNER, _first_byte(front)),
        rules("answer", "token_count", token_count.rules(config.tenants)),
        # Needed for retries (the request is replayed from the buffer) and for json_query.
        rules("retry", OWNER, ["    option http-buffer-request"]),
        rules("retry", "hold", hold.retry_rules()),
        rules("admit", OWNER, [answers.queue_full(backend, front.queue_size, hold.ARRIVING)]),
        rules("admit", "tenants", tenants.counted(config.tenants)),
        # No instance in rotation (the only one restarting): wait for one, not a 503 (hold.py).
        rules("wait", "hold", hold.hold_rules(front, tenants.IS_BATCH if batch else None)),
        # A batch request's own deadline: it waits for room before the queue (batch_wait.py).
        rules("wait", "batch_wait", batch_wait.rules(front, config.tenants, hold.ARRIVING)),
        rules("check", OWNER, [f"    option httpchk GET {engine.liveness_path}", "    http-check expect status 200",
                               f"    default-server check inter 2s fastinter 500ms fall 2 rise 1 maxconn "
                               f"{engine.slots(model.view)} observe layer4 error-limit 1 on-error mark-down"]),
        rules("pick", "affinity", affinity.picks(front, backend)),
        rules("admit again", "affinity", affinity.admit_again(front, backend)),
        # The last http-request rules: a batch request let go is counted at a server from here.
        rules("land", "batch_wait", batch_wait.landed_rules(front, config.tenants)),
        rules("use", "affinity", affinity.uses(front, [*servers, surge_server(backend)])),
        rules("servers", OWNER, [*(f"    server {server_name(i.name)} {host_port(target, i.port)}" for i in instances),
                                 # Out of rotation (and unchecked) until a surge points it at a copy: port 1.
                                 f"    server {surge_server(backend)} {host_port(target, 1)} disabled"]),
        # No instance in rotation (the only one restarting): wait for one, not a 503 (hold.py).
        rules("servers", "hold", [hold.server_line(backend, hold_socket, front)]))


def _timing_log(paths: Paths, by_tenant: bool) -> list[str]:
    """One line per request to the daemon (request_log.py): the server, the status, the
    time to the first byte of the answer's body and the request's whole active time.
    Traffic is logged at `info`; the global stderr log keeps `notice` and above, so these
    lines never reach the journal."""
    if paths.requests is None:
        return []
    return [f"    log {_socket_address(paths.requests)} len 1024 format raw local0 info",
            f'    log-format "{TENANT_LOG_FORMAT if by_tenant else REQUEST_LOG_FORMAT}"',
            f"    http-request set-var({names.STARTED_MS}) date(0,ms)"]


def _first_byte(front: FrontendSection) -> list[str]:
    """Hold the answer until the first byte of its body has come from the instance, then
    note the time (request_log.py says why). A stream's headers leave llama-server before
    any token; from here on, a client's first byte comes with its first token."""
    return [f"    http-response wait-for-body time {_ms(front.request_timeout_s)} at-least 1",
            f"    http-response set-var({names.FIRST_BYTE_MS}) date(0,ms),sub({names.STARTED_MS})"]


def _global(config: Config, served: tuple[ServedModel, ...], paths: Paths, maxconn: int) -> list[str]:
    lines = [f"    maxconn {maxconn}",
             # 660: HAProxy runs as its own user; the daemon reaches the socket as root (process
             # backend) or through HAProxy's group (systemd, where it has no DAC override).
             # Either way the directory around it is HAProxy's, closed to everyone else.
             f"    stats socket {_socket_address(paths.socket)} mode 660 level admin",
             f"    server-state-file {quoted(paths.state)}",
             f"    lua-load {quoted(paths.lua)}",  # it runs the hold, the pick, the batch wait, the tokens (lua.py)
             # Server up/down changes reach the journal (or the process backend's log file).
             "    log stderr format short local0 notice",
             *token_count.global_rules(config.tenants)]
    if config.frontend.affinity in (Affinity.USER, Affinity.PREFIX) or routed(served):
        lines.append(f"    tune.bufsize {body_buffer(served)}")
    return lines


def _defaults(front: FrontendSection) -> list[str]:
    lines = ["    mode http",
             "    log global",
             "    option dontlognull",
             # A connection closed before a byte of request (a TCP health check of an outer
             # balancer, a port probe) is otherwise answered and counted as a 400: the 4xx
             # the metrics publish would count probes, not clients.
             "    option http-ignore-probes",
             # Each chunk of a stream goes out as it comes, not held back for a fuller
             # packet: measured, a stream's first token reached the client 170 ms later
             # without it (bench/README.md).
             "    option http-no-delay",
             "    timeout connect 2s",
             f"    timeout client {_ms(front.request_timeout_s)}",
             f"    timeout server {_ms(front.request_timeout_s)}",
             f"    timeout queue {_ms(front.queue_timeout_s)}",
             # The body's wait, in the backends (`option http-buffer-request`); the frontend
             # waits tuning.header_timeout_s for the headers (client_limits.py).
             f"    timeout http-request {BODY_TIMEOUT}",
             "    timeout http-keep-alive 10s",
             "    timeout check 2s",
             "    load-server-state-from-file global"]
    return lines


def body_buffer(served: tuple[ServedModel, ...]) -> int:
    """HAProxy's tune.bufsize for affinity = "user" or "prefix" or routing by `model`: the
    longest prompt an instance of any model accepts fits."""
    context = max(s.view.model.context_size for s in served)
    wanted = context * _BYTES_PER_TOKEN + _HEADER_ROOM
    return max(_MIN_BUFFER, -(-wanted // 1024) * 1024)


def quoted(path: Path) -> str:
    """A path as one HAProxy word: double quotes, with \\ " $ escaped (a space, a # or a $
    in the state directory would otherwise split the line, end it, or expand a variable)."""
    text = str(path)
    if any(ord(c) < 0x20 or c == "\x7f" for c in text):
        raise ConfigError(text, None, "contains a control character, which haproxy.cfg cannot hold; "
                          "choose a --state-file in a directory whose path has none")
    return '"' + "".join("\\" + c if c in '\\"$' else c for c in text) + '"'


def _socket_address(path: Path) -> str:
    # HAProxy expands environment variables in a socket address after unquoting it,
    # escaped or not: a "$" cannot be written there.
    if "$" in str(path):
        raise ConfigError(str(path), None, "contains a $, which HAProxy would expand in its admin socket's path; "
                          "choose a --state-file in a directory whose path has none")
    return quoted(path)


def _ms(seconds: float) -> str:
    return f"{max(int(seconds * 1000), 1)}ms"
