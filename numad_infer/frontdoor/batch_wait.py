"""A queue deadline per class (issue 39): batch requests may wait longer than interactive
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

An interactive reserve (`frontend.interactive_reserve`, default 1 slot): while the backend
saw an interactive request in the last RECENT_MS (5 to 10 s: HAProxy's rate over 5 s
periods), batch requests hold at most every slot
in rotation less that many (counted in a stick table, FLIGHT, from the backend's last rule
to the end of the answer), so an interactive request finds a free slot. The queue's order
alone is not enough: a client that sends its next
request when its answer comes finds the slot it freed taken by the head of the batch queue,
and waits for the next slot to free (over real engines: 181 ms at p50 against batch's 555,
bench/README.md). Never every slot (batch keeps at least one, so it never starves); and
only while interactive requests come: a host of batch alone loses nothing. An interactive
request is counted in a stick table, SEEN (HAProxy's own tracking: another Lua action on
every request beside the token filter made HAProxy 2.6 fail the filter, "attempt to index a
number value", in a smoke test under load).

Rendered only where it changes anything: with `[[tenants]]` (which give a request its
class) and a batch deadline longer than the interactive one, or a reserve.
"""

from __future__ import annotations

from collections.abc import Sequence

from numad_infer.config.frontend import FrontendSection
from numad_infer.config.tenants import TenantEntry
from numad_infer.frontdoor.tenants import ARRIVED, IS_BATCH

ACTION = "numa_batch_wait"
STEP_MS = 20
GRANT_MS = 250
STALE_MS = 1000
RECENT_MS = 10_000
SEEN = "numa_interactive"  # a stick table: interactive requests in the last RECENT_MS, per backend
LANDED = "numa_batch_landed"
FLIGHT = "numa_batch_flight"  # a stick table: batch requests let go and not yet answered, per backend
_REFUSED = "txn.batch_refused"
_GRANT = "txn.batch_grant"

BATCH_LUA = f"""
-- numa-infer's batch wait (numad_infer/frontdoor/batch_wait.py): written by the daemon, do not edit.
local batch_waiting = {{}}  -- backend name -> {{request id -> {{rank, seen (ms)}}}}
local batch_seq = 0

local function batch_now()
  local t = core.now()
  return t.sec * 1000 + t.usec // 1000
end

-- Free slots on the backend's servers in rotation, less the requests in the backend's own
-- queue (which any of them may take). A server's own queue (a request routed to it by an
-- affinity) waits for that server alone: it takes none of another server's free slots.
-- Requests let go count as taking a slot until the backend's last rule (`{LANDED}`): between
-- its release and the moment HAProxy counts it at a server, the rules after this one run
-- (the prefix pick's Lua among them, behind the Lua lock), and the next in line would see
-- the same free slot (a test saw three let go for two slots). After the last rule HAProxy
-- assigns the server in the same pass. GRANT_MS forgets one whose rules never ended (its
-- client left, a rule answered it): until then the next batch request waits that much
-- longer. (A first version counted every one for GRANT_MS: twice once at a server, which
-- cost batch a quarter of its answers a second over real engines.)
local GRANT_MS = {GRANT_MS}
local granted = {{}}  -- backend name -> {{request id -> release time (ms)}}

local function batch_granted(name, now)
  local list = granted[name]
  if list == nil then list = {{}}; granted[name] = list end
  local n = 0
  for id, at in pairs(list) do
    if now - at < GRANT_MS then n = n + 1 else list[id] = nil end
  end
  return n
end

local function batch_grant(txn, name, id, now)
  batch_granted(name, now)
  granted[name][id] = now
  txn:set_var("{_GRANT}", id)
end

core.register_action("{LANDED}", {{"http-req"}}, function(txn)
  local list = granted[txn.f:be_name()]
  if list ~= nil then list[tonumber(txn:get_var("{_GRANT}"))] = nil end
end, 0)

-- Room for a batch request: the free slots; while interactive requests come, no more than
-- leave batch (at the servers, in the queue, let go) `reserve` slots short of all those in
-- rotation, and never short of every one (batch keeps one). Batch's own count, not the free
-- slots less the reserve: an interactive request in the reserved slot leaves the reserve
-- kept, not a second one held.
local function batch_room(txn, name, now, reserve)
  local backend = core.backends[name]
  if backend == nil then return 0 end
  local let_go = batch_granted(name, now)
  local free = -(tonumber(backend:get_stats()["qcur"]) or 0) - let_go
  local slots = 0
  for _, server in pairs(backend.servers) do
    local s = server:get_stats()
    if tonumber(s.bck) == 0 and tostring(s.status):sub(1, 2) == "UP" then
      local limit = tonumber(s.slim) or 0
      slots = slots + limit
      free = free + math.max(0, limit - (tonumber(s.scur) or 0) - (tonumber(s.qcur) or 0))
    end
  end
  if (tonumber(txn.c:table_http_req_rate(name, "{SEEN}")) or 0) > 0 then
    local batch = (tonumber(txn.c:table_conn_cur(name, "{FLIGHT}")) or 0) + let_go
    free = math.min(free, slots - math.min(reserve, math.max(0, slots - 1)) - batch)
  end
  return free
end

-- The waiting requests ahead of `rank`, forgetting those no longer refreshed (client gone).
local function batch_ahead(list, rank, now)
  local n = 0
  for id, entry in pairs(list) do
    if now - entry.seen > {STALE_MS} then list[id] = nil
    elseif entry.rank < rank then n = n + 1 end
  end
  return n
end

core.register_action("{ACTION}", {{"http-req"}}, function(txn, timeout_ms, most, reserve)
  local name = txn.f:be_name()
  local list = batch_waiting[name]
  if list == nil then list = {{}}; batch_waiting[name] = list end
  local now = batch_now()
  reserve = tonumber(reserve)
  local waiting = batch_ahead(list, math.huge, now)
  batch_seq = batch_seq + 1
  local id = batch_seq
  if waiting == 0 and batch_room(txn, name, now, reserve) > 0 then batch_grant(txn, name, id, now); return end
  if waiting >= tonumber(most) then txn:set_var("{_REFUSED}", true); return end
  local entry = {{rank = id, seen = now}}
  list[id] = entry
  -- From the request's arrival: a hold before this wait is part of it.
  local deadline = (tonumber(txn:get_var("{ARRIVED}")) or now) + tonumber(timeout_ms)
  while true do
    core.msleep({STEP_MS})
    now = batch_now()
    entry.seen = now
    if now >= deadline then list[id] = nil; txn:set_var("{_REFUSED}", true); return end
    if batch_ahead(list, id, now) < batch_room(txn, name, now, reserve) then
      list[id] = nil
      batch_grant(txn, name, id, now)
      return
    end
  end
end, 3)
"""


