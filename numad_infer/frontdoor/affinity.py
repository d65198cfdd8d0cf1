"""Which instance of a model a request goes to (`frontend.affinity`), as HAProxy's lines
in each model's backend: the least busy (`none`), a stick table on a request header or on
the OpenAI `user` field (`header`, `user`: later turns follow the first), or the prompt's
start, within a load bound (`prefix`, docs/frontdoor.md "Prefix routing"). Pure.

Prefix routing is not HAProxy's `hash-type consistent` with `hash-balance-factor`: that
bound counts only the requests a server is serving, not those waiting for it, and a hashed
request whose server is full waits in that server's own queue, where no other server takes
it (measured, HAProxy 2.6: 8 requests with one key over 2 servers of 2 slots, 6 on one, the
last done after 9 s against 6 s with leastconn). The pick is a small Lua fetch instead
(PICK_LUA, in the Lua file HAProxy loads): a key goes to its home (the instance it went to
first: the least loaded then, the highest scoring for the key by rendezvous hashing among
equals), skipping any instance without a free slot or whose load (serving and waiting
for it) would pass the factor x the mean, rounded up, then `use-server`. A busy home is
waited for up to `frontend.prefix_wait_s` first by a chat's later turn (the Lua action
WAIT), whether another instance has room or not. When none has room, no pick: the
request waits in the backend's one queue (leastconn), where queue_size, the priority
classes and their deadlines apply, for whichever instance frees first. A drained instance
keeps its keys, and the bound holds however busy the backend is. (A Lua action on the
response, to make the instance that answered a turn its key's home, was tried and
removed: with the tenants' Lua filter on the same stream, HAProxy 2.6 failed the filter,
"attempt to index a thread value", and left the answer stuck; HAProxy now runs one
thread with tenants, token_count.py, which may have been the cause, untested.)
"""

from __future__ import annotations

from numad_infer.config.frontend import Affinity, FrontendSection

# Conversations remembered at once: entries are made as keys arrive, each about 50 bytes
# of HAProxy's own plus the 128-byte key, so the table stays under ~20 MiB.
STICK_ENTRIES = 100_000
# How a backend picks a server when no rule chose one, under every affinity: the least busy
# (the first turn of header and user; a prefix request without a key, or past the bound).
BALANCE = "    balance leastconn"
# affinity = "prefix": the key's hash, and the server the Lua fetch picked for it.
PREFIX_HASH = "txn.prefix_hash"
PREFIX_SERVER = "txn.prefix_server"
PICK = "numa_pick"
# Keys whose home the pick keeps, per generation (two are kept): as many as the stick table
# of "header" and "user" remembers conversations, about 10 MiB of Lua tables.
HOME_GENERATION = STICK_ENTRIES // 2
# The longest a pick counts for its server on top of HAProxy's own count (PICK_LUA), when
# the server's session total never shows it.
PICK_MEMORY_MS = 1000

# affinity = "prefix": the wait for a key's busy home (frontend.prefix_wait_s), and how
# often it looks (what it adds to a wait, at most; each look reads every server's stats).
WAIT = "numa_home_wait"
WAIT_STEP_MS = 25
WAITED = "txn.prefix_waited"  # set on a request that waited: the queue's bound is checked again
LATER_TURN = "txn.prefix_later"  # a chat's later turn: only such a request waits for its home
# The homes outlive a reload (a plan or tenant change starts a new HAProxy process, whose
# Lua starts empty): the daemon reads them with this runtime API command just before it
# reloads and writes them to this file beside the Lua file, which reads it once at start.
HOMES_NAME = "haproxy.homes"
HOMES_COMMAND = "numa-infer homes"

