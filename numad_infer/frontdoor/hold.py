"""The hold: a request for a model none of whose instances is in rotation waits for one.

HAProxy queues a request only while some server of its backend is up and full: with none
up (the only instance of a model restarting, drained for a restart, crashed, hung) it
answers 503 at once. On a host with one instance that is every restart numa-infer makes
(issue 40: 6,740 of 7,369 requests refused during one 10 s roll-out).

So each model's backend has one more server, a `backup` that HAProxy uses only while none
of the backend's own servers is in rotation (up, not drained, not in maintenance): the
hold server. It is HAProxy itself, a listener on a Unix socket beside its runtime API's
(the `hold` frontend), where a Lua action of HAProxy's own (Debian's HAProxy is built with Lua;
this file is the script) waits, in 50 ms steps, until the backend has a server in
rotation again, up to `frontend.queue_timeout_s`. Then the request goes to that backend
once more, and from there to the instance that is back; past the limit it gets the JSON
503 with Retry-After. HAProxy still does all the routing; nothing is proxied here. What
it keeps bounded, as the queue is: the hold server takes `frontend.queue_size` requests
per backend, and those beyond wait in the backend's queue, whose own bound answers 503.

Why a server and not a rule at the backend's top (what numa-infer first did): a rule runs
once, when the request enters the backend, so it saw only what arrived while no server
was in rotation. A request that HAProxy had already given to the only instance when it
died (waiting in the queue for its slots, or sent in the instant before HAProxy saw it
dead) met a refused connection; redispatched, it found no server and got a 503 at once.
Sent to the same server again instead, it reached the replacement as soon as it listened:
llama-server listens before its model is loaded and answers 503 "Loading model" until
then (a model of a few GB takes seconds), and HAProxy 2.6 retries a 503 at once, not a
second later (30 retries in 10 ms, measured). A backup server is chosen at each
redispatch as at the first dispatch, so a refused request now goes where a new one goes:
the first refused connection marks the instance down (`observe layer4`), the retry a
second later finds the hold server, and the held request is let go once HAProxy's own
check of the new instance passes, which llama-server's /health does only once its model
is loaded.

Only connection failures are retried: a POST the instance had received is still not
replayed. It may be what killed it, and replayed it would crash the instance again at
each restart within the hold (about three times in 30 s under the default
`restart_backoff_s` of 5 s, doubling), bringing it nearer `max_restarts`. So the request
the killed process was answering gets a JSON 502, which OpenAI's clients retry by default
(`max_retries = 2`), into the hold.

`/healthz` is answered in the frontend, before any backend, from the same count the hold
waits on (`lua.numa_in_rotation`: HAProxy's `nbsrv` counts a backup server when no other
is up, so it would say 200 during a hold): during a hold it says 503, so an outer
balancer can send the traffic to another host.

What a held request costs the figures: it passes through its model's backend twice, once
to the hold server and once, let go, to an instance. So the runtime API's backend counts
see it twice while it is answered. haproxy.BackendStat takes the hold server's sessions
out of what is in flight and counts them as waiting: exact while a request waits, and once
let go it is counted on its instance too, until its answer ends."""

from __future__ import annotations

from pathlib import Path

from numad_infer.config.frontend import FrontendSection

HOLD_NAME = "hold.lua"
ACTION = "numa_hold"
FETCH = "numa_in_rotation"
FRONTEND = "hold"
HOLD_PREFIX = "hold-"  # the hold server of backend B is "hold-B"; an instance's is named by its unit
STEP_MS = 50  # how often a held request looks again: what a hold adds to the wait, at most
_LET_GO = "txn.hold_let_go"
# An ACL: the request enters its backend from the main frontend, not let go by the hold
# (the bounds a request meets on arrival are not met again after it waited).
ARRIVING = f"!{{ fe_name {FRONTEND} }}"

HOLD_LUA = f"""-- numa-infer's hold (numad_infer/frontdoor/hold.py): written by the daemon, do not edit.
-- The servers of a backend in rotation: up, not drained, not in maintenance, backups left
-- out (the hold server is one, and always up).
local function in_rotation(name)
  local backend = core.backends[name]
  if backend == nil then return 0 end
  return tonumber(backend:get_stats()["act"]) or 0
end

local function now_ms()
  local t = core.now()
  return t.sec * 1000 + t.usec // 1000
end

core.register_fetches("{FETCH}", function(txn, name) return in_rotation(name) end)

-- In the hold frontend: the listener's name is the backend the request came from. Wait
-- until it has a server in rotation, up to the limit; say whether it has one.
core.register_action("{ACTION}", {{"http-req"}}, function(txn, timeout_ms)
  local backend = txn.f:so_name()
  local deadline = now_ms() + tonumber(timeout_ms)
  while in_rotation(backend) == 0 and now_ms() < deadline do
    core.msleep({STEP_MS})
  end
  if in_rotation(backend) > 0 then txn:set_var("{_LET_GO}", true) end
end, 1)
"""


def hold_server(backend: str) -> str:
    """The name of the backend's hold server."""
    return f"{HOLD_PREFIX}{backend}"


def socket_of(directory: Path, index: int) -> Path:
    """The hold listener of the index-th backend, in `directory`: the runtime API socket's,
    which HAProxy's user may write to (it binds there, as a new name renamed into place on a
    reload). Numbered, not named by the backend: a Unix socket's path is at most 107 bytes,
    a model's name up to 64."""
    return directory / f"hold-{index}.sock"


def server_line(backend: str, socket: str, front: FrontendSection) -> str:
    """The backend's hold server: a backup (used only while no other server is in rotation),
    never checked (it is HAProxy), taking up to queue_size requests. `socket`: its path as
    an HAProxy word."""
    return f"    server {hold_server(backend)} unix@{socket} backup no-check maxconn {front.queue_size}"


def hold_frontend(listeners: list[tuple[str, str]], front: FrontendSection, busy: str,
                  priority: list[str]) -> list[str]:
    """The frontend behind every hold server: one listener per backend, named by it
    (`listeners`: backend, socket path as an HAProxy word). A request let go goes back to its
    backend; one that waited the whole limit gets `busy` (the JSON 503) with Retry-After. Not
    logged: the request's own line, from the main frontend, covers it. `priority`: the rules
    that queue it again in its class (tenants.held_priority)."""
    return ["frontend " + FRONTEND,
            *(f"    bind unix@{socket} name {backend} mode 600" for backend, socket in listeners),
            "    no log",
            f"    http-request lua.{ACTION} {int(front.queue_timeout_s * 1000)}",
            f"    http-request return status 503 content-type application/json string '{busy}' "
            f"hdr Retry-After 1 if !{{ var({_LET_GO}) -m bool }}",
            *priority,
            "    use_backend %[so_name]"]


def in_rotation(backend: str) -> str:
    """An ACL: the backend has a server in rotation (what the hold waits for)."""
    return f"{{ lua.{FETCH}({backend}) -m int ge 1 }}"


def retry_rules() -> list[str]:
    """A model backend's retries: up to 3, each dispatched again (`redispatch`), so a
    request refused by a dead instance goes where a new one goes: another instance, or the
    hold server when there is none (the module says why)."""
    return ["    retries 3",
            "    option redispatch 1",
            "    retry-on conn-failure empty-response",
            # A POST that reached a server is not replayed: it may be what killed it.
            "    http-request disable-l7-retry if !METH_GET"]
