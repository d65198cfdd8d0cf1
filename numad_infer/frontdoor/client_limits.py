"""What a client that has not sent its request yet may hold at the front door. Pure.

A connection that sends nothing takes one of HAProxy's connections (its global `maxconn`)
all the same, and with every one taken a new client waits in the kernel's queue: so a
connection waits `tuning.header_timeout_s` for its request line and headers, not
HAProxy's 30 s that still bound the body (`timeout http-request` of the backends, where
`option http-buffer-request` waits for it). A client refused without a key is closed with
its 401 (tenants.py), and one asking for a path not forwarded with its 404 (api_paths.py),
so neither keeps a kept-alive connection. `frontend.connections_per_source` caps one
address; off by default, as behind a load balancer every client shares its address.
docs/security.md has what an unauthenticated client can still cost, measured.
"""

from __future__ import annotations

from numad_infer.config.frontend import FrontendSection
from numad_infer.frontdoor import names

SOURCES = names.CLIENT_SOURCES  # the backend that only holds the per-address connection counts


def _ms(seconds: float) -> str:
    return f"{max(int(seconds * 1000), 1)}ms"


def rules(front: FrontendSection) -> list[str]:
    """The frontend's lines: HAProxy's frontend `timeout http-request` covers the request
    line and headers of a connection's first request, and of a kept-alive one's next (after
    `timeout http-keep-alive`); with connections_per_source, one more is refused at once."""
    lines = [f"    timeout http-request {_ms(front.header_timeout_s)}"]
    if front.connections_per_source:
        lines += [f"    tcp-request connection track-sc1 src table {SOURCES}",
                  f"    tcp-request connection reject if {{ sc1_conn_cur gt {front.connections_per_source} }}"]
    return lines


def table(front: FrontendSection) -> list[tuple[str, str]]:
    """The per-address counts (IPv4 addresses are stored mapped into IPv6): (its backend, its line)."""
    if not front.connections_per_source:
        return []
    return [(SOURCES, "    stick-table type ipv6 size 100k expire 60s store conn_cur")]
