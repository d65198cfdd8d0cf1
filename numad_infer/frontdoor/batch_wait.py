"""A queue deadline per class: batch requests may wait longer than interactive
ones (`frontend.batch_queue_timeout_s` above `queue_timeout_s`). Pure.

HAProxy 2.6 has one `timeout queue` per backend (a deadline per request,
`http-request set-timeout queue`, is HAProxy 3.4's), and its queue is the one place where
an interactive request can pass a batch one. So the backend's queue keeps the interactive
deadline, and a batch request (the gate's `txn.batch`, tenants.py) does not enter it while
the backend is full: it waits at the backend's top, in a Lua action of HAProxy's own
(`numa_batch_wait`, in the Lua file HAProxy loads), looking every STEP_MS for room, until
its deadline counted from its arrival; past it, the JSON 503 with Retry-After. Room: a free
slot on a server in rotation, less the requests in the backend's own queue (a request in a
server's own queue, put there by an affinity, waits for that server alone). Batch requests
waiting there go in arrival order (the first `room` of them go), and an interactive request
that arrives meanwhile goes straight to the queue, ahead of them: the class order holds.
Let in with room, a batch request takes the slot at once, unless an interactive one
arrived in the same instant: then it waits in the queue, in its class
(`set-priority-offset`), within the interactive deadline. With no instance in rotation a
batch request's hold (hold.py) lasts the batch deadline too, and counts against it.

What it costs:
- only batch requests, and only while their backend is full, run the action past its first
  look (a read of each server's counters, ~10 µs a server); each one waiting reads them
  again every STEP_MS, under the Lua lock all of HAProxy's Lua shares;
- a slot freed while only batch requests wait stays idle until the first of them looks
  again: STEP_MS / 2 on average, small beside an LLM request's seconds;
- waiting there, a batch request is counted as queued in status, as the hold's are
  (haproxy.BackendStat), and at most `frontend.queue_size` wait there at once: one more
  gets the 503 at once, as with a full queue;
- a request whose client left is dropped by HAProxy mid-wait without running the rest of
  the action: its entry stops being refreshed and is forgotten after STALE_MS, until when it
  still counts as ahead of the others.

A request that comes back through the hold server (its instance died under it, hold.py)
waits there up to queue_timeout_s, whatever its class.

An interactive reserve (`tuning.interactive_reserve`, default 1 slot): while the backend
saw an interactive request in the last RECENT_MS (5 to 10 s: HAProxy's rate over 5 s
periods), batch requests hold at most every slot
in rotation less that many (counted in a stick table, FLIGHT, from the backend's last rule
to the end of the answer), so an interactive request finds a free slot. The queue's order
alone is not enough: a client that sends its next
request when its answer comes finds the slot it freed taken by the head of the batch queue,
and waits for the next slot to free (over real engines: 181 ms at p50 against batch's 555,
bench/README.md). Never every slot (batch keeps at least one, so it never starves); and
only while interactive requests come: a host of batch alone loses nothing. An interactive
request is counted in a stick table, SEEN (HAProxy's own tracking, not one more Lua
action beside the token filter: docs/design/batch-wait.md says why).

Rendered only where it changes anything: with `[[tenants]]` (which give a request its
class) and a batch deadline longer than the interactive one, or a reserve.
"""

from __future__ import annotations

from collections.abc import Sequence

from numad_infer.config.frontend import FrontendSection
from numad_infer.config.tenants import TenantEntry
from numad_infer.frontdoor import answers, names
from numad_infer.frontdoor.tenants import IS_BATCH

ACTION = names.BATCH_WAIT
STEP_MS = 20
GRANT_MS = 250
STALE_MS = 1000
RECENT_MS = 10_000
SEEN = names.INTERACTIVE_SEEN  # a stick table: interactive requests in the last RECENT_MS, per backend
LANDED = names.BATCH_LANDED
FLIGHT = names.BATCH_FLIGHT  # a stick table: batch requests let go and not yet answered, per backend
_REFUSED = names.BATCH_REFUSED
_GRANT = names.BATCH_GRANT

# The batch wait's Lua (lua/numa-infer-batch.lua) and what it reads from the data file (lua.py),
# besides the names it shares with the rules (names.py).
LUA_FILE = "numa-infer-batch.lua"
LUA_DATA: dict[str, str | int] = {"batch.step_ms": STEP_MS, "batch.stale_ms": STALE_MS, "batch.grant_ms": GRANT_MS}


def applies(front: FrontendSection, tenants: Sequence[TenantEntry]) -> bool:
    """Batch requests wait apart: tenants give classes, and batch has a longer deadline or
    interactive requests a reserve."""
    return bool(tenants) and (front.batch_deadline_s > front.queue_timeout_s or front.interactive_reserve > 0)


def rules(front: FrontendSection, tenants: Sequence[TenantEntry], arriving: str) -> list[str]:
    """A model backend's rules, after the hold's: a batch request (the gate said its class)
    arriving while the backend is full waits for room, up to the batch deadline; one
    that waited that long, or found queue_size waiting already, gets the JSON 503.
    `arriving`: the ACL of a request entering from the main frontend (one let go by the hold
    waited already)."""
    if not applies(front, tenants):
        return []
    seen = [f"    http-request track-sc2 be_name table {SEEN} if !{IS_BATCH} {arriving}"] \
        if front.interactive_reserve else []
    return [*seen,
            f"    http-request lua.{ACTION} {int(front.batch_deadline_s * 1000)} {front.queue_size} "
            f"{front.interactive_reserve} if {IS_BATCH} {arriving}",
            answers.busy(f"{{ var({_REFUSED}) -m bool }}")]


def landed_rules(front: FrontendSection, tenants: Sequence[TenantEntry]) -> list[str]:
    """The backend's last http-request rules: a batch request let go reached them, and
    HAProxy counts it at a server next, in the same pass (so it stops counting as let go).
    From here until its answer ends, it counts in FLIGHT (the interactive reserve's count
    of batch's slots)."""
    if not applies(front, tenants):
        return []
    let_go = f"{{ var({_GRANT}) -m found }}"
    return [f"    http-request track-sc1 be_name table {FLIGHT} if {let_go}",
            f"    http-request lua.{LANDED} if {let_go}"]


def tables(front: FrontendSection, tenants: Sequence[TenantEntry], backends: int) -> list[tuple[str, str]]:
    """The stick tables of batch requests let go and of interactive requests' arrivals, one
    entry per model's backend: (the backend that holds it, its line)."""
    if not applies(front, tenants):
        return []
    return [(FLIGHT, f"    stick-table type string len 64 size {backends} store conn_cur"),
            # A rate over 5 s periods is above 0 for 5 to 10 s after the last request.
            (SEEN, f"    stick-table type string len 64 size {backends} store http_req_rate({RECENT_MS // 2000}s)")]
