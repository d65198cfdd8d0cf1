"""Listen addresses as a local client reaches them. Pure.

One place for the rule, because the daemon's probe, the front door's server lines and
tune's client must all agree on where an instance listening on `server.host` is reached.
"""

from __future__ import annotations

import ipaddress

# A server bound to a wildcard address listens on every address of that family, loopback
# included; the loopback is the one a local client can always reach.
_WILDCARD_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def connect_host(host: str) -> str:
    """Where a client on this machine connects to reach a server listening on `host`."""
    return _WILDCARD_LOOPBACK.get(host, host)


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 address in brackets (HAProxy's `bind`/`server` syntax, URLs)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# `localhost` names both loopback addresses (/etc/hosts: 127.0.0.1 and ::1), and most
# resolvers hand out ::1 first: a client that says `localhost` connects to [::1]:PORT, and
# only where nothing listens there (refused) goes on to 127.0.0.1:PORT. A front door on
# 127.0.0.1 alone left [::1]:PORT to any local user, who then got those clients, and their
# API keys, first. So a front door that listens on one loopback address (or on a wildcard,
# which covers one family's) also holds the other one's port, and serves it: a socket
# bound there but not listening would refuse and send clients on, but systemd holds
# only listening sockets from boot (numa-infer-port.socket), and a listening one that
# nothing served would leave `localhost` clients waiting instead of falling back.
_LOOPBACK_TWIN = {"127.0.0.1": "::1", "0.0.0.0": "::1", "::1": "127.0.0.1", "::": "127.0.0.1"}


def loopback_twin(host: str) -> str | None:
    """The other loopback address a front door on `host` also listens on, None for any other host."""
    return _LOOPBACK_TWIN.get(str(ipaddress.ip_address(host)))


def same_address(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """One address, however it is written (`::1` and `0:0::1`; getsockname's spelling)."""
    return a[1] == b[1] and ipaddress.ip_address(a[0]) == ipaddress.ip_address(b[0])


def unmapped(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4 peer seen through an IPv6 socket (::ffff:127.0.0.1) as the IPv4 address, so
    that the kernel's socket tables and HAProxy's view of a client compare equal."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