PICK_LUA = f"""
-- numa-infer's prefix routing (numad_infer/frontdoor/affinity.py): written by the daemon, do not edit.
-- murmur3's 32-bit finalizer: the key's hash mixed with a server's is that server's score.
local function mix(h)
  h = h & 0xffffffff
  h = ((h ~ (h >> 16)) * 0x85ebca6b) & 0xffffffff
  h = ((h ~ (h >> 13)) * 0xc2b2ae35) & 0xffffffff
  return h ~ (h >> 16)
end

local server_hashes = {{}}  -- server name -> FNV-1a of it, computed once
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
local HOME_GENERATION = {HOME_GENERATION}
local homes = {{}}  -- backend name -> {{now = {{key -> server}}, old = {{...}}, n = keys in now}}

local function remember(backend_name, key, server)
  local h = homes[backend_name]
  if h == nil then
    h = {{now = {{}}, old = {{}}, n = 0}}
    homes[backend_name] = h
  end
  if h.now[key] == nil then
    if h.n >= HOME_GENERATION then h.old, h.now, h.n = h.now, {{}}, 0 end
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

-- The homes, for the next HAProxy (`{HOMES_COMMAND}` on the runtime API, which the daemon
-- saves to {HOMES_NAME} just before a reload): "backend server key" lines, the older
-- generation first, so that the newer stays newer when they are read back. All read
-- before the first send: a send may yield, and picks made meanwhile add keys, which a
-- traversal with pairs() must not see happen.
core.register_cli({{"numa-infer", "homes"}}, "numa-infer: each prefix key's home", function(applet)
  local lines = {{}}
  for backend_name, h in pairs(homes) do
    for _, generation in ipairs({{h.old, h.now}}) do
      for key, server in pairs(generation) do
        lines[#lines + 1] = backend_name .. " " .. server .. " " .. key .. "\\n"
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
  local dir = debug.getinfo(1, "S").source:match("^@(.+)/[^/]+$")
  local file = dir and io.open(dir .. "/{HOMES_NAME}", "r")
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
local PICK_MEMORY_MS = {PICK_MEMORY_MS}
local picked = {{}}  -- backend name -> list of {{server name, stot that shows it, ms}}

local function clock_ms()
  local t = core.now()
  return t.sec * 1000 + t.usec // 1000
end

local function uncounted(backend_name, totals, now)
  local kept, counts = {{}}, {{}}
  for _, p in ipairs(picked[backend_name] or {{}}) do
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
local function servers_of(backend_name, backend, now)
  local stats, totals = {{}}, {{}}
  for name, server in pairs(backend.servers) do
    stats[name] = server:get_stats()
    totals[name] = tonumber(stats[name].stot) or 0
  end
  local pending = uncounted(backend_name, totals, now)
  local servers, counted = {{}}, {{}}
  for name, s in pairs(stats) do
    local rotating = in_rotation(s)
    local slots = tonumber(s.slim) or 0
    local load = (tonumber(s.scur) or 0) + (tonumber(s.qcur) or 0) + (pending[name] or 0)
    servers[name] = {{rotating = rotating, load = load, room = rotating and (slots == 0 or load < slots)}}
    counted[name] = totals[name] + (pending[name] or 0)
  end
  return servers, counted
end

-- The server for the request's key (its hash in {PREFIX_HASH}), among the servers that
-- fit it: in rotation (up, not drained, not backups), with a free slot (load below its
-- maxconn), and whose load (requests served and waiting for it) stays within factor x the
-- mean once this one is added:
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
core.register_fetches("{PICK}", function(txn, backend_name, factor_text)
  local backend = core.backends[backend_name]
  local key = tonumber(txn:get_var("{PREFIX_HASH}"))
  if backend == nil or key == nil then return "" end
  local now = clock_ms()
  local servers, counted = servers_of(backend_name, backend, now)
  local up, total = {{}}, 0
  for name, s in pairs(servers) do
    if s.rotating then
      up[#up + 1] = {{name = name, load = s.load, room = s.room, score = mix(key ~ server_hash(name))}}
      total = total + s.load
    end
  end
  if #up == 0 then return "" end
  -- Rounded up, as in the bounded-loads paper (Mirrokni et al.) and HAProxy's own
  -- hash-balance-factor: with one request in flight over two instances the bound is 2, not
  -- 1.25, so a conversation is not sent away from its instance because that instance serves
  -- one other request while the second is idle.
  local bound = math.ceil(tonumber(factor_text) * (total + 1) / #up)
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
  list[#list + 1] = {{chosen, counted[chosen] + 1, now}}
  return chosen
end)

-- Before the pick: a key whose home is in rotation but has no free slot waits for its
-- home up to `wait_ms`, looking every WAIT_STEP_MS. On a CPU the history the home holds
-- costs seconds to read again elsewhere, often more than the turn it waits for; past
-- `wait_ms` the pick sends it to a free instance, or with none to the backend's one queue.
-- With no slot free anywhere it waits too: the one queue would give it the first slot
-- freed, its home's or not (half the time with two instances), and a turn that runs away
-- from home leaves the home behind, so the next turn misses this one (bench/README.md
-- run 9: later turns 0.78-0.92x of least connections at p50 without this wait, 1.85-2.00x
-- with it).
-- One request waits per home at a time (a second would find the slot taken by the first):
-- a burst with one prompt goes on to the free instances at once. A request that waited
-- is marked ({WAITED}): the queue's bound is checked again after the wait.
local WAIT_STEP_MS = {WAIT_STEP_MS}
local waiters = {{}}  -- "backend/server" -> the deadline of the request waiting for that home
core.register_action("{WAIT}", {{"http-req"}}, function(txn, backend_name, wait_ms)
  local key = tonumber(txn:get_var("{PREFIX_HASH}"))
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
      txn:set_var("{WAITED}", true)
    end
    core.msleep(WAIT_STEP_MS)
  end
  if marked then waiters[slot] = nil end
end, 2)
"""


