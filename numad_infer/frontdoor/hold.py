"""The hold: a request for a model none of whose instances is in rotation waits for one.

HAProxy queues a request only while some server of its backend is up and full: with none
up (the only instance of a model restarting, drained for a restart, crashed, hung) it
answers 503 at once. On a host with one instance that is every restart numa-infer makes
(issue 40: 6,740 of 7,369 requests refused during one 10 s roll-out). So each backend runs
this action first: while `nbsrv` (the servers HAProxy would send a request to: up, not
drained, not in maintenance) is 0, the request sleeps in 50 ms steps, up to
`frontend.queue_timeout_s`; then it goes on as before, to an instance that is back, or to
the JSON 503 the backend answers when there is none.

It is a Lua action of HAProxy's own (Debian's HAProxy is built with Lua), in a file the
daemon writes beside haproxy.cfg: HAProxy still does all the routing; nothing is proxied
here. What it keeps bounded, as the queue is: at most `frontend.queue_size` requests held
per backend, the next answered 503 at once. The count is a table of deadlines, not a
counter: a request whose client left mid-wait is dropped by HAProxy without running the
rest of the action, and its entry simply expires.

`/healthz` is answered in the frontend, before any backend: during a hold it says 503 (no
instance in rotation), so an outer balancer can send the traffic to another host.

The hold sees only what arrives while no server is in rotation. A request that HAProxy
had already given to the only instance when it died (sent in the second before HAProxy
saw it, or waiting in the queue for its slots) meets a refused connection instead: with
`option redispatch` it is redispatched, finds no server, and gets a 503 at once (issue 40:
one such in 8 requests after a kill -9). So a model with one instance has no redispatch
(there is nowhere else to go) and as many retries as the hold has seconds: HAProxy tries
the same server again every second (its turn-around of min(`timeout connect`, 1 s)),
whatever its state, and the request is served once the instance listens again. Measured
with HAProxy 2.6: a request refused by the dead instance and two queued behind it were
all served by the replacement 2.5 s and 8 s later. Known gap: llama-server listens before
its model is loaded and answers 503 "Loading model" meanwhile; a retry that connects in
that window gets that 503 (HAProxy 2.6 retries a 503 at once, not a second later: 30
retries in 10 ms, measured, so `retry-on 503` would not wait either).

Only connection failures are retried: a POST the instance had received is still not
replayed. It may be what killed it, and replayed it would crash the instance again at
each restart within the hold (about three times in 30 s under the default
`restart_backoff_s` of 5 s, doubling), bringing it nearer `max_restarts`. So the request
the killed process was answering gets a JSON 502, which OpenAI's clients retry by default
(`max_retries = 2`), into the hold."""

from __future__ import annotations

import math

from numad_infer.config.frontend import FrontendSection

HOLD_NAME = "hold.lua"
ACTION = "numa_hold"
STEP_MS = 50  # how often a held request looks again: what a hold adds to the wait, at most

HOLD_LUA = f"""-- numa-infer's hold (numad_infer/frontdoor/hold.py): written by the daemon, do not edit.
-- While no server of the request's backend is in rotation, wait for one, up to a limit.
local held = {{}}  -- backend name -> {{request id -> deadline, in ms}}
local seq = 0

local function now_ms()
  local t = core.now()
  return t.sec * 1000 + t.usec // 1000
end

-- How many requests of this backend are waiting now (entries past their deadline are gone:
-- a request whose client left is dropped mid-sleep and never removes its own).
local function waiting(list, now)
  local n = 0
  for id, deadline in pairs(list) do
    if deadline <= now then list[id] = nil else n = n + 1 end
  end
  return n
end

core.register_action("{ACTION}", {{"http-req"}}, function(txn, timeout_ms, limit)
  if txn.f:nbsrv() > 0 then return end
  local backend = txn.f:be_name()
  local list = held[backend]
  if list == nil then list = {{}}; held[backend] = list end
  local start = now_ms()
  if waiting(list, start) >= tonumber(limit) then return end  -- full: the 503, as a full queue
  seq = seq + 1
  local id = seq
  local deadline = start + tonumber(timeout_ms)
  list[id] = deadline
  while txn.f:nbsrv() == 0 and now_ms() < deadline do
    core.msleep({STEP_MS})
  end
  list[id] = nil
  txn:set_var("txn.held_ms", now_ms() - start)
end, 2)
"""


def hold_rule(front: FrontendSection) -> str:
    """The backend's first rule: hold the request while none of its servers is in rotation."""
    return f"    http-request lua.{ACTION} {int(front.queue_timeout_s * 1000)} {front.queue_size}"


def retry_rules(front: FrontendSection, instances: int) -> list[str]:
    """A model backend's retries. Several instances: up to 3, each to another server
    (redispatch), at once. One instance: the same server again, once a second, for as long
    as a hold would wait (the module says why)."""
    if instances > 1:
        tries = ["    retries 3", "    option redispatch 1"]
    else:
        tries = [f"    retries {max(3, math.ceil(front.queue_timeout_s))}"]  # no redispatch: nowhere else to go
    return [*tries,
            "    retry-on conn-failure empty-response",
            # A POST that reached a server is not replayed: it may be what killed it.
            "    http-request disable-l7-retry if !METH_GET"]
