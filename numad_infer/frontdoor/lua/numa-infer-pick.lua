-- numa-infer's prefix routing (numad_infer/frontdoor/affinity.py), run by numa-infer.lua.
local numa = ...
local PICK, WAIT = numa.text("pick.fetch"), numa.text("pick.wait")
local PREFIX_HASH, WAITED = numa.text("pick.hash_var"), numa.text("pick.waited_var")
local HOME_GENERATION = numa.number("pick.home_generation")
local PICK_MEMORY_MS = numa.number("pick.memory_ms")
local WAIT_STEP_MS = numa.number("pick.wait_step_ms")
local LEAST_BOUND = numa.number("pick.least_bound")
local HOMES_FILE = numa.text("pick.homes_file")
local HOMES_COMMAND = {}  -- the runtime API command that dumps the homes, as words
for word in numa.text("pick.homes_command"):gmatch("%S+") do HOMES_COMMAND[#HOMES_COMMAND + 1] = word end
local clock_ms = numa.now_ms

-- murmur3's 32-bit finalizer: the key's hash mixed with a server's is that server's score.
local function mix(h)
  h = h & 0xffffffff
  h = ((h ~ (h >> 16)) * 0x85ebca6b) & 0xffffffff
  h = ((h ~ (h >> 13)) * 0xc2b2ae35) & 0xffffffff
  return h ~ (h >> 16)
end

local server_hashes = {}  -- server name -> FNV-1a of it, computed once
local function server_hash(name)
  local h = server_hashes[name]
  if h == nil then
    h = 2166136261
    for i = 1, #name do h = ((h ~ name:byte(i)) * 16777619) & 0xffffffff end
    server_hashes[name] = h
  end
  return h
end

-- Where each key was first sent, per backend: its home, kept while the home is in
-- rotation. Two generations of at most HOME_GENERATION keys each: a key not seen for a
-- whole generation is forgotten (so at most 2 x HOME_GENERATION are kept), one seen again
-- is moved to the newer.
local homes = {}  -- backend name -> {now = {key -> server}, old = {...}, n = keys in now}

local function remember(backend_name, key, server)
  local h = homes[backend_name]
  if h == nil then
    h = {now = {}, old = {}, n = 0}
    homes[backend_name] = h
  end
  if h.now[key] == nil then
    if h.n >= HOME_GENERATION then h.old, h.now, h.n = h.now, {}, 0 end
    h.n = h.n + 1
  end
  h.now[key] = server
end

local function home_of(backend_name, key)
  local h = homes[backend_name]
  if h == nil then return nil end
  local server = h.now[key]
  if server == nil and h.old[key] ~= nil then
    server = h.old[key]
    h.old[key] = nil
    remember(backend_name, key, server)
  end
  return server
end

-- The homes, for the next HAProxy (HOMES_COMMAND on the runtime API, which the daemon
-- saves to HOMES_FILE just before a reload): "backend server key" lines, the older
-- generation first, so that the newer stays newer when they are read back. All read
-- before the first send: a send may yield, and picks made meanwhile add keys, which a
-- traversal with pairs() must not see happen.
core.register_cli(HOMES_COMMAND, "numa-infer: each prefix key's home", function(applet)
  local lines = {}
  for backend_name, h in pairs(homes) do
    for _, generation in ipairs({h.old, h.now}) do
      for key, server in pairs(generation) do
        lines[#lines + 1] = backend_name .. " " .. server .. " " .. key .. "\n"
      end
    end
  end
  for first = 1, #lines, 1000 do
    applet:send(table.concat(lines, "", first, math.min(first + 999, #lines)))
  end
end)

-- Read back once this HAProxy has its backends: the last process's homes, where their
-- backend and server still exist (a server that left is no home; its keys find another).
core.register_init(function()
  local file = io.open(numa.dir .. "/" .. HOMES_FILE, "r")
  if not file then return end
  for line in file:lines() do
    local backend_name, server, key = line:match("^(%S+) (%S+) (%d+)$")
    local backend = backend_name and core.backends[backend_name]
    if backend ~= nil and backend.servers[server] ~= nil then remember(backend_name, tonumber(key), server) end
  end
  file:close()
end)

-- Picks HAProxy has not counted yet: between this fetch and the moment HAProxy counts the
-- request at its server, requests arriving at once (on other threads, or waiting for the
-- Lua lock) would see the old counts, and a burst with one key passed the bound (6 of 16
-- on one of 4 servers, in a loaded test run). Each pick counts for its server until that
-- server's session total (stot) shows it (it was the n-th pick still uncounted there: the
-- total has grown by n since), or PICK_MEMORY_MS at most (a request that never reached
-- its server, or one waiting in its queue, which qcur counts already).
local picked = {}  -- backend name -> list of {server name, stot that shows it, ms}

local function uncounted(backend_name, totals, now)
  local kept, counts = {}, {}
  for _, p in ipairs(picked[backend_name] or {}) do
    if now - p[3] < PICK_MEMORY_MS and (totals[p[1]] or 0) < p[2] then
      kept[#kept + 1] = p
      counts[p[1]] = (counts[p[1]] or 0) + 1
    end
  end
  picked[backend_name] = kept
  return counts
end

-- A server's stats say it takes requests: up, not drained (weight 0), not a backup.
local function in_rotation(s)
  return tonumber(s.bck) == 0 and tostring(s.status):sub(1, 2) == "UP" and (tonumber(s.weight) or 0) > 0
end

-- Each server of the backend by name: in rotation or not (up, not drained, not a backup),
-- its load (requests served, waiting for it, and picks HAProxy has not counted yet), a
-- free slot or not (load below its maxconn; 0: no limit). And per server, the session
-- total a pick made now will show in (its own and the uncounted picks before it).
-- Each server's stats, read again unless nothing has changed what the pick knows since the
-- last reading: the same millisecond of HAProxy's clock, and no pick made since. HAProxy
-- 2.6 gives a server's load only through get_stats(), a table of some 80 fields (14 us a
-- server, 1.3 ms a request at 64 instances, bench/README.md), and a later turn read them
-- twice: in its wait for a home, then in its pick, with nothing between. A pick made since
-- the reading forces a new one: that request may have been counted, served and let go
-- within the millisecond, and an old reading would still count it as on its way (its home
-- full: the next turn sent away; a CI run of tests/frontdoor/test_tenants.py caught it).
local readings = {}  -- backend name -> {ms = clock, picks = picks made then, stats = {name -> stats}, totals}
local picks_made = {}  -- backend name -> picks made so far

local function read_stats(backend_name, backend, now)
  local r, made = readings[backend_name], picks_made[backend_name] or 0
  if r == nil or r.ms ~= now or r.picks ~= made then
    r = {ms = now, picks = made, stats = {}, totals = {}}
    for name, server in pairs(backend.servers) do
      local s = server:get_stats()
      r.stats[name], r.totals[name] = s, tonumber(s.stot) or 0
    end
    readings[backend_name] = r
  end
  return r.stats, r.totals
end

local function servers_of(backend_name, backend, now)
  local stats, totals = read_stats(backend_name, backend, now)
  local pending = uncounted(backend_name, totals, now)
  local servers, counted = {}, {}
  for name, s in pairs(stats) do
    local rotating = in_rotation(s)
    local slots = tonumber(s.slim) or 0
    local load = (tonumber(s.scur) or 0) + (tonumber(s.qcur) or 0) + (pending[name] or 0)
    servers[name] = {rotating = rotating, load = load, room = rotating and (slots == 0 or load < slots)}
    counted[name] = totals[name] + (pending[name] or 0)
  end
  return servers, counted
end

-- The server for the request's key (its hash in the PREFIX_HASH variable), among the servers that
-- fit it: in rotation (up, not drained, not backups), with a free slot (load below its
-- maxconn), and whose load (requests served and waiting for it) stays within factor x the
-- mean once this one is added (rounded up, never below LEAST_BOUND):
-- - the key's home, where it went first (that instance's caches hold its prompts);
-- - a key seen for the first time: the least loaded, the highest scoring for the key among
--   equals (rendezvous hashing: on an idle fleet, a key goes where hashing sends it); it
--   becomes the key's home. Few conversations spread evenly this way, where hashing alone
--   sends three of four to one instance of two a time in two;
-- - a home that does not fit: the highest scoring that does. A home in rotation (full, or
--   past the bound) gives way to it: it then holds the key's whole history. A home out of
--   rotation is kept: a drained instance gets its keys back, and one that leaves or joins
--   moves no other's keys.
-- None fits: "", and the request waits in the backend's one queue for whichever instance
-- frees a slot first (leastconn), as under affinity "none": a request pinned to a full
-- server would wait in that server's own queue while another instance may sit idle, and
-- out of reach of queue_size, the priority classes and their deadlines. No server in
-- rotation: "" too (the hold).
core.register_fetches(PICK, function(txn, backend_name, factor_text)
  local backend = core.backends[backend_name]
  local key = tonumber(txn:get_var(PREFIX_HASH))
  if backend == nil or key == nil then return "" end
  local now = clock_ms()
  local servers, counted = servers_of(backend_name, backend, now)
  local up, total = {}, 0
  for name, s in pairs(servers) do
    if s.rotating then
      up[#up + 1] = {name = name, load = s.load, room = s.room, score = mix(key ~ server_hash(name))}
      total = total + s.load
    end
  end
  if #up == 0 then return "" end
  -- Rounded up, as in the bounded-loads paper (Mirrokni et al.) and HAProxy's own
  -- hash-balance-factor, and never below LEAST_BOUND (2): with few requests in flight over
  -- many instances the factor x the mean is under 1, and a conversation would be sent away
  -- from a home serving one other request with slots free, to read its whole history again
  -- (affinity.py).
  local bound = math.max(LEAST_BOUND, math.ceil(tonumber(factor_text) * (total + 1) / #up))
  local home = home_of(backend_name, key)
  local chosen, best, least, home_up = nil, nil, nil, false
  for _, s in ipairs(up) do
    local fits = s.room and s.load + 1 <= bound
    if s.name == home then
      home_up = true
      if fits then chosen = home end
    end
    if fits and (best == nil or s.score > best.score) then best = s end
    if least == nil or s.load < least.load or (s.load == least.load and s.score > least.score) then least = s end
  end
  if home == nil and least.room then
    -- First seen with a slot free somewhere: its home. With every slot taken it gets none
    -- yet (the shared queue decides where it runs), and one when it is next seen.
    chosen = least.name
    remember(backend_name, key, chosen)
  end
  if chosen == nil and best ~= nil then
    chosen = best.name
    -- Its home full or past the bound: the key now runs where its whole history will be
    -- read, so that is where its next turn finds it. A home out of rotation is kept (it
    -- gets its keys back).
    if home_up then remember(backend_name, key, chosen) end
  end
  if chosen == nil then return "" end
  local list = picked[backend_name]
  list[#list + 1] = {chosen, counted[chosen] + 1, now}
  picks_made[backend_name] = (picks_made[backend_name] or 0) + 1
  return chosen
end)

-- Before the pick: a key whose home is in rotation but has no free slot waits for its
-- home up to `wait_ms`, looking every WAIT_STEP_MS. On a CPU the history the home holds
-- costs seconds to read again elsewhere, often more than the turn it waits for; past
-- `wait_ms` the pick sends it to a free instance, or with none to the backend's one queue.
-- With no slot free anywhere it waits too: the one queue would give it the first slot
-- freed, its home's or not (half the time with two instances), and a turn that runs away
-- from home leaves the home behind, so the next turn misses this one (without this wait
-- later turns lost to least connections: bench/README.md, "Prefix routing").
-- One request waits per home at a time (a second would find the slot taken by the first):
-- a burst with one prompt goes on to the free instances at once. A request that waited
-- is marked (WAITED): the queue's bound is checked again after the wait.
local waiters = {}  -- "backend/server" -> the deadline of the request waiting for that home
core.register_action(WAIT, {"http-req"}, function(txn, backend_name, wait_ms)
  local key = tonumber(txn:get_var(PREFIX_HASH))
  local backend = core.backends[backend_name]
  if key == nil or backend == nil then return end
  local home = home_of(backend_name, key)
  if home == nil or backend.servers[home] == nil then return end
  local slot = backend_name .. "/" .. home
  local deadline = clock_ms() + tonumber(wait_ms)
  -- A waiter whose client left is dropped mid-sleep and never clears its mark: the mark
  -- holds its deadline, and a later request takes the place once it has passed.
  if (waiters[slot] or 0) > clock_ms() then return end
  local marked = false
  while clock_ms() < deadline do
    local servers = servers_of(backend_name, backend, clock_ms())
    -- A home out of rotation is not waited for (the pick sends the request elsewhere).
    local at_home = servers[home]
    if at_home == nil or not at_home.rotating or at_home.room then break end
    if not marked then
      waiters[slot], marked = deadline, true
      txn:set_var(WAITED, true)
    end
    core.msleep(WAIT_STEP_MS)
  end
  if marked then waiters[slot] = nil end
end, 2)
