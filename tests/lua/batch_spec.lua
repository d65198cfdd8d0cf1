-- numa-infer-batch.lua: a batch request waits for room before the backend's queue, up to
-- its own deadline, and leaves interactive requests a reserve (numad_infer/frontdoor/
-- batch_wait.py; end to end: tests/frontdoor/test_tenants.py).
local fake = require("tests.lua.fake_haproxy")

describe("the batch wait", function()
  local h

  local function load(servers)
    h = fake.load({"numa-infer-batch.lua"})
    h:backend("m", servers)
    h:start()
  end

  after_each(function()
    h:close()
  end)

  -- A batch request as haproxy.cfg runs it: the gate notes its arrival, then
  -- `lua.numa_batch_wait <deadline ms> <queue_size> <reserve>`; once let go, the backend's
  -- last rules (track FLIGHT, `lua.numa_batch_landed`) and the dispatch.
  local Batch = {}
  Batch.__index = Batch

  local function batch(opts)
    opts = opts or {}
    local b = setmetatable({ms = opts.ms or 2000}, Batch)
    b.txn = h:txn("m", nil, {["txn.arrived_ms"] = opts.arrived or h.ms})
    b.stream = h:action("numa_batch_wait", b.txn, opts.deadline or 10000, opts.most or 10, opts.reserve or 0)
    return b
  end

  function Batch:refused()
    return self.txn:get_var("txn.batch_refused") == true
  end

  function Batch:let_go()
    return self.stream.done and not self:refused()
  end

  -- What follows its release: the rest of the backend's rules, then HAProxy's dispatch.
  function Batch:land()
    assert.is_true(self:let_go())
    h:action("numa_batch_landed", self.txn)
    self.req = h:send("m", nil, self.ms, "numa_batch_flight")
    return self.req
  end

  -- Every batch request let go lands at once (no other rule in between).
  local function land_all(list)
    for _, b in ipairs(list) do
      if b:let_go() and b.req == nil then b:land() end
    end
  end

  local function advance(ms, list)
    for _ = 1, ms // 10 do
      h:advance(10)
      land_all(list)
    end
  end

  -- An interactive request: counted in the SEEN table on arrival, straight to the backend.
  local function interactive(ms)
    h:hit("numa_interactive", "m")
    return h:send("m", nil, ms or 2000)
  end

  it("lets a batch request go at once while there is room", function()
    load({a = {maxconn = 1}, b = {maxconn = 1}})
    local b = batch()
    assert.is_true(b:let_go())
    assert.is_not_nil(b.txn:get_var("txn.batch_grant"))
    assert.are.equal("a", b:land().server)
  end)

  it("holds batch requests while the backend is full and lets them go in arrival order", function()
    load({a = {maxconn = 1}, b = {maxconn = 1}})
    local list = {}
    for i = 1, 6 do list[i] = batch({ms = 2000}) end
    land_all(list)
    assert.is_true(list[1]:let_go() and list[2]:let_go())
    for i = 3, 6 do assert.is_false(list[i].stream.done) end
    advance(2100, list)
    assert.is_true(list[3]:let_go() and list[4]:let_go())
    assert.is_false(list[5].stream.done or list[6].stream.done)
    advance(2000, list)
    assert.is_true(list[5]:let_go() and list[6]:let_go())
    assert.is_true(list[3].stream.ended <= list[5].stream.ended)
  end)

  it("lets an interactive request arriving meanwhile pass the waiting batch requests", function()
    load({a = {maxconn = 1}, b = {maxconn = 1}})
    local start = h.ms
    local list = {}
    for i = 1, 6 do list[i] = batch({ms = 2000}) end
    land_all(list)
    h:advance(500)
    local quick = interactive(500)  -- to the backend's queue: no slot is free
    assert.are.equal(1, #h.core.backends.m.queue)
    advance(2100 - 500, list)
    assert.are.equal(start + 2000, quick.started)  -- the first slot freed, ahead of B3-B6
    assert.is_true(list[3]:let_go())  -- the second
    assert.is_false(list[4].stream.done)
  end)

  it("refuses a batch request at its deadline, counted from its arrival (a hold before counts)", function()
    load({a = {maxconn = 1}})
    h:send("m", nil, 10000)
    local arrived = h.ms
    h:advance(1000)  -- a hold, before this wait
    local b = batch({deadline = 3000, arrived = arrived})
    advance(1990, {b})
    assert.is_false(b.stream.done)
    advance(30, {b})
    assert.is_true(b:refused())
    assert.is_true(b.stream.ended - arrived >= 3000 and b.stream.ended - arrived <= 3020)
  end)

  it("lets at most queue_size wait; the next is refused at once", function()
    load({a = {maxconn = 1}})
    h:send("m", nil, 10000)
    local first, second, third = batch({most = 2}), batch({most = 2}), batch({most = 2})
    assert.is_false(first.stream.done or second.stream.done)
    assert.is_true(third:refused())
  end)

  it("stops counting a waiting request whose client left after batch.stale_ms", function()
    load({a = {maxconn = 1}})
    h:send("m", nil, 500)
    local gone = batch()
    local next_one = batch()
    h:drop(gone.stream)
    advance(600, {next_one})
    assert.is_false(next_one.stream.done)  -- the slot is free, but the first still counts ahead
    advance(500, {next_one})
    assert.is_true(next_one:let_go())
  end)

  it("counts a request let go as taking its slot until it lands, or batch.grant_ms", function()
    load({a = {maxconn = 1}, b = {maxconn = 1}})
    h:send("m", "a", 100)
    h:send("m", "b", 5000)
    local first, second = batch(), batch()
    h:advance(120)
    assert.is_true(first:let_go())
    h:advance(100)  -- first has not reached a server yet: the slot is still its
    assert.is_false(second.stream.done)
    h:advance(260)  -- it never did (its client left): forgotten
    assert.is_true(second:let_go())
  end)

  it("stops counting a request let go once it lands at its server", function()
    load({a = {maxconn = 1}})
    local first = batch({ms = 50})
    local second = batch()
    first:land()  -- counted at its server from now on, not twice
    local start = h.ms
    advance(100, {first, second})
    assert.is_true(second:let_go())
    assert.is_true(second.stream.ended - start <= 70)  -- its slot's end, not batch.grant_ms later
  end)

  it("keeps a reserve for interactive requests while they come", function()
    load({a = {maxconn = 1}, b = {maxconn = 1}})
    interactive(100)
    h:advance(100)
    local list = {batch({ms = 60000, reserve = 1}), batch({ms = 60000, reserve = 1, deadline = 30000})}
    land_all(list)
    assert.is_true(list[1]:let_go())
    advance(5000, list)
    assert.is_false(list[2].stream.done)  -- a slot free, kept for interactive requests
    assert.is_nil(interactive(100).status)  -- and one takes it at once
    advance(100, list)
    advance(10000, list)  -- no interactive request for a while: the reserve is let go
    assert.is_true(list[2]:let_go())
  end)

  it("never reserves a backend's every slot: batch keeps one", function()
    load({a = {maxconn = 1}})
    interactive(10)
    h:advance(10)
    assert.is_true(batch({reserve = 1}):let_go())
  end)

  it("counts batch's own slots: an interactive request in the reserve holds no second one", function()
    load({a = {maxconn = 2}, b = {maxconn = 2}})
    interactive(10)
    h:advance(10)
    local list = {}
    for i = 1, 3 do list[i] = batch({ms = 1000 * i, reserve = 1}) end
    land_all(list)
    assert.is_true(list[1]:let_go() and list[2]:let_go() and list[3]:let_go())
    local waiting = batch({ms = 1000, reserve = 1})
    list[4] = waiting
    interactive(10000)  -- takes the last slot
    advance(1100, list)
    assert.is_true(waiting:let_go())  -- once batch holds 2: not when the interactive one ends
  end)
end)
