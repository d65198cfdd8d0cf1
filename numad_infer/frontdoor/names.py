"""Every name the front door's HAProxy rules and its Lua share: the `txn.*` variables a
request carries from one rule to the next, the stick tables, and the Lua's actions, fetches
and filter. Each is named here once, with the module that owns it and what it holds; the
rules take the constants, and the Lua reads the same names from the data file
(`numa-infer-lua.data`, lua.py) under each entry's `lua` key, so a renamed variable is
renamed for both. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

VARIABLE, TABLE, LUA = "variable", "stick table", "lua"


@dataclass(frozen=True)
class Name:
    text: str  # as haproxy.cfg writes it
    kind: str  # VARIABLE, TABLE or LUA
    owner: str  # the module (under numad_infer/frontdoor/) that sets or declares it
    meaning: str
    lua: str | None = None  # its key in the Lua's data file, where the Lua uses it


# -- variables ----------------------------------------------------------------------------------
STARTED_MS = "txn.started_ms"
FIRST_BYTE_MS = "txn.first_byte_ms"
MODEL = "txn.model"
BODY_READ = "txn.body_read"
TENANT = "txn.tenant"
BATCH = "txn.batch"
ARRIVED_MS = "txn.arrived_ms"
PROMPT_TOKENS = "txn.prompt_tokens"
COMPLETION_TOKENS = "txn.completion_tokens"
HOLD_REFUSED = "txn.hold_refused"
HOLD_LET_GO = "txn.hold_let_go"
PREFIX_FIRST = "txn.prefix_first"
PREFIX_SECOND = "txn.prefix_second"
PREFIX_KEY = "txn.prefix_key"
PREFIX_HASH = "txn.prefix_hash"
PREFIX_LATER = "txn.prefix_later"
PREFIX_WAITED = "txn.prefix_waited"
PREFIX_SERVER = "txn.prefix_server"
BATCH_REFUSED = "txn.batch_refused"
BATCH_GRANT = "txn.batch_grant"
# -- stick tables (each the only table of a backend of that name) --------------------------------
TENANT_USAGE = "tenant-usage"
CLIENT_SOURCES = "client-sources"
INTERACTIVE_SEEN = "numa_interactive"
BATCH_FLIGHT = "numa_batch_flight"
# -- the Lua's actions, fetches and filter ---------------------------------------------------------
HOLD_ACTION = "numa_hold"
HOLD_AGAIN = "numa_hold_again"
IN_ROTATION = "numa_in_rotation"
PICK = "numa_pick"
HOME_WAIT = "numa_home_wait"
BATCH_WAIT = "numa_batch_wait"
BATCH_LANDED = "numa_batch_landed"
TOKENS_FILTER = "numa_tokens"

REGISTRY: tuple[Name, ...] = (
    Name(STARTED_MS, VARIABLE, "haproxy_config", "when the frontend saw the request (ms)"),
    Name(FIRST_BYTE_MS, VARIABLE, "haproxy_config", "ms from then to the answer's first body byte (logged)"),
    Name(MODEL, VARIABLE, "routing", "the body's `model`, with several models"),
    Name(BODY_READ, VARIABLE, "routing", "how much of the body HAProxy read"),
    Name(TENANT, VARIABLE, "tenants", "the tenant whose key the request carried (logged)"),
    Name(BATCH, VARIABLE, "tenants", "the request is of the batch class"),
    Name(ARRIVED_MS, VARIABLE, "tenants", "when the gate saw the request: a batch deadline counts from it",
         "batch.arrived_var"),
    Name(PROMPT_TOKENS, VARIABLE, "token_count", "the answer's prompt tokens (logged)", "tokens.prompt_var"),
    Name(COMPLETION_TOKENS, VARIABLE, "token_count", "the answer's completion tokens (logged)",
         "tokens.completion_var"),
    Name(HOLD_REFUSED, VARIABLE, "hold", "the hold gave up: the JSON 503", "hold.refused_var"),
    Name(HOLD_LET_GO, VARIABLE, "hold", "the hold server's wait let the request go", "hold.let_go_var"),
    Name(PREFIX_FIRST, VARIABLE, "affinity", "the prefix key's first part (the first message)"),
    Name(PREFIX_SECOND, VARIABLE, "affinity", "the prefix key's second part (after a system prompt)"),
    Name(PREFIX_KEY, VARIABLE, "affinity", "the prefix key, or the affinity header"),
    Name(PREFIX_HASH, VARIABLE, "affinity", "the prefix key's hash", "pick.hash_var"),
    Name(PREFIX_LATER, VARIABLE, "affinity", "a chat's later turn: it may wait for its home"),
    Name(PREFIX_WAITED, VARIABLE, "affinity", "the request waited for its home", "pick.waited_var"),
    Name(PREFIX_SERVER, VARIABLE, "affinity", "the server the pick chose"),
    Name(BATCH_REFUSED, VARIABLE, "batch_wait", "the batch wait gave up: the JSON 503", "batch.refused_var"),
    Name(BATCH_GRANT, VARIABLE, "batch_wait", "the batch wait let the request go", "batch.grant_var"),
    Name(TENANT_USAGE, TABLE, "tenants", "per tenant: requests in flight, let through in the last minute"),
    Name(CLIENT_SOURCES, TABLE, "client_limits", "per client address: connections open"),
    Name(INTERACTIVE_SEEN, TABLE, "batch_wait", "per backend: interactive requests lately", "batch.seen_table"),
    Name(BATCH_FLIGHT, TABLE, "batch_wait", "per backend: batch requests let go, not yet answered",
         "batch.flight_table"),
    Name(HOLD_ACTION, LUA, "hold", "action: hold a request while no server is in rotation", "hold.action"),
    Name(HOLD_AGAIN, LUA, "hold", "action: the hold server's wait", "hold.again"),
    Name(IN_ROTATION, LUA, "hold", "fetch: servers in rotation (the health path)", "hold.fetch"),
    Name(PICK, LUA, "affinity", "fetch: the prefix key's server", "pick.fetch"),
    Name(HOME_WAIT, LUA, "affinity", "action: a later turn waits for its busy home", "pick.wait"),
    Name(BATCH_WAIT, LUA, "batch_wait", "action: a batch request waits for room", "batch.action"),
    Name(BATCH_LANDED, LUA, "batch_wait", "action: a batch request let go reached a server", "batch.landed"),
    Name(TOKENS_FILTER, LUA, "token_count", "filter: the answer's token counts", "tokens.filter"),
)


def lua_data() -> dict[str, str]:
    """The names the Lua reads from its data file: key -> name."""
    return {entry.lua: entry.text for entry in REGISTRY if entry.lua is not None}
