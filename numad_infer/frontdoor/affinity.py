"""Which instance of a model a request goes to (`frontend.affinity`), as HAProxy's lines
in each model's backend: the least busy (`none`), a stick table on a request header or on
the OpenAI `user` field (`header`, `user`: later turns follow the first), or a bounded
consistent hash of the prompt's start (`prefix`, docs/frontdoor.md "Prefix routing"). Pure.
"""

from __future__ import annotations

from numad_infer.config.frontend import Affinity, FrontendSection

# Conversations remembered at once: entries are made as keys arrive, each about 50 bytes
# of HAProxy's own plus the 128-byte key, so the table stays under ~20 MiB.
STICK_ENTRIES = 100_000
# affinity = "prefix": the variable `balance hash` reads, and each server's weight (ring_weight).
PREFIX_KEY = "txn.prefix_key"
RING_WEIGHT = 16


def balance(front: FrontendSection) -> list[str]:
    """How a backend picks a server: a bounded consistent hash of the prefix key, or the
    least busy (none, and the stick tables of header and user, whose first turn it places)."""
    if front.affinity != Affinity.PREFIX:
        return ["    balance leastconn"]
    # A request without a key (no JSON, no readable prompt) is hashed on a random one
    # (_prefix says why): served, never refused.
    return [f"    balance hash var({PREFIX_KEY})",
            "    hash-type consistent",
            # HAProxy counts a server's load as the requests it is serving (not those queued
            # for it) and skips, along the ring, any server already at factor x the mean.
            f"    hash-balance-factor {_factor(front)}"]


def _factor(front: FrontendSection) -> int:
    return round(front.prefix_balance_factor * 100)


def ring_weight(front: FrontendSection) -> str:
    # HAProxy puts 16 points per unit of weight on its ring: at weight 1 two servers split
    # 600 random keys 252/348, at 16 289/311 (measured, HAProxy 2.6). All servers weigh the
    # same, so leastconn and the bound are unchanged.
    return f" weight {RING_WEIGHT}" if front.affinity == Affinity.PREFIX else ""


def _prefix(front: FrontendSection, backend: str, slots: int) -> list[str]:
    """The hash key of `affinity = "prefix"`, in PREFIX_KEY: what stays the same across a
    conversation's turns and differs between conversations.

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

    The bound counts the requests a server is serving, not those waiting for it, and a
    hashed request whose server is full waits in that server's own queue, where no other
    server takes it (measured: 8 requests with one key over 2 servers of 2 slots, 6 on one,
    the last done after 9 s against 6 s with leastconn). Below 1/factor of the backend's
    slots (in use or waiting) no full server is within the bound, so that cannot happen;
    above it the key is replaced by a random one: the request goes to a random server
    within the bound instead of piling onto its key's.

    A request without a key gets a random one too, not HAProxy's round robin: over a
    consistent-hash ring HAProxy 2.6 forgets its round-robin position whenever every server
    was full, then looks at the ring's first server only, and queues while another server
    is free (measured: 12 keyless requests over 2 servers of 1 slot, all 12 on one, twice
    leastconn's time)."""
    cut = f"bytes(0,{front.prefix_bytes})"
    first, second = "txn.prefix_first", "txn.prefix_second"

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
            f"    http-request set-var({PREFIX_KEY}) var({first}),concat(,{second},)",
            f"    http-request set-var({PREFIX_KEY}) req.hdr({front.affinity_header}) "
            f"if {{ req.hdr({front.affinity_header}) -m found }}",
            # be_conn counts this request and those queued; nbsrv the servers in rotation (never
            # 0: with none, the hold server, but then the request waits in the hold first).
            f"    http-request set-var(txn.prefix_room) nbsrv({backend}),mul({slots * 100})",
            f"    acl prefix_crowded be_conn({backend}),mul({_factor(front)}),sub(txn.prefix_room) gt 0",
            f"    http-request set-var({PREFIX_KEY}) rand() if prefix_crowded || !{{ var({PREFIX_KEY}) -m found }}"]


def rules(front: FrontendSection, backend: str, slots: int) -> list[str]:
    """Header and user: the first turn goes where leastconn sends it; later turns follow it
    (stick table), to the instance whose KV cache already holds the conversation's prompt
    prefix. Prefix: the key `balance hash` reads."""
    if front.affinity == Affinity.NONE:
        return []
    if front.affinity == Affinity.PREFIX:
        return _prefix(front, backend, slots)
    key = (f"req.hdr({front.affinity_header})" if front.affinity == Affinity.HEADER
           else "req.body,json_query('$.user')")
    expire = max(int(front.affinity_expire_s * 1000), 1)
    return [f"    stick-table type string len 128 size {STICK_ENTRIES} expire {expire}ms",
            f"    stick on {key}"]
