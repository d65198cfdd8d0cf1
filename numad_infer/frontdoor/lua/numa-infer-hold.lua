-- numa-infer's hold (numad_infer/frontdoor/hold.py), run by numa-infer.lua: a request for a
-- backend with no server in rotation waits for one.
local numa = ...
local ACTION, AGAIN, FETCH = numa.text("hold.action"), numa.text("hold.again"), numa.text("hold.fetch")
local STEP_MS = numa.number("hold.step_ms")  -- how often a held request looks again
local REFUSED, LET_GO = numa.text("hold.refused_var"), numa.text("hold.let_go_var")
local now_ms = numa.now_ms

local held = {}  -- backend name -> {request id -> deadline, in ms}
local seq = 0

-- The servers of a backend in rotation: up, not drained, not in maintenance, backups left
-- out (the hold server is one, and always up).
local function in_rotation(name)
  local backend = core.backends[name]
  if backend == nil then return 0 end
  return tonumber(backend:get_stats()["act"]) or 0
end

-- The same, cheaply where it can be: nbsrv counts the servers in rotation while there are
-- any, and 1 (the hold server) while there are none.
local function serving(txn, name)
  return txn.f:nbsrv(name) > 1 or in_rotation(name) > 0
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

-- Wait while the backend has no server in rotation, up to the limit: true once it has one.
-- `most`: how many may wait at once (nil: no bound here, the hold server's maxconn is one).
local function wait_for(backend, timeout_ms, most)
  local list = held[backend]
  if list == nil then list = {}; held[backend] = list end
  local start = now_ms()
  if most ~= nil and waiting(list, start) >= most then return false end
  seq = seq + 1
  local id = seq
  -- Only arrivals count against `most`: the hold server's requests have its maxconn.
  if most ~= nil then list[id] = start + timeout_ms end
  while in_rotation(backend) == 0 and now_ms() < start + timeout_ms do
    core.msleep(STEP_MS)
  end
  list[id] = nil
  return in_rotation(backend) > 0
end

core.register_fetches(FETCH, function(_, name) return in_rotation(name) end)

-- A model's backend's first action: a request arriving while none of its servers is in rotation.
core.register_action(ACTION, {"http-req"}, function(txn, timeout_ms, most)
  local backend = txn.f:be_name()
  if serving(txn, backend) then return end
  if not wait_for(backend, tonumber(timeout_ms), tonumber(most)) then txn:set_var(REFUSED, true) end
end, 2)

-- The hold frontend's: a request dispatched again to the hold server (its instance died
-- under it). The listener's name is the backend it came from.
core.register_action(AGAIN, {"http-req"}, function(txn, timeout_ms)
  if wait_for(txn.f:so_name(), tonumber(timeout_ms), nil) then txn:set_var(LET_GO, true) end
end, 1)
