-- A small fake of HAProxy 2.6 for the unit tests of numa-infer's Lua (busted, Lua 5.3).
-- It models what HAProxy does, not what a test expects:
-- - `core`: the registrations (actions, fetches, a filter, a CLI command, init functions),
--   `core.backends`, and a clock (`core.now`) that moves only as time passes here:
--   `h:advance(ms)`, or `core.msleep` in a stream (a coroutine: it sleeps until the clock
--   reaches its wake-up, while others run);
-- - backends whose servers count requests as HAProxy does: a request sent to a server
--   (use-server) is served while the server has a free slot (scur < maxconn), else queued
--   at that server; one sent to the backend goes to the least busy server in rotation with a
--   free slot, else waits in the backend's queue, or is refused (503) with no server
--   usable. A request served ends after its time, and its slot goes to the next in the
--   server's own queue, else the backend's. stot counts the requests a server took;
-- - a txn: variables (scoped names only, as HAProxy checks), the sample fetches the scripts
--   call (`be_name`, `so_name`, `nbsrv`), and the stick-table converters
--   (`table_http_req_rate`, `table_conn_cur`) over tables this fake keeps.
-- `fake.load(files, overrides)` does what the daemon and `lua-load` do: it copies
-- numa-infer.lua and the named files into a fresh folder with a data file (fake.DATA,
-- `overrides` on top, false leaving one out, `lua.load` naming the files) and runs
-- numa-infer.lua from there.
local fake = {}

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
fake.PACKAGE = here .. "/../../numad_infer/frontdoor/lua"

-- What the Python side writes (numad_infer/frontdoor/lua.py), with the same names; limits
-- a test relies on are its own (a spec overrides those it needs small).
fake.DATA = {
  ["hold.action"] = "numa_hold", ["hold.again"] = "numa_hold_again", ["hold.fetch"] = "numa_in_rotation",
  ["hold.step_ms"] = "50", ["hold.refused_var"] = "txn.hold_refused", ["hold.let_go_var"] = "txn.hold_let_go",
  ["pick.fetch"] = "numa_pick", ["pick.wait"] = "numa_home_wait", ["pick.hash_var"] = "txn.prefix_hash",
  ["pick.waited_var"] = "txn.prefix_waited", ["pick.home_generation"] = "50000", ["pick.memory_ms"] = "1000",
  ["pick.wait_step_ms"] = "25", ["pick.least_bound"] = "2", ["pick.homes_file"] = "haproxy.homes",
  ["pick.homes_command"] = "numa-infer homes",
  ["batch.action"] = "numa_batch_wait", ["batch.landed"] = "numa_batch_landed", ["batch.step_ms"] = "20",
  ["batch.stale_ms"] = "1000", ["batch.grant_ms"] = "250", ["batch.seen_table"] = "numa_interactive",
  ["batch.flight_table"] = "numa_batch_flight", ["batch.refused_var"] = "txn.batch_refused",
  ["batch.grant_var"] = "txn.batch_grant", ["batch.arrived_var"] = "txn.arrived_ms",
  ["tokens.filter"] = "numa_tokens", ["tokens.tail"] = "512", ["tokens.prompt_var"] = "txn.prompt_tokens",
  ["tokens.completion_var"] = "txn.completion_tokens",
}

local function copy(from, to)
  local input = assert(io.open(from, "rb"))
  local text = input:read("a")
  input:close()
  local output = assert(io.open(to, "wb"))
  output:write(text)
  output:close()
end

