"""Each model's spare server in HAProxy (haproxy_config.surge_server): where a copy of the
model's only instance serves while that instance restarts (supervision/surge.py).

It is declared disabled at a placeholder address; these calls point it at the copy's port,
move it in and out of rotation, and read what HAProxy last said of it. Edge: the runtime
API, through the daemon's `Frontdoor`."""

from __future__ import annotations

import logging

from numad_infer.frontdoor.control import Frontdoor
from numad_infer.frontdoor.haproxy import AdminState, HaproxyError, ServerStat
from numad_infer.frontdoor.haproxy_config import surge_server
from numad_infer.util.addresses import connect_host
from numad_infer.util.printable import printable

log = logging.getLogger(__name__)


def spare_stat(door: Frontdoor, model: str) -> ServerStat | None:
    """The model's spare server as last read (None: not read, or no such backend)."""
    backend, stat = door.backends.get(model), door.model_stats.get(model)
    return None if backend is None or stat is None else stat.servers.get(surge_server(backend))


def point_spare(door: Frontdoor, model: str, host: str, port: int) -> bool:
    """Point the model's spare server at a copy's port and put it in rotation (HAProxy's own
    check then marks it UP). Said again each pass while the copy serves: a reload reads the
    spare's address back from the config. True when HAProxy took both."""
    backend = door.backends.get(model)
    if backend is None or door.stats is None:
        return False
    name = surge_server(backend)
    try:
        # The address HAProxy connects to (server.host may be a wildcard such as 0.0.0.0).
        answer = door.api.command(f"set server {backend}/{name} addr {connect_host(host)} port {port}").strip()
    except HaproxyError as exc:
        log.error("front door: %s", exc)
        return False
    # HAProxy says what it changed, or that nothing needed to; anything else is a refusal.
    if answer and "no need to change" not in answer and "changed" not in answer:
        log.error("front door: set server %s/%s addr: %s", backend, name, printable(answer))
        return False
    return door.set_server(backend, name, AdminState.READY)


def spare_state(door: Frontdoor, model: str, state: AdminState) -> None:
    backend = door.backends.get(model)
    if backend is not None:
        door.set_server(backend, surge_server(backend), state)
