"""The hold: a request for a model none of whose instances is in rotation waits for one.

HAProxy queues a request only while some server of its backend is up and full: with none
up (the only instance of a model restarting, drained for a restart, crashed, hung) it
answers 503 at once. On a host with one instance that is every restart numa-infer makes
(nearly every request of a roll-out refused: bench/README.md, "One instance restarted
under load"). The hold is a Lua script of HAProxy's own (Debian's HAProxy is built with
Lua), in a file the daemon writes beside haproxy.cfg: HAProxy still does all the routing;
nothing is proxied here.

Two ways in, one wait (`wait_for`: look again every 50 ms until the backend has a server
in rotation, up to `frontend.queue_timeout_s`, or a batch request's own deadline where it
has a longer one, batch_wait.py; past it, the JSON 503 with Retry-After):

1. A request that arrives while no server is in rotation: the backend's first action
   (`numa_hold`) holds it there, in its own stream. Let go, it goes on through the backend
   as any request (its class in the queue, its line in the request log, the abandon watch
   able to end it). At most `frontend.queue_size` wait per backend; the next gets the 503
   at once, as with a full queue. The count is a table of deadlines, not a counter: a
   request whose client left mid-wait is dropped by HAProxy without running the rest of
   the action, and its entry simply expires.
2. A request HAProxy had already given to the only instance when it died (sent in the
   instant before HAProxy saw it dead, or handed the slot the dead process's request left)
   meets a refused connection, past that action. (Those still in the backend's queue stay
   there, and the replacement takes them once it is up, within `timeout queue`.) It must
   not simply be sent again to the same server: llama-server listens before its model is
   loaded and answers 503 "Loading model" until then, and HAProxy 2.6 retries a 503 at
   once (docs/design/hold.md has what was tried). So each model's backend has one more
   server, a `backup`, which HAProxy chooses only while none of the backend's own servers
   is in rotation, at a redispatch as at a first dispatch: the hold server. It is HAProxy
   itself, a listener on a Unix socket beside its runtime API's (the `hold` frontend),
   whose action (`numa_hold_again`) waits, then sends the request back to its backend.
   The first refused connection marks the instance down (`observe layer4`), the retry a
   second later goes to the hold server, and the request is let go once HAProxy's own
   check of the replacement passes, which llama-server's /health does only once its model
   is loaded. The hold server takes up to `frontend.queue_size`; more
   wait in its queue, within `timeout queue`. A request let go that is refused again (an
   instance that died again at once) goes back to the hold server for another wait: at
   most queue_size such waits at a time, each up to the limit.

What the second way costs, for the few requests that take it: they pass through their
backend twice, and the second time no key is read, so the gate says a batch request's
class in a header it sets itself (its queue offset, tenants.held_priority, and the limit
of its wait go by it); the runtime API's backend counts see such a request twice while it
is answered (haproxy.BackendStat counts the hold server's sessions as waiting, not in
flight: exact while they wait, and once let go the request is counted both waiting and at
its instance until answered); its log line names the hold server; and the abandon watch
cannot end it once let go (its client is HAProxy).

Only connection failures are retried: a POST the instance had received is still not
replayed. It may be what killed it, and replayed it would crash the instance again at
each restart within the hold (about three times in 30 s under the default
`restart_backoff_s` of 5 s, doubling), bringing it nearer `max_restarts`. So the request
the killed process was answering gets a JSON 502, which OpenAI's clients retry by default
(`max_retries = 2`), into the hold.

`/healthz` is answered in the frontend, before any backend, from the count the hold waits
on (`lua.numa_in_rotation`: HAProxy's `nbsrv` counts the backup when no other server is
up, so it would say 200 during a hold): during a hold it says 503, so an outer balancer
can send the traffic to another host."""

from __future__ import annotations

from pathlib import Path

from numad_infer.config.frontend import FrontendSection
from numad_infer.frontdoor import answers, names

ACTION = names.HOLD_ACTION
AGAIN = names.HOLD_AGAIN
FETCH = names.IN_ROTATION
FRONTEND = "hold"
HOLD_PREFIX = "hold-"  # the hold server of backend B is "hold-B"; an instance's is named by its unit
STEP_MS = 50  # how often a held request looks again: what a hold adds to the wait, at most
_LET_GO = names.HOLD_LET_GO
_REFUSED = names.HOLD_REFUSED
# An ACL: the request enters its backend from the main frontend, not let go by the hold
# frontend (the bounds a request meets on arrival are not met again after it waited).
ARRIVING = f"!{{ fe_name {FRONTEND} }}"

# The hold's Lua (lua/numa-infer-hold.lua) and what it reads from the data file (lua.py),
# besides the names it shares with the rules (names.py).
LUA_FILE = "numa-infer-hold.lua"
LUA_DATA: dict[str, str | int] = {"hold.step_ms": STEP_MS}


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


def _per_class(wait: str, front: FrontendSection, batch: str | None) -> list[str]:
    """A wait rule (`wait`, with {} for its limit in ms) limited by queue_timeout_s, or, where
    `batch` (an ACL) names the requests of a class with a deadline of its own, one rule for
    each class."""
    interactive = wait.format(int(front.queue_timeout_s * 1000))
    if batch is None:
        return [interactive]
    return [f"{interactive} if !{batch}", f"{wait.format(int(front.batch_deadline_s * 1000))} if {batch}"]


def hold_rules(front: FrontendSection, batch: str | None = None) -> list[str]:
    """A model backend's rules, after the bound on its queue: a request arriving while none
    of its servers is in rotation waits here, in its own stream; one that waited the whole
    limit, or found queue_size requests waiting already, gets the JSON 503. `batch`:
    the ACL of a batch request where that class has a longer deadline of its own
    (batch_wait.py), which its hold lasts instead."""
    return [*_per_class(f"    http-request lua.{ACTION} {{}} {front.queue_size}", front, batch),
            answers.busy(f"{{ var({_REFUSED}) -m bool }}")]


def hold_frontend(listeners: list[tuple[str, str]], front: FrontendSection,
                  priority: list[str], batch: str | None = None) -> dict[str, list[str]]:
    """The frontend behind every hold server: one listener per backend, named by it
    (`listeners`: backend, socket path as an HAProxy word). A request let go goes back to its
    backend; one that waited the whole limit gets the JSON 503 with Retry-After. Not
    logged: the request's own line, from the main frontend, covers it. `priority`: the rules
    that queue it again in its class (tenants.held_priority). `batch`: the ACL of a batch
    request here (the gate's header: no variable crosses the socket) where that class has a
    longer deadline of its own, which its wait lasts instead; counted from its arrival here,
    as it was dispatched again, not from its first arrival (which this stream cannot see).
    Its lines by phase (phases.HOLD); the caller adds the section's header."""
    return {"accept": [*(f"    bind unix@{socket} name {backend} mode 600" for backend, socket in listeners),
                       "    no log"],
            "wait": [*_per_class(f"    http-request lua.{AGAIN} {{}}", front, batch),
                     answers.busy(f"!{{ var({_LET_GO}) -m bool }}")],
            "classify": priority,
            "route": ["    use_backend %[so_name]"]}


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