local function sorted_names(t)
  local names = {}
  for name in pairs(t) do names[#names + 1] = name end
  table.sort(names)
  return names
end

-- Servers ---------------------------------------------------------------------------------
local Server = {}
Server.__index = Server

-- In rotation: up with a weight (a drained server's is 0), as HAProxy's srv_is_usable.
function Server:usable()
  return self.state == "UP" and self.weight > 0
end

function Server:has_room()
  return self.maxconn == nil or self.scur < self.maxconn
end

-- HAProxy's stats line for the server (the fields the scripts read).
function Server:get_stats()
  return {status = self.state, weight = self.state == "DRAIN" and 0 or self.weight, bck = self.backup and 1 or 0,
          slim = self.maxconn, scur = self.scur, qcur = #self.queue, stot = self.stot}
end

-- Backends --------------------------------------------------------------------------------
local Backend = {}
Backend.__index = Backend

function Backend:get_stats()
  local act = 0
  for _, s in pairs(self.servers) do
    if not s.backup and s:usable() then act = act + 1 end
  end
  return {act = act, qcur = #self.queue}
end

-- ----------------------------------------------------------------------------------------
local Haproxy = {}
Haproxy.__index = Haproxy

function fake.haproxy()
  local h = setmetatable({ms = 1700000000000, events = {}, streams = {}, seq = 0, actions = {}, fetches = {},
                          filters = {}, clis = {}, inits = {}, tables = {}}, Haproxy)
  local core = {backends = {}}
  core.now = function() return {sec = h.ms // 1000, usec = (h.ms % 1000) * 1000} end
  core.msleep = function(ms)
    local co = coroutine.running()
    if h.streams[co] ~= nil then coroutine.yield(h.ms + ms) else h:advance(ms) end
  end
  core.register_action = function(name, where, fn, nargs)
    h.actions[name] = {fn = fn, where = where, nargs = nargs or 0}
  end
  core.register_fetches = function(name, fn) h.fetches[name] = fn end
  core.register_filter = function(name, class, fn) h.filters[name] = {class = class, fn = fn} end
  core.register_cli = function(words, usage, fn) h.clis[table.concat(words, " ")] = {usage = usage, fn = fn} end
  core.register_init = function(fn) h.inits[#h.inits + 1] = fn end
  h.core = core
  h.filter = {FLT_CFG_FL_HTX = 1, registered = {}}
  h.filter.register_data_filter = function(flt, chn) h.filter.registered[#h.filter.registered + 1] = {flt, chn} end
  return h
end

-- numa-infer.lua and `files`, run as HAProxy's lua-load does, from a folder of their own.
function fake.load(files, overrides)
  local h = fake.haproxy()
  h.dir = os.tmpname()
  os.remove(h.dir)
  assert(os.execute("mkdir -m 700 " .. h.dir))
  local data = {}
  for key, value in pairs(fake.DATA) do data[key] = value end
  for key, value in pairs(overrides or {}) do data[key] = value or nil end  -- false: left out
  data["lua.load"] = table.concat(files, " ")
  local out = assert(io.open(h.dir .. "/numa-infer-lua.data", "w"))
  for _, key in ipairs(sorted_names(data)) do out:write(key, " ", data[key], "\n") end
  out:close()
  for _, name in ipairs({"numa-infer.lua", table.unpack(files)}) do
    copy(fake.PACKAGE .. "/" .. name, h.dir .. "/" .. name)
  end
  _G.core, _G.filter = h.core, h.filter
  local ok, err = pcall(dofile, h.dir .. "/numa-infer.lua")
  if not ok then
    h:close()
    error(err, 0)
  end
  return h
end

function Haproxy:close()
  for _, name in ipairs({"numa-infer.lua", "numa-infer-lua.data", "haproxy.homes", "numa-infer-hold.lua",
                         "numa-infer-pick.lua", "numa-infer-batch.lua", "numa-infer-tokens.lua"}) do
    os.remove(self.dir .. "/" .. name)
  end
  os.remove(self.dir)
  _G.core, _G.filter = nil, nil
end

-- A file beside the scripts (what the daemon writes there, e.g. the homes before a reload).
function Haproxy:write(name, text)
  local out = assert(io.open(self.dir .. "/" .. name, "w"))
  out:write(text)
  out:close()
end

-- Once the configuration is read: the scripts' init functions.
function Haproxy:start()
  for _, fn in ipairs(self.inits) do fn() end
end

-- A backend and its servers: {name = {maxconn = n (nil: no limit), backup = true, state = "UP"}}.
function Haproxy:backend(name, servers)
  local b = setmetatable({name = name, servers = {}, queue = {}, h = self}, Backend)
  for server_name, spec in pairs(servers) do
    b.servers[server_name] = setmetatable({name = server_name, maxconn = spec.maxconn, backup = spec.backup or false,
                                           state = spec.state or "UP", weight = spec.weight or 1, scur = 0, stot = 0,
                                           queue = {}}, Server)
  end
  self.core.backends[name] = b
  return b
end

-- The clock and what happens in time ------------------------------------------------------
function Haproxy:after(ms, fn)
  self.seq = self.seq + 1
  self.events[#self.events + 1] = {at = self.ms + ms, seq = self.seq, fn = fn}
end

local function resume(h, stream, ...)
  local ok, wake = coroutine.resume(stream.co, ...)
  if not ok then error(wake, 0) end
  if coroutine.status(stream.co) == "dead" then
    stream.done, stream.ended = true, h.ms
    h.streams[stream.co] = nil
  else
    stream.wake = wake
  end
end

-- The next thing due by `target`: an event (first at a tie: a server back at t is seen by a
-- stream waking at t), else the stream waking first.
local function next_due(h, target)
  local best, kind
  for _, ev in ipairs(h.events) do
    if ev.at <= target and (best == nil or ev.at < best.at or (ev.at == best.at and ev.seq < best.seq)) then
      best, kind = ev, "event"
    end
  end
  for _, st in pairs(h.streams) do
    if st.wake <= target and (best == nil or st.wake < (best.at or best.wake)
                              or (kind == "stream" and st.wake == best.wake and st.id < best.id)) then
      best, kind = st, "stream"
    end
  end
  return best, kind
end

function Haproxy:advance(ms)
  local target = self.ms + ms
  while true do
    local due, kind = next_due(self, target)
    if due == nil then break end
    if kind == "event" then
      for i, ev in ipairs(self.events) do
        if ev == due then table.remove(self.events, i) break end
      end
      self.ms = math.max(self.ms, due.at)
      due.fn()
    else
      self.ms = math.max(self.ms, due.wake)
      resume(self, due)
    end
  end
  self.ms = target
end

-- A stream running `fn(...)` (an action): at once, until it sleeps or ends.
function Haproxy:stream(fn, ...)
  self.seq = self.seq + 1
  local stream = {co = coroutine.create(fn), id = self.seq, done = false}
  self.streams[stream.co] = stream
  resume(self, stream, ...)
  return stream
end

-- A stream HAProxy drops mid-sleep (its client left): never resumed, the rest of its action never runs.
function Haproxy:drop(stream)
  self.streams[stream.co] = nil
end

-- Requests at the servers -----------------------------------------------------------------
local function serve(b, s, req)
  s.scur, s.stot = s.scur + 1, s.stot + 1
  req.server, req.started = s.name, b.h.ms
  b.h:after(req.ms, function()
    s.scur = s.scur - 1
    req.done = true
    if req.untrack then req.untrack() end
    b:take(s)
  end)
end

-- A freed slot (or a server back in rotation): the next request of the server's own queue,
-- else of the backend's.
function Backend:take(s)
  while s:has_room() do
    local req = table.remove(s.queue, 1)
    if req == nil and s:usable() then req = table.remove(self.queue, 1) end
    if req == nil then return end
    serve(self, s, req)
  end
end

-- leastconn among the servers in rotation (the backups when none is), ties by name.
function Backend:dispatch(req)
  local candidates = {}
  for _, backup in ipairs({false, true}) do
    for _, name in ipairs(sorted_names(self.servers)) do
      local s = self.servers[name]
      if s.backup == backup and s:usable() then candidates[#candidates + 1] = s end
    end
    if #candidates > 0 then break end
  end
  if #candidates == 0 then req.status = 503; req.done = true; return end
  local best
  for _, s in ipairs(candidates) do
    if s:has_room() and (best == nil or s.scur < best.scur) then best = s end
  end
  if best == nil then self.queue[#self.queue + 1] = req else serve(self, best, req) end
end

-- A request of `ms` sent to backend `name`: to `server` where one is named (use-server),
-- else as the backend balances. `track`: a stick table it counts in (conn_cur) until it ends.
function Haproxy:send(name, server, ms, track)
  local b = assert(self.core.backends[name], name)
  local req = {ms = ms or 1000, done = false}
  if track ~= nil then req.untrack = self:track(track, name) end
  if server ~= nil and server ~= "" then
    local s = assert(b.servers[server], server)
    if s:has_room() then serve(b, s, req) else s.queue[#s.queue + 1] = req end
  else
    b:dispatch(req)
  end
  return req
end

-- An admin state change (`set server B/S state ready|drain|maint`) or a check's verdict (UP, DOWN).
function Haproxy:set_state(name, server, state)
  local b = self.core.backends[name]
  local s = b.servers[server]
  s.state = state
  if s:usable() then b:take(s) end
end

-- Stick tables ----------------------------------------------------------------------------
local function entry(h, tbl, key)
  h.tables[tbl] = h.tables[tbl] or {}
  local e = h.tables[tbl][key]
  if e == nil then
    e = {conn_cur = 0, period = 0, curr = 0, prev = 0}
    h.tables[tbl][key] = e
  end
  return e
end

-- `track-sc` on a table storing conn_cur: counted until the returned function is called.
function Haproxy:track(tbl, key)
  local e = entry(self, tbl, key)
  e.conn_cur = e.conn_cur + 1
  return function() e.conn_cur = e.conn_cur - 1 end
end

-- http_req_rate(period): HAProxy's frequency counter (freq_ctr.h, read_freq_ctr_period), the
-- current period's count plus the previous one's share of the time left; with none yet in
-- this period and at most one in the last, that one whole (its "flapping correction"): a
-- single request reads 1 for one to two periods.
local function rate(h, e, period_ms)
  local now_period = h.ms // period_ms
  if now_period ~= e.period then
    e.prev = (now_period == e.period + 1) and e.curr or 0
    e.curr, e.period = 0, now_period
  end
  if e.curr == 0 and e.prev <= 1 then return e.prev end
  local remain = period_ms - h.ms % period_ms
  return (e.prev * remain + e.curr * period_ms) // period_ms
end

fake.RATE_PERIOD_MS = 5000  -- batch_wait.py: http_req_rate(5s)

function Haproxy:hit(tbl, key)
  local e = entry(self, tbl, key)
  rate(self, e, fake.RATE_PERIOD_MS)
  e.curr = e.curr + 1
end

-- Transactions ----------------------------------------------------------------------------
-- A request's txn: `backend` (be_name), `listener` (so_name), `vars` to start with.
function Haproxy:txn(backend, listener, vars)
  local h = self
  local txn = {vars = {}}
  local function scoped(name)
    assert(type(name) == "string" and name:match("^[a-z]+%.[%w_.]+$"), "not a variable name: " .. tostring(name))
    return name
  end
  function txn.set_var(_, name, value) txn.vars[scoped(name)] = value end
  function txn.get_var(_, name) return txn.vars[scoped(name)] end
  for name, value in pairs(vars or {}) do txn.vars[scoped(name)] = value end
  txn.f = {
    be_name = function() return backend end,
    so_name = function() return listener end,
    -- The servers in rotation; with none, the backups usable (HAProxy's nbsrv).
    nbsrv = function(_, name)
      local b = h.core.backends[name]
      local act = b:get_stats().act
      if act > 0 then return act end
      local backups = 0
      for _, s in pairs(b.servers) do
        if s.backup and s:usable() then backups = backups + 1 end
      end
      return backups
    end,
  }
  txn.c = {
    table_http_req_rate = function(_, key, tbl) return rate(h, entry(h, tbl, key), fake.RATE_PERIOD_MS) end,
    table_conn_cur = function(_, key, tbl) return entry(h, tbl, key).conn_cur end,
  }
  return txn
end

-- `http-request lua.NAME args...`: a stream of its own; HAProxy hands the arguments over as
-- strings, exactly as many as registered.
function Haproxy:action(name, txn, ...)
  local action = assert(self.actions[name], "no action " .. name)
  local args = table.pack(...)
  assert(args.n == action.nargs, name .. " takes " .. action.nargs .. " arguments, given " .. args.n)
  for i = 1, args.n do args[i] = tostring(args[i]) end
  return self:stream(action.fn, txn, table.unpack(args, 1, args.n))
end

-- `lua.NAME(args...)`: called at once (a fetch cannot sleep), arguments as strings.
function Haproxy:fetch(name, txn, ...)
  local fn = assert(self.fetches[name], "no fetch " .. name)
  local args = table.pack(...)
  for i = 1, args.n do args[i] = tostring(args[i]) end
  return fn(txn, table.unpack(args, 1, args.n))
end

-- A CLI command's output (`applet:send` pieces, joined).
function Haproxy:cli(command)
  local out = {}
  self.clis[command].fn({send = function(_, text) out[#out + 1] = text end})
  return table.concat(out)
end

return fake
