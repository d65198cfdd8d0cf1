-- numa-infer.lua: the one file haproxy.cfg loads reads the data beside it and runs the
-- files it names (numad_infer/frontdoor/lua.py).
local fake = require("tests.lua.fake_haproxy")

describe("numa-infer.lua", function()
  local h

  after_each(function()
    if h ~= nil then h:close() end
    h = nil
  end)

  local function globals()
    local names = {}
    for name in pairs(_G) do names[name] = true end
    return names
  end

  it("runs every file the data names, and sets no global of its own", function()
    local before = globals()
    h = fake.load({"numa-infer-hold.lua", "numa-infer-pick.lua", "numa-infer-batch.lua", "numa-infer-tokens.lua"})
    local added = {}
    for name in pairs(_G) do
      if not before[name] and name ~= "core" and name ~= "filter" then added[#added + 1] = name end
    end
    table.sort(added)
    assert.are.same({}, added)  -- besides HAProxy's `core` and `filter`, which the fake sets
    for _, name in ipairs({"numa_hold", "numa_hold_again", "numa_home_wait", "numa_batch_wait", "numa_batch_landed"}) do
      assert.is_not_nil(h.actions[name], name)
    end
    assert.is_not_nil(h.fetches.numa_pick)
    assert.is_not_nil(h.fetches.numa_in_rotation)
    assert.is_not_nil(h.filters.numa_tokens)
    assert.is_not_nil(h.clis["numa-infer homes"])
  end)

  it("registers under the names the data gives", function()
    h = fake.load({"numa-infer-hold.lua"}, {["hold.action"] = "other_hold", ["hold.fetch"] = "other_fetch"})
    assert.is_not_nil(h.actions.other_hold)
    assert.is_nil(h.actions.numa_hold)
    assert.is_not_nil(h.fetches.other_fetch)
  end)

  it("fails the load (and so `haproxy -c`) when the data lacks a value a file reads", function()
    assert.has_error(function()
      fake.load({"numa-infer-pick.lua"}, {["pick.memory_ms"] = "soon"})
    end)
    local ok, message = pcall(fake.load, {"numa-infer-batch.lua"}, {["batch.step_ms"] = false})
    assert.is_false(ok)
    assert.truthy(tostring(message):find("numa-infer-lua.data has no batch.step_ms", 1, true))
  end)
end)
