"""The names of numa-infer's systemd units and of the files it renders for them. Pure.

An instance is `<template>@<id>` (`tuning.unit_template`, the planner's id: a node, `<node>.<k>`
or `interleave`); its unit is `<template>@<id>.service`, defined by the template unit
`<template>@.service` plus one drop-in, `<template>@<id>.service.d/50-numa-infer.conf`.
Every piece of that arithmetic is here, so a name is built and taken apart one way.
"""

from __future__ import annotations

SUFFIX = ".service"
DAEMON_UNIT = "numa-infer.service"  # shipped: packaging/systemd/numa-infer.service
FRONTDOOR_UNIT = "numa-infer-frontdoor.service"  # rendered by the daemon (render.render_frontdoor_unit)
DROPIN_NAME = "50-numa-infer.conf"  # the one drop-in file numa-infer writes per instance (and for the port)
# Shipped: systemd binds the front door's port from boot and passes it to the daemon
# (`Sockets=` in numa-infer.service); the service it "activates" is a no-op that only
# keeps the socket from being activated again (packaging/systemd/numa-infer-port.socket).
PORT_SOCKET = "numa-infer-port.socket"
PORT_HOLD = "numa-infer-port.service"
PORT_FD_NAME = "port"  # its FileDescriptorName=, as LISTEN_FDNAMES names its sockets
# Its addresses where frontend.listen is not the shipped default, under /etc/systemd/system:
# read at boot, so not in the unit directory (/run, emptied by a reboot).
PORT_DROPIN = f"{PORT_SOCKET}.d/{DROPIN_NAME}"

# Globs (relative to a unit directory) for the files above, to find what an earlier run left.
TEMPLATE_GLOB = f"*@{SUFFIX}"
DROPIN_GLOB = f"*@*{SUFFIX}.d/{DROPIN_NAME}"


def instance_name(template: str, ident: int | str) -> str:
    return f"{template}@{ident}"


def template_of(name: str) -> str:
    """`infer@0` -> `infer`."""
    return name.split("@")[0]


def unit(name: str) -> str:
    """`infer@0` -> `infer@0.service` (what systemctl is given)."""
    return name + SUFFIX


def template_unit(template: str) -> str:
    """`infer` -> `infer@.service`."""
    return f"{template}@{SUFFIX}"


def dropin(name: str) -> str:
    """`infer@0` -> `infer@0.service.d/50-numa-infer.conf`, relative to the unit directory."""
    return f"{unit(name)}.d/{DROPIN_NAME}"


def name_of_dropin(rel: str) -> str:
    """The inverse of `dropin`: `infer@0.service.d/50-numa-infer.conf` -> `infer@0`."""
    return rel.split("/")[0].removesuffix(f"{SUFFIX}.d")

# The variable that names HAProxy's copy of the daemon's listening socket: haproxy.cfg binds
# "fd@${...}" (haproxycfg), the daemon or frontdoor_exec sets it (listener.py).
FRONTDOOR_FD_VARIABLE = "NUMA_INFER_FRONTDOOR_FD"
# Its copy of the socket on the other loopback address ("fd@${...}" too; listener.py says why).
FRONTDOOR_TWIN_FD_VARIABLE = "NUMA_INFER_FRONTDOOR_TWIN_FD"


# The first line of every unit and drop-in numa-infer writes: how unitdir tells its own
# files from an operator's, which it never overwrites or removes.
UNIT_MARKER = "# Managed by numa-infer: rewritten by `numa-infer render` and the daemon; do not edit."
