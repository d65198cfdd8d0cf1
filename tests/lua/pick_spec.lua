-- numa-infer-pick.lua: prefix routing's pick, the wait for a busy home, and the homes kept
-- across a reload (numad_infer/frontdoor/affinity.py; end to end:
-- tests/frontdoor/test_prefix.py, and test_tenants.py for the reload).
local fake = require("tests.lua.fake_haproxy")

local FOUR = {a = {maxconn = 8}, b = {maxconn = 8}, c = {maxconn = 8}, d = {maxconn = 8},
              ["hold-m"] = {backup = true, maxconn = 10}}

-- A key as haproxy.cfg makes it (xxh32 of the prompt's start): any 32-bit number.
local function key_of(n)
  return (n * 2654435761 + 12345) & 0xffffffff
end

local function count(list)
  local by = {}
  for _, v in ipairs(list) do by[v] = (by[v] or 0) + 1 end
  return by
end

local function most(by)
  local n = 0
  for _, v in pairs(by) do n = math.max(n, v) end
  return n
end

local function size(t)
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n
end

describe("the prefix pick", function()
  local h

  -- A fresh HAProxy with backend m; `homes`: the file the last one's homes were saved to.
  local function load(servers, overrides, homes)
    h = fake.load({"numa-infer-pick.lua"}, overrides)
    h:backend("m", servers)
    if homes ~= nil then h:write("haproxy.homes", homes) end
    h:start()
  end

  after_each(function()
    h:close()
  end)

  -- `set-var(txn.prefix_server) lua.numa_pick(m,1.25)`: "" for no pick.
  local function pick(key, factor)
    return h:fetch("numa_pick", h:txn("m", nil, {["txn.prefix_hash"] = key}), "m", factor or "1.25")
  end

  -- A request of `ms` with `key`: picked, then `use-server` (a pick) or the backend's queue.
  local function send(key, ms)
    local server = pick(key)
    return h:send("m", server, ms), server
  end

  -- Where each key goes when sent alone on an idle fleet (each turn over before the next).
  local function placement(keys)
    local where = {}
    for _, key in ipairs(keys) do
      local req = send(key, 10)
      h:advance(10)
      where[key] = req.server
    end
    return where
  end

  local function keys(n)
    local list = {}
    for i = 1, n do list[i] = key_of(i) end
    return list
  end

  it("sends a conversation's turns to one instance and spreads conversations over all", function()
    load(FOUR)
    local first = {}
    for _, key in ipairs(keys(40)) do
      local seen = {}
      for _ = 1, 4 do
        local req = send(key, 10)
        h:advance(10)
        seen[req.server] = true
      end
      assert.are.equal(1, size(seen))
      first[#first + 1] = next(seen)
    end
    local spread = count(first)
    assert.are.equal(4, size(spread))
    assert.is_true(most(spread) <= 20)
  end)

  it("makes no pick for a request without a key, or for a backend it does not know", function()
    load(FOUR)
    assert.are.equal("", h:fetch("numa_pick", h:txn("m"), "m", "1.25"))
    assert.are.equal("", h:fetch("numa_pick", h:txn("m", nil, {["txn.prefix_hash"] = 7}), "nope", "1.25"))
  end)

  it("sends a key first seen on an idle fleet where its hash does, whatever came before", function()
    load(FOUR)
    local alone = placement(keys(30))
    h:close()
    load(FOUR)
    local reversed = {}
    for i = 30, 1, -1 do reversed[#reversed + 1] = key_of(i) end
    assert.are.same(alone, placement(reversed))
  end)

  it("sends a key first seen to the least loaded instance", function()
    load({a = {maxconn = 8}, b = {maxconn = 8}})
    for _ = 1, 3 do h:send("m", "a", 5000) end
    for i = 1, 3 do
      local _, server = send(key_of(i), 5000)
      assert.are.equal("b", server)
    end
  end)

  for _, state in ipairs({"DRAIN", "MAINT", "DOWN"}) do
    it("moves only the keys of an instance taken out (" .. state .. ") and gives them back", function()
      load(FOUR)
      local all = keys(60)
      local before = placement(all)
      local own = {}
      for key, server in pairs(before) do
        if server == "a" then own[key] = true end
      end
      assert.is_true(size(own) > 0 and size(own) < 60)
      h:set_state("m", "a", state)
      local during = placement(all)
      for key, server in pairs(during) do
        assert.are_not.equal("a", server)
        assert.are.equal(own[key] == nil, server == before[key])
      end
      h:set_state("m", "a", "UP")
      assert.are.same(before, placement(all))
    end)
  end

  it("spreads a hot prompt so no instance serves above the factor times the mean", function()
    load(FOUR)
    local hot = key_of(1)
    local served = {}
    for i = 1, 16 do served[i] = send(hot, 3000).server end
    local by = count(served)
    assert.are.equal(4, size(by))
    assert.is_true(most(by) <= 5)  -- 1.25 x 16 / 4
  end)

  it("counts its own picks that HAProxy has not counted at a server yet", function()
    load(FOUR)
    local hot = key_of(1)
    local picks = {}
    for i = 1, 16 do picks[i] = pick(hot) end  -- a burst: none has reached its server yet
    assert.is_true(most(count(picks)) <= 5)
  end)

  it("reads the stats again after any pick: one served and let go in the same millisecond is seen", function()
    load({a = {maxconn = 1}, b = {maxconn = 1}})
    local reads = 0
    for _, server in pairs(h.core.backends.m.servers) do
      local get_stats = server.get_stats
      server.get_stats = function(self) reads = reads + 1; return get_stats(self) end
    end
    local key = key_of(5)
    local home = pick(key)
    h:send("m", home, 0)
    h:advance(0)  -- counted at its server, answered and let go: the clock has not moved
    assert.are.equal(home, pick(key))  -- its home is free: the next turn goes home
    assert.are.equal(4, reads)  -- a reading of the 2 servers for each pick
  end)

  it("lets a later turn's wait for its home and its pick share one reading", function()
    load({a = {maxconn = 1}, b = {maxconn = 1}})
    local key = key_of(5)
    local home = send(key, 10).server
    h:advance(10)
    local reads = 0
    for _, server in pairs(h.core.backends.m.servers) do
      local get_stats = server.get_stats
      server.get_stats = function(self) reads = reads + 1; return get_stats(self) end
    end
    local txn = h:txn("m", nil, {["txn.prefix_hash"] = key})
    assert.is_true(h:action("numa_home_wait", txn, "m", 1000).done)  -- its home is free: no wait
    assert.are.equal(home, h:fetch("numa_pick", txn, "m", "1.25"))
    assert.are.equal(2, reads)  -- the 2 servers read once for both
  end)

  it("holds a slot for a pick until its server counts the request, or pick.memory_ms", function()
    load({a = {maxconn = 1}, b = {maxconn = 1}})
    local first, second = pick(key_of(1)), pick(key_of(2))
    assert.are.same({a = 1, b = 1}, count({first, second}))
    assert.are.equal("", pick(key_of(3)))  -- both slots taken by picks on their way
    h:send("m", first, 100)  -- one arrives: counted once, at its server
    assert.are.equal("", pick(key_of(3)))
    h:advance(100)  -- and ends: its slot is free again
    assert.are.equal(first, pick(key_of(3)))
    h:advance(1000)  -- the others never arrived: forgotten
    assert.are_not.equal("", pick(key_of(4)))
    assert.are_not.equal("", pick(key_of(5)))
  end)

  it("past the bound, names no server: the rest wait in the backend's one queue", function()
    load({a = {maxconn = 2}, b = {maxconn = 2}})
    local hot = key_of(1)
    local reqs, picks = {}, {}
    for i = 1, 8 do reqs[i], picks[i] = send(hot, 3000) end
    assert.are.same({"", "", "", ""}, {picks[5], picks[6], picks[7], picks[8]})
    local b = h.core.backends.m
    assert.are.equal(4, #b.queue)
    assert.are.equal(0, #b.servers.a.queue + #b.servers.b.queue)
    h:advance(6000)
    local served = {}
    for i = 1, 8 do
      assert.is_true(reqs[i].done)
      served[i] = reqs[i].server
    end
    local by = count(served)
    assert.is_true(most(by) <= 5 and size(by) == 2)
  end)

  it("keeps a later turn at a home serving one other request, however few are in flight", function()
    -- 8 servers of 4 slots, 2 requests in flight: the factor alone gives a bound of
    -- ceil(1.25 x 3 / 8) = 1, and the turn would leave a home with 3 free slots to read its
    -- whole history elsewhere; pick.least_bound (2) keeps it home.
    local servers = {}
    for _, name in ipairs({"a", "b", "c", "d", "e", "f", "g", "h"}) do servers[name] = {maxconn = 4} end
    load(servers)
    local key, other = key_of(1), nil
    local _, home = send(key, 100)
    h:advance(200)
    for k = 2, 200 do  -- another conversation homed on the same server
      local _, where = send(key_of(k), 5000)
      if where == home then other = k break end
      h:advance(6000)
    end
    assert.is_not_nil(other)
    local _, elsewhere = send(key_of(999), 5000)  -- and one more in flight somewhere
    assert.are_not.equal(home, elsewhere)
    local _, next_turn = send(key, 100)
    assert.are.equal(home, next_turn)
    -- A third with the same home, two in flight there: past the bound, it moves.
    local _, third = send(key, 100)
    assert.are_not.equal(home, third)
  end)

  it("spreads conversations first seen together evenly, and each keeps its instance", function()
    load({a = {maxconn = 4}, b = {maxconn = 4}})
    local function turn(order)
      local served = {}
      for _, c in ipairs(order) do
        local req = send(key_of(c), 3000)
        served[c] = req.server
        h:advance(150)
      end
      h:advance(5000)
      return served
    end
    local first = turn({1, 2, 3, 4, 5, 6, 7, 8})
    assert.are.same({a = 4, b = 4}, count(first))
    assert.are.same(first, turn({8, 7, 6, 5, 4, 3, 2, 1}))
  end)

  it("gives a key whose home is full or past the bound a new home, which its next turn meets", function()
    load({a = {maxconn = 1}, b = {maxconn = 1}})
    local key = key_of(3)
    local _, home = send(key, 3000)
    local _, moved = send(key, 100)
    assert.are_not.equal(home, moved)
    h:advance(3000)
    local _, next_turn = send(key, 100)
    assert.are.equal(moved, next_turn)
  end)

  it("forgets a key not seen for a whole generation and keeps one seen again", function()
    load({a = {}, b = {}}, {["pick.home_generation"] = "2"})
    local function remembered()
      local found = {}
      for key in h:cli("numa-infer homes"):gmatch("m %S+ (%d+)\n") do found[tonumber(key)] = true end
      return found
    end
    placement({1, 2, 3})  -- a third key: a new generation, {1, 2} the older
    assert.are.same({[1] = true, [2] = true, [3] = true}, remembered())
    placement({1, 4})  -- 1 seen again moves to the newer; 4 starts another, 2 is forgotten
    assert.are.same({[1] = true, [3] = true, [4] = true}, remembered())
  end)

  describe("the wait for a busy home", function()
    -- `http-request lua.numa_home_wait m <prefix_wait_s in ms>`, on a chat's later turn.
    local function wait(key, wait_ms)
      local txn = h:txn("m", nil, {["txn.prefix_hash"] = key})
      return h:action("numa_home_wait", txn, "m", wait_ms), txn
    end

    before_each(function()
      load({a = {maxconn = 1}, b = {maxconn = 1}})
    end)

    it("waits up to its limit, then the pick sends it to the free instance, its new home", function()
      local key = key_of(5)
      local _, home = send(key, 3000)
      h:advance(500)
      local start = h.ms
      local stream, txn = wait(key, 1000)
      assert.is_false(stream.done)
      h:advance(1100)
      assert.is_true(stream.done)
      assert.is_true(stream.ended - start >= 1000 and stream.ended - start <= 1025)
      assert.is_true(txn:get_var("txn.prefix_waited"))
      local _, second = send(key, 3000)
      assert.are_not.equal(home, second)
      h:advance(5000)
      local _, third = send(key, 100)
      assert.are.equal(second, third)
    end)

    it("gets its home back when the home frees before the limit", function()
      local key = key_of(5)
      local _, home = send(key, 3000)
      h:advance(500)
      local stream = wait(key, 6000)
      h:advance(2400)
      assert.is_false(stream.done)
      h:advance(125)
      assert.is_true(stream.done)
      local _, second = send(key, 100)
      assert.are.equal(home, second)
    end)

    it("does not wait for a home with a free slot, out of rotation, or for a key without one", function()
      local key = key_of(5)
      local _, home = send(key, 10)
      h:advance(10)
      local stream, txn = wait(key, 1000)
      assert.is_true(stream.done)
      assert.is_nil(txn:get_var("txn.prefix_waited"))
      h:send("m", home, 3000)
      h:set_state("m", home, "DRAIN")
      assert.is_true(wait(key, 1000).done)
      assert.is_true(wait(key_of(99), 1000).done)
    end)

    it("lets one request wait per home at a time: a burst goes on at once", function()
      local key = key_of(5)
      send(key, 3000)
      local first = wait(key, 2000)
      local second = wait(key, 2000)
      assert.is_false(first.done)
      assert.is_true(second.done)
      -- A waiter dropped mid-sleep holds the place until its deadline, then frees it.
      h:drop(first)
      assert.is_true(wait(key, 2000).done)
      h:advance(2000)
      assert.is_false(wait(key, 2000).done)
    end)
  end)

  it("gives the next HAProxy the homes, for backends and servers that are still there", function()
    load({a = {maxconn = 16}, b = {maxconn = 16}, c = {maxconn = 16}})
    -- Placed under load, the homes differ from where an idle fleet would send the keys.
    local homes = {}
    for i = 1, 24 do
      local req = send(key_of(i), 60000)
      homes[key_of(i)] = req.server
      if i % 5 == 0 then h:send("m", req.server, 60000) end
    end
    local saved = h:cli("numa-infer homes") .. "m gone-server 12345\nnot-a-backend a 77\n"
    h:close()
    load({a = {maxconn = 8}, b = {maxconn = 8}, c = {maxconn = 8}})
    local idle = placement(keys(24))
    h:close()
    load({a = {maxconn = 8}, b = {maxconn = 8}, c = {maxconn = 8}}, nil, saved)
    assert.are_not.same(homes, idle)
    assert.are.same(homes, placement(keys(24)))
    assert.is_nil(h:cli("numa-infer homes"):find("gone%-server"))
  end)
end)