def _prefix(front: FrontendSection, backend: str, servers: list[str]) -> list[str]:
    """The hash key of `affinity = "prefix"` (PREFIX_HASH): what stays the same across a
    conversation's turns and differs between conversations, then the server the Lua fetch
    picks for it (`servers`: the backend's own, each named in a use-server rule).

    - chat: the first message's content, and the second's when the first is the system (or
      developer) prompt: a system prompt that every conversation shares would otherwise
      send them all to one instance, where the bound alone would spread them, at random.
      Each is cut to prefix_bytes on its own for the same reason: a long system prompt
      must not fill the key. A content given as parts is read from its first part's text.
    - completions: the start of `prompt` (a prompt of token ids has no key).
    - a request that sends the affinity header is hashed by it: the client named the
      conversation, which beats a guess from its text.
    json_query returns scalars only, and reads a body cut at the buffer's end as far as it
    goes: a long history behind a short first message still has its key.

    A request without a key (no JSON, no readable prompt) goes to the least busy server:
    served, never refused."""
    cut = f"bytes(0,{front.prefix_bytes})"
    first, second, key = "txn.prefix_first", "txn.prefix_second", "txn.prefix_key"

    def read(var: str, path: str, *when: str) -> str:
        condition = f" if {' '.join(when)}" if when else ""
        return f"    http-request set-var({var}) req.body,json_query('{path}'),{cut}{condition}"

    def unset(var: str) -> str:
        return f"!{{ var({var}) -m found }}"

    return [read(first, "$.messages[0].content"),
            read(first, "$.messages[0].content[0].text", unset(first)),
            read(first, "$.prompt", unset(first)),
            "    acl prefix_system req.body,json_query('$.messages[0].role') -m str system developer",
            read(second, "$.messages[1].content", "prefix_system"),
            read(second, "$.messages[1].content[0].text", "prefix_system", unset(second)),
            f"    http-request set-var({key}) var({first}),concat(,{second},)",
            f"    http-request set-var({key}) req.hdr({front.affinity_header}) "
            f"if {{ req.hdr({front.affinity_header}) -m found }}",
            f"    http-request set-var({PREFIX_HASH}) var({key}),xxh32 if {{ var({key}) -m found }}",
            # Only a later turn of a chat waits for its home (a third message: an answer and
            # the next question after the first): a first turn, a completion or a request
            # repeated as is has no history at home worth a wait, which a short request
            # would pay many times over (bench/tenants.py's quiet tenant: p99 1 s beside a
            # flood that kept its home busy while the other instance had room).
            *([f"    http-request set-var({LATER_TURN}) req.body,json_query('$.messages[2].role')",
               f"    http-request lua.{WAIT} {backend} {int(front.prefix_wait_s * 1000)} "
               f"if {{ var({PREFIX_HASH}) -m found }} {{ var({LATER_TURN}) -m found }}"]
              if front.prefix_wait_s > 0 else []),
            f"    http-request set-var({PREFIX_SERVER}) lua.{PICK}({backend},{front.prefix_balance_factor}) "
            f"if {{ var({PREFIX_HASH}) -m found }}",
            *(f"    use-server {name} if {{ var({PREFIX_SERVER}) -m str {name} }}" for name in servers)]


def rules(front: FrontendSection, backend: str, servers: list[str]) -> list[str]:
    """Header and user: the first turn goes where leastconn sends it; later turns follow it
    (stick table), to the instance whose KV cache already holds the conversation's prompt
    prefix. Prefix: the key, and the server picked for it. `servers`: the backend's own."""
    if front.affinity == Affinity.NONE:
        return []
    if front.affinity == Affinity.PREFIX:
        return _prefix(front, backend, servers)
    key = (f"req.hdr({front.affinity_header})" if front.affinity == Affinity.HEADER
           else "req.body,json_query('$.user')")
    expire = max(int(front.affinity_expire_s * 1000), 1)
    return [f"    stick-table type string len 128 size {STICK_ENTRIES} expire {expire}ms",
            f"    stick on {key}"]
