"""Which instance of a model a request goes to (`frontend.affinity`), as HAProxy's lines
in each model's backend: the least busy (`none`), a stick table on a request header or on
the OpenAI `user` field (`header`, `user`: later turns follow the first), or the prompt's
start, within a load bound (`prefix`, docs/frontdoor.md "Prefix routing"). Pure.

Prefix routing is not HAProxy's `hash-type consistent` with `hash-balance-factor`: that
bound counts only the requests a server is serving, not those waiting for it, and a hashed
request whose server is full waits in that server's own queue, where no other server takes
it (docs/design/prefix-routing.md). The pick is a small Lua fetch instead
(lua/numa-infer-pick.lua, in the Lua HAProxy loads): a key goes to its home (the instance
it went to first: the least loaded then, the highest scoring for the key by rendezvous hashing among
equals), skipping any instance without a free slot or whose load (serving and waiting
for it) would pass the factor x the mean, rounded up, then `use-server`. A busy home is
waited for up to `tuning.prefix_wait_s` first by a chat's later turn (the Lua action
WAIT), whether another instance has room or not. When none has room, no pick: the
request waits in the backend's one queue (leastconn), where queue_size, the priority
classes and their deadlines apply, for whichever instance frees first. A drained instance
keeps its keys, and the bound holds however busy the backend is.
"""

from __future__ import annotations

from numad_infer.config.frontend import Affinity, FrontendSection
from numad_infer.frontdoor import answers, names

# Conversations remembered at once: entries are made as keys arrive, each about 50 bytes
# of HAProxy's own plus the 128-byte key, so the table stays under ~20 MiB.
STICK_ENTRIES = 100_000
# How a backend picks a server when no rule chose one, under every affinity: the least busy
# (the first turn of header and user; a prefix request without a key, or past the bound).
BALANCE = "    balance leastconn"
# affinity = "prefix": the key's hash, and the server the Lua fetch picked for it.
PREFIX_HASH = names.PREFIX_HASH
PREFIX_SERVER = names.PREFIX_SERVER
PICK = names.PICK
# Keys whose home the pick keeps, per generation (two are kept): as many as the stick table
# of "header" and "user" remembers conversations, about 10 MiB of Lua tables.
HOME_GENERATION = STICK_ENTRIES // 2
# The longest a pick counts for its server on top of HAProxy's own count (the pick's Lua), when
# the server's session total never shows it.
PICK_MEMORY_MS = 1000

# affinity = "prefix": the wait for a key's busy home (tuning.prefix_wait_s), and how
# often it looks (what it adds to a wait, at most; each look reads every server's stats).
WAIT = names.HOME_WAIT
WAIT_STEP_MS = 25
WAITED = names.PREFIX_WAITED  # set on a request that waited: the queue's bound is checked again
LATER_TURN = names.PREFIX_LATER  # a chat's later turn: only such a request waits for its home
# affinity = "prefix": the load bound (tuning.prefix_balance_factor x the mean) is never
# below this many requests. Below ~0.8 requests in flight per instance the factor alone
# gives a bound of 1: a home serving one other request, slots free, sent its conversation
# away to read the whole history again elsewhere (seconds on a CPU), where sharing the home
# costs reading the new message at half speed. 8 instances of 4 slots at a third of the
# slots busy: later turns home 85 -> 100 %, p90 4.6 -> 0.8 s (bench/README.md). A hot key
# still spreads: one instance takes at most this many of it while the others are idle.
LEAST_BOUND = 2

# The homes outlive a reload (a plan or tenant change starts a new HAProxy process, whose
# Lua starts empty): the daemon reads them with this runtime API command just before it
# reloads and writes them to this file beside the Lua file, which reads it once at start.
HOMES_NAME = "haproxy.homes"
HOMES_COMMAND = "numa-infer homes"

# The pick's Lua (lua/numa-infer-pick.lua: the fetch PICK, the action WAIT, the homes) and
# what it reads from the data file (lua.py), besides the names it shares with the rules (names.py).
LUA_FILE = "numa-infer-pick.lua"
LUA_DATA: dict[str, str | int] = {"pick.home_generation": HOME_GENERATION,
                                  "pick.memory_ms": PICK_MEMORY_MS, "pick.wait_step_ms": WAIT_STEP_MS,
                                  "pick.least_bound": LEAST_BOUND,
                                  "pick.homes_file": HOMES_NAME, "pick.homes_command": HOMES_COMMAND}


def _prefix(front: FrontendSection, backend: str) -> list[str]:
    """The hash key of `affinity = "prefix"` (PREFIX_HASH): what stays the same across a
    conversation's turns and differs between conversations, then the server the Lua fetch
    picks for it (each of the backend's own is named in a use-server rule, `uses`).

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
    first, second, key = names.PREFIX_FIRST, names.PREFIX_SECOND, names.PREFIX_KEY

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
            f"if {{ var({PREFIX_HASH}) -m found }}"]


def uses(front: FrontendSection, servers: list[str]) -> list[str]:
    """affinity = "prefix": the server the pick chose, each named (`servers`: the backend's own)."""
    if front.affinity != Affinity.PREFIX:
        return []
    return [f"    use-server {name} if {{ var({PREFIX_SERVER}) -m str {name} }}" for name in servers]


def rules(front: FrontendSection, backend: str, servers: list[str]) -> list[str]:
    """Every line of the affinity: the pick's (`picks`), then the use-server rules (`uses`)."""
    return [*picks(front, backend), *uses(front, servers)]


def admit_again(front: FrontendSection, backend: str) -> list[str]:
    """A request that waited for its busy home was checked against the queue's bound before
    it waited: the queue may have filled meanwhile. Before the use-server rules, where
    HAProxy reads http-request rules in the order it runs them."""
    if front.affinity != Affinity.PREFIX or front.prefix_wait_s <= 0:
        return []
    return [answers.queue_full(backend, front.queue_size, f"{{ var({WAITED}) -m bool }}")]


def picks(front: FrontendSection, backend: str) -> list[str]:
    """Header and user: the first turn goes where leastconn sends it; later turns follow it
    (stick table), to the instance whose KV cache already holds the conversation's prompt
    prefix. Prefix: the key, and the server picked for it. `servers`: the backend's own."""
    if front.affinity == Affinity.NONE:
        return []
    if front.affinity == Affinity.PREFIX:
        return _prefix(front, backend)
    key = (f"req.hdr({front.affinity_header})" if front.affinity == Affinity.HEADER
           else "req.body,json_query('$.user')")
    expire = max(int(front.affinity_expire_s * 1000), 1)
    return [f"    stick-table type string len 128 size {STICK_ENTRIES} expire {expire}ms",
            f"    stick on {key}"]
