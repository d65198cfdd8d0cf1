-- numa-infer's Lua for HAProxy (numad_infer/frontdoor/lua.py): the one file haproxy.cfg
-- loads (`lua-load`, which takes no arguments). The daemon copies it beside haproxy.cfg
-- with the files it loads and numa-infer-lua.data, what the Python side tells them (names,
-- limits: "key value" lines); do not edit the copies. It reads the data, then runs each
-- file the data's `lua.load` names, handing it the table below: no global is set.
local source = debug.getinfo(1, "S").source
assert(source:sub(1, 1) == "@", "numa-infer.lua: load it from a file (lua-load)")
local dir = source:match("^@(.*)/[^/]*$") or "."  -- a bare name: the working directory, as lua-load's

local numa = {dir = dir}

local values = {}
local file = assert(io.open(dir .. "/numa-infer-lua.data", "r"))
for line in file:lines() do
  local key, value = line:match("^(%S+) (.*)$")
  if key ~= nil then values[key] = value end
end
file:close()

-- A value of the data; one missing fails the load (and so `haproxy -c`), never a request.
function numa.text(key)
  local value = values[key]
  if value == nil then error("numa-infer-lua.data has no " .. key, 2) end
  return value
end

function numa.number(key)
  local value = tonumber(numa.text(key))
  if value == nil then error("numa-infer-lua.data: " .. key .. " is not a number", 2) end
  return value
end

-- HAProxy's clock, in ms.
function numa.now_ms()
  local t = core.now()
  return t.sec * 1000 + t.usec // 1000
end

for name in numa.text("lua.load"):gmatch("%S+") do
  assert(loadfile(dir .. "/" .. name))(numa)
end
