-- numa-infer's batch wait (numad_infer/frontdoor/batch_wait.py), run by numa-infer.lua.
local numa = ...
local ACTION, LANDED = numa.text("batch.action"), numa.text("batch.landed")
local STEP_MS, STALE_MS = numa.number("batch.step_ms"), numa.number("batch.stale_ms")
local GRANT_MS = numa.number("batch.grant_ms")
local SEEN, FLIGHT = numa.text("batch.seen_table"), numa.text("batch.flight_table")
local REFUSED, GRANT = numa.text("batch.refused_var"), numa.text("batch.grant_var")
local ARRIVED = numa.text("batch.arrived_var")
local batch_now = numa.now_ms

local batch_waiting = {}  -- backend name -> {request id -> {rank, seen (ms)}}
local batch_seq = 0

-- Free slots on the backend's servers in rotation, less the requests in the backend's own
-- queue (which any of them may take). A server's own queue (a request routed to it by an
-- affinity) waits for that server alone: it takes none of another server's free slots.
-- Requests let go count as taking a slot until the backend's last rule (LANDED): between
-- its release and the moment HAProxy counts it at a server, the rules after this one run
-- (the prefix pick's Lua among them, behind the Lua lock), and the next in line would see
-- the same free slot (a test saw three let go for two slots). After the last rule HAProxy
-- assigns the server in the same pass. GRANT_MS forgets one whose rules never ended (its
-- client left, a rule answered it): until then the next batch request waits that much
-- longer.
local granted = {}  -- backend name -> {request id -> release time (ms)}

local function batch_granted(name, now)
  local list = granted[name]
  if list == nil then list = {}; granted[name] = list end
  local n = 0
  for id, at in pairs(list) do
    if now - at < GRANT_MS then n = n + 1 else list[id] = nil end
  end
  return n
end

local function batch_grant(txn, name, id, now)
  batch_granted(name, now)
  granted[name][id] = now
  txn:set_var(GRANT, id)
end

core.register_action(LANDED, {"http-req"}, function(txn)
  local list = granted[txn.f:be_name()]
  if list ~= nil then list[tonumber(txn:get_var(GRANT))] = nil end
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
  if (tonumber(txn.c:table_http_req_rate(name, SEEN)) or 0) > 0 then
    local batch = (tonumber(txn.c:table_conn_cur(name, FLIGHT)) or 0) + let_go
    free = math.min(free, slots - math.min(reserve, math.max(0, slots - 1)) - batch)
  end
  return free
end

-- The waiting requests ahead of `rank`, forgetting those no longer refreshed (client gone).
local function batch_ahead(list, rank, now)
  local n = 0
  for id, entry in pairs(list) do
    if now - entry.seen > STALE_MS then list[id] = nil
    elseif entry.rank < rank then n = n + 1 end
  end
  return n
end

core.register_action(ACTION, {"http-req"}, function(txn, timeout_ms, most, reserve)
  local name = txn.f:be_name()
  local list = batch_waiting[name]
  if list == nil then list = {}; batch_waiting[name] = list end
  local now = batch_now()
  reserve = tonumber(reserve)
  local waiting = batch_ahead(list, math.huge, now)
  batch_seq = batch_seq + 1
  local id = batch_seq
  if waiting == 0 and batch_room(txn, name, now, reserve) > 0 then batch_grant(txn, name, id, now); return end
  if waiting >= tonumber(most) then txn:set_var(REFUSED, true); return end
  local entry = {rank = id, seen = now}
  list[id] = entry
  -- From the request's arrival: a hold before this wait is part of it.
  local deadline = (tonumber(txn:get_var(ARRIVED)) or now) + tonumber(timeout_ms)
  while true do
    core.msleep(STEP_MS)
    now = batch_now()
    entry.seen = now
    if now >= deadline then list[id] = nil; txn:set_var(REFUSED, true); return end
    if batch_ahead(list, id, now) < batch_room(txn, name, now, reserve) then
      list[id] = nil
      batch_grant(txn, name, id, now)
      return
    end
  end
end, 3)