def applies(front: FrontendSection, tenants: Sequence[TenantEntry]) -> bool:
    """Batch requests wait apart: tenants give classes, and batch has a longer deadline or
    interactive requests a reserve."""
    return bool(tenants) and (front.batch_deadline_s > front.queue_timeout_s or front.interactive_reserve > 0)


def rules(front: FrontendSection, tenants: Sequence[TenantEntry], arriving: str, busy: str) -> list[str]:
    """A model backend's rules, after the hold's: a batch request (the gate said its class)
    arriving while the backend is full waits for room, up to the batch deadline; one
    that waited that long, or found queue_size waiting already, gets `busy` (the JSON 503).
    `arriving`: the ACL of a request entering from the main frontend (one let go by the hold
    waited already)."""
    if not applies(front, tenants):
        return []
    seen = [f"    http-request track-sc2 be_name table {SEEN} if !{IS_BATCH} {arriving}"] \
        if front.interactive_reserve else []
    return [*seen,
            f"    http-request lua.{ACTION} {int(front.batch_deadline_s * 1000)} {front.queue_size} "
            f"{front.interactive_reserve} if {IS_BATCH} {arriving}",
            f"    http-request return status 503 content-type application/json string '{busy}' "
            f"hdr Retry-After 1 if {{ var({_REFUSED}) -m bool }}"]


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


def table(front: FrontendSection, tenants: Sequence[TenantEntry], backends: int) -> list[str]:
    """The stick tables of batch requests let go and of interactive requests' arrivals, one
    entry per model's backend."""
    if not applies(front, tenants):
        return []
    return [f"backend {FLIGHT}", f"    stick-table type string len 64 size {backends} store conn_cur", "",
            f"backend {SEEN}",
            # A rate over 5 s periods is above 0 for 5 to 10 s after the last request.
            f"    stick-table type string len 64 size {backends} store http_req_rate({RECENT_MS // 2000}s)"]
