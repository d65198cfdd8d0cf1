-- numa-infer-hold.lua: a request for a backend with no server in rotation waits for one
-- (numad_infer/frontdoor/hold.py; end to end: tests/frontdoor/test_hold.py).
local fake = require("tests.lua.fake_haproxy")

describe("the hold", function()
  local h

  before_each(function()
    h = fake.load({"numa-infer-hold.lua"})
    h:backend("m", {["infer-0"] = {maxconn = 1}, ["hold-m"] = {backup = true, maxconn = 10}})
    h:backend("other", {["infer-1"] = {maxconn = 1}, ["hold-other"] = {backup = true, maxconn = 10}})
    h:start()
  end)

  after_each(function()
    h:close()
  end)

  -- The backend's first action, as haproxy.cfg runs it: `lua.numa_hold <limit ms> <queue_size>`.
  local function arrive(backend, timeout_ms, most)
    local txn = h:txn(backend)
    return h:action("numa_hold", txn, timeout_ms or 30000, most or 10), txn
  end

  it("lets a request through at once while an instance is in rotation", function()
    local start = h.ms
    local stream, txn = arrive("m")
    assert.is_true(stream.done)
    assert.are.equal(start, stream.ended)
    assert.is_nil(txn:get_var("txn.hold_refused"))
  end)

  it("holds a request while the only instance is down and lets it go once it is back", function()
    h:set_state("m", "infer-0", "DOWN")
    local stream, txn = arrive("m")
    h:advance(2000)
    assert.is_false(stream.done)
    local back = h.ms + 730
    h:after(730, function() h:set_state("m", "infer-0", "UP") end)
    h:advance(1000)
    assert.is_true(stream.done)
    assert.is_nil(txn:get_var("txn.hold_refused"))
    assert.is_true(stream.ended >= back and stream.ended <= back + 50)  -- within one look (hold.step_ms)
    -- Let go, it goes on through the backend as any request: to the instance.
    assert.are.equal("infer-0", h:send("m", nil, 100).server)
  end)

  it("holds new requests for a drained only instance too, while the running ones finish there", function()
    local running = h:send("m", nil, 500)
    h:set_state("m", "infer-0", "DRAIN")
    local stream = arrive("m")
    h:advance(1000)
    assert.is_true(running.done)
    assert.is_false(stream.done)
    h:set_state("m", "infer-0", "UP")
    h:advance(50)
    assert.is_true(stream.done)
  end)

  it("ends a hold at its limit with the mark the JSON 503 answers", function()
    h:set_state("m", "infer-0", "MAINT")
    local start = h.ms
    local stream, txn = arrive("m", 1000)
    h:advance(999)
    assert.is_false(stream.done)
    h:advance(100)
    assert.is_true(stream.done)
    assert.is_true(stream.ended - start >= 1000 and stream.ended - start <= 1050)
    assert.is_true(txn:get_var("txn.hold_refused"))
  end)

  it("lets at most queue_size requests wait; the next is refused at once", function()
    h:set_state("m", "infer-0", "DOWN")
    local first, second = arrive("m", 5000, 2), arrive("m", 5000, 2)
    local third, third_txn = arrive("m", 5000, 2)
    assert.is_false(first.done or second.done)
    assert.is_true(third.done)
    assert.is_true(third_txn:get_var("txn.hold_refused"))
  end)

  it("forgets a waiting request whose client left once its limit has passed", function()
    h:set_state("m", "infer-0", "DOWN")
    local gone = arrive("m", 1000, 1)
    h:drop(gone)  -- HAProxy ends the stream mid-sleep: the action never removes its entry
    local _, refused = arrive("m", 1000, 1)
    assert.is_true(refused:get_var("txn.hold_refused"))
    h:advance(1000)
    local later, txn = arrive("m", 1000, 1)
    assert.is_false(later.done)
    assert.is_nil(txn:get_var("txn.hold_refused"))
  end)

  it("never holds one model's requests for another model's outage", function()
    h:set_state("other", "infer-1", "DOWN")
    local held = arrive("other", 5000, 1)
    local stream = arrive("m", 5000, 1)
    assert.is_false(held.done)
    assert.is_true(stream.done)
    -- Each backend's count is its own: m's bound is not taken by other's waiting request.
    h:set_state("m", "infer-0", "DOWN")
    local waiting, txn = arrive("m", 5000, 1)
    assert.is_false(waiting.done)
    assert.is_nil(txn:get_var("txn.hold_refused"))
  end)

  it("counts the servers in rotation for /healthz, never the hold server", function()
    local txn = h:txn("m")
    assert.are.equal(1, h:fetch("numa_in_rotation", txn, "m"))
    h:set_state("m", "infer-0", "DOWN")
    assert.are.equal(1, txn.f:nbsrv("m"))  -- what HAProxy's nbsrv says now: the hold server
    assert.are.equal(0, h:fetch("numa_in_rotation", txn, "m"))
    assert.are.equal(0, h:fetch("numa_in_rotation", txn, "no such backend"))
  end)

  describe("a request dispatched again to the hold server", function()
    -- The hold frontend's action: `lua.numa_hold_again <limit ms>`; the listener is named by the backend.
    local function again(timeout_ms)
      local txn = h:txn("hold", "m")
      return h:action("numa_hold_again", txn, timeout_ms), txn
    end

    it("waits until its backend has an instance again, then is let go back to it", function()
      h:set_state("m", "infer-0", "DOWN")
      local stream, txn = again(30000)
      h:advance(3000)
      assert.is_false(stream.done)
      h:set_state("m", "infer-0", "UP")
      h:advance(50)
      assert.is_true(stream.done)
      assert.is_true(txn:get_var("txn.hold_let_go"))
    end)

    it("is not let go past its limit, and never counts against the arrivals' bound", function()
      h:set_state("m", "infer-0", "DOWN")
      local streams, txns = {}, {}
      for i = 1, 3 do streams[i], txns[i] = again(1000) end
      local arriving, arriving_txn = arrive("m", 1000, 1)
      assert.is_false(arriving.done)
      assert.is_nil(arriving_txn:get_var("txn.hold_refused"))
      h:advance(1100)
      for i = 1, 3 do
        assert.is_true(streams[i].done)
        assert.is_nil(txns[i]:get_var("txn.hold_let_go"))  -- the hold frontend's 503
      end
    end)
  end)
end)
