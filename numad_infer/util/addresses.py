"""Listen addresses as a local client reaches them. Pure.

One place for the rule, because the daemon's probe, the front door's server lines and
tune's client must all agree on where an instance listening on `server.host` is reached.
"""

from __future__ import annotations

# A server bound to a wildcard address listens on every address of that family, loopback
# included; the loopback is the one a local client can always reach.
_WILDCARD_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def connect_host(host: str) -> str:
    """Where a client on this machine connects to reach a server listening on `host`."""
    return _WILDCARD_LOOPBACK.get(host, host)


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 address in brackets (HAProxy's `bind`/`server` syntax, URLs)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
