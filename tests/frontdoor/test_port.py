"""The front door's port is never left for another local user to bind (issue 30, item 6):
clients that reach whoever holds it send their API keys there.

numad_infer/frontdoor/listener.py: the daemon uses the socket numa-infer-port.socket bound at
boot where it is bound to frontend.listen, keeps the port through the drain (refused, but
bound with SO_REUSEADDR off), gives the unit's socket back listening, and holds the other
loopback address too (`localhost`). Here "systemd" is a socket of the test's, passed as
LISTEN_FDS would pass it; the VM suite (tests/vm, 2x2) does it with the real units.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.frontdoor.haproxy_config import HELD_BIND, TWIN_BIND, paths_in, render_haproxy
from numad_infer.frontdoor.checked_config import twin_of
from numad_infer.frontdoor.listener import FD_VARIABLE, STORE_NAME, TWIN_FD_VARIABLE, HeldListener
from numad_infer.systemd.unitnames import PORT_FD_NAME
from numad_infer.util.addresses import loopback_twin
from tests.daemon_harness import free_port_block
from tests.fakes import load_of
from tests.frontdoor.harness import plan_for
from tests.frontdoor.harness import as_root
from tests.frontdoor.harness import binds_beside, systemd_socket


def listening(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def same(fd: int, sock: socket.socket) -> bool:
    return os.fstat(fd).st_ino == os.fstat(sock.fileno()).st_ino


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture
def stored() -> list[tuple[str, int | None]]:
    return []


@pytest.fixture
def listener(stored):
    held = HeldListener(lambda name, fd: stored.append((name, fd)))
    yield held
    held.release()


def test_the_socket_unit_s_socket_is_used_where_it_is_bound_to_frontend_listen(listener, stored) -> None:
    port = free_port_block(1)
    unit = systemd_socket("127.0.0.1", port)
    listener.offer({PORT_FD_NAME: [os.dup(unit.fileno())]})
    listener.hold("127.0.0.1", port)
    assert same(listener.fd, unit) and listener.held()[0].from_unit
    # Stored too: should the unit be stopped meanwhile, a restarted daemon still finds it.
    assert (STORE_NAME, listener.fd) in stored
    unit.close()


def test_a_kept_socket_is_made_non_blocking_for_haproxy_which_shares_it(listener) -> None:
    # systemd passes a socket unit's sockets blocking (NonBlocking=no), on the open file
    # HAProxy accepts on: its workers then stalled in accept() (the VM suite's restart).
    port = free_port_block(1)
    unit = systemd_socket("127.0.0.2", port)
    os.set_blocking(unit.fileno(), True)
    listener.offer({PORT_FD_NAME: [os.dup(unit.fileno())]})
    assert os.get_blocking(unit.fileno()) is False  # one flag for every copy of the open file
    unit.close()


def test_a_socket_unit_still_on_the_previous_address_is_not_used_and_keeps_listening(listener, caplog) -> None:
    old, new = free_port_block(1), free_port_block(1)
    unit = systemd_socket("127.0.0.1", old)
    caplog.set_level(logging.WARNING)
    listener.offer({PORT_FD_NAME: [os.dup(unit.fileno())]})
    assert listener.hold("127.0.0.1", new)  # bound here: a HAProxy on the old one is restarted
    assert not same(listener.fd, unit) and listener.address == ("127.0.0.1", new)
    assert f"holds 127.0.0.1:{old}, frontend.listen is 127.0.0.1:{new}: not using it" in caplog.text
    # Never shut down: it is systemd's, which would drop it (and the port) on a hang-up.
    assert listening(unit)
    unit.close()


def test_one_socket_from_both_the_unit_and_the_store_is_taken_once_as_the_unit_s(listener, stored) -> None:
    port = free_port_block(1)
    unit = systemd_socket("127.0.0.1", port)
    listener.offer({STORE_NAME: [os.dup(unit.fileno())], PORT_FD_NAME: [os.dup(unit.fileno())]})
    listener.hold("127.0.0.1", port)
    assert same(listener.fd, unit) and listener.held()[0].from_unit  # the unit's: never left shut down
    assert (STORE_NAME, None) not in stored  # the copy is not a stale entry to drop either
    unit.close()


def test_a_kept_socket_a_drain_left_shut_down_listens_again(listener) -> None:
    # A daemon killed while it drained: the store kept its socket refused, still bound.
    # (127.0.0.2: no loopback twin, which would be bound anew.)
    port = free_port_block(1)
    kept = systemd_socket("127.0.0.2", port)
    kept.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    kept.shutdown(socket.SHUT_RDWR)
    listener.offer({STORE_NAME: [os.dup(kept.fileno())]})
    assert not listener.hold("127.0.0.2", port)  # nothing new: a running HAProxy has it already
    assert same(listener.fd, kept) and listening(kept)
    socket.create_connection(("127.0.0.2", port), timeout=5).close()
    kept.close()


def test_the_drain_refuses_and_keeps_the_port_and_the_unit_gets_its_socket_back_listening(listener, stored) -> None:
    port = free_port_block(1)
    unit = systemd_socket("127.0.0.1", port)
    listener.offer({PORT_FD_NAME: [os.dup(unit.fileno())]})
    listener.hold("127.0.0.1", port)
    listener.refuse()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    # Before: refused and bound, but with SO_REUSEADDR on, so anyone's SO_REUSEADDR socket
    # could bind the port (Linux allows it while neither listens) and listen on it.
    assert not binds_beside("127.0.0.1", port) and listener.fds == {}
    listener.release()
    # The stop: the unit's socket listens again (systemd fails a socket unit whose socket
    # hangs up), so the port stays held while the daemon is away.
    assert listening(unit) and not binds_beside("127.0.0.1", port)
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # waits in the backlog
    unit.close()


def test_a_socket_of_its_own_is_refused_while_draining_and_freed_by_a_stop(listener) -> None:
    port = free_port_block(1)
    listener.hold("127.0.0.1", port)
    listener.refuse()
    assert not binds_beside("127.0.0.1", port)
    listener.release()  # under systemd, numa-infer-port.socket took it over first (portunit.py)
    assert binds_beside("127.0.0.1", port)


@as_root
def test_a_lent_socket_lets_a_root_socket_bind_beside_it_and_no_other_user(listener) -> None:
    port = free_port_block(1)
    listener.hold("127.0.0.1", port)
    listener.refuse()
    assert ("127.0.0.1", port) in listener.lend()
    squat = ("import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
             "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1); s.bind(('127.0.0.1', int(sys.argv[1]))); "
             "s.listen(1)")
    nobody = subprocess.run(["python3", "-c", squat, str(port)], user="nobody", group="nogroup", extra_groups=[],
                            capture_output=True, text=True, cwd="/")
    assert nobody.returncode != 0 and "Address already in use" in nobody.stderr, nobody
    unit = systemd_socket("127.0.0.1", port)  # numa-infer-port.socket, restarted beside it
    listener.release()
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert unit.accept()[0] is not None and not binds_beside("127.0.0.1", port)
    unit.close()


def test_a_new_address_that_cannot_be_bound_leaves_the_old_one_held(listener) -> None:
    old, new = free_port_block(1), free_port_block(1)
    listener.hold("127.0.0.1", old)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", new))
        taken.listen(1)
        with pytest.raises(OSError):
            listener.hold("127.0.0.1", new)
    # Before: the old socket was let go first, so a failed change left no port at all.
    assert listener.address == ("127.0.0.1", old) and not binds_beside("127.0.0.1", old)


@pytest.mark.parametrize("host, twin", [("127.0.0.1", "::1"), ("0.0.0.0", "::1"), ("::1", "127.0.0.1"),
                                        ("::", "127.0.0.1"), ("0:0::1", "127.0.0.1"), ("127.0.0.2", None),
                                        ("10.1.2.3", None), ("fd00::7", None)])
def test_the_loopback_twin_is_the_other_address_localhost_names(host: str, twin: str | None) -> None:
    assert loopback_twin(host) == twin


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no ::1 on this host")
def test_a_front_door_on_127_0_0_1_also_holds_and_serves_1_at_its_port(listener, stored, tmp_path: Path) -> None:
    port = free_port_block(1)
    listener.hold("127.0.0.1", port)
    fds = listener.fds
    twin = socket.socket(fileno=os.dup(fds[TWIN_FD_VARIABLE]))
    assert twin.getsockname()[:2] == ("::1", port) and listening(twin)
    assert not binds_beside("::1", port) and ("frontdoor-twin", fds[TWIN_FD_VARIABLE]) in stored
    twin.close()
    # HAProxy serves it: a second bind line, on the variable the handout fills.
    config = parse_config(f'[model]\npath = "/m.gguf"\n[frontend]\nlisten = "127.0.0.1:{port}"\n')
    served, engine = load_of(config)
    text = render_haproxy(config, plan_for(tmp_path, config), paths_in(tmp_path, tmp_path / "admin.sock"), held=True,
                          twin=True, served=served, engine=engine)
    assert f"    bind {HELD_BIND}\n    bind {TWIN_BIND}\n" in text


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no ::1 on this host")
def test_a_twin_someone_else_holds_is_reported_and_the_front_door_still_listens(listener, caplog) -> None:
    port = free_port_block(1)
    with socket.socket(socket.AF_INET6) as squatter:
        squatter.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        squatter.bind(("::1", port))
        squatter.listen(1)
        caplog.set_level(logging.WARNING)
        listener.hold("127.0.0.1", port)
    # haproxy.cfg binds a twin wherever the host has ::1 (checked_config.py): HAProxy is
    # handed one at a port no client is told of, never the squatter's.
    fds = listener.fds
    assert list(fds) == [FD_VARIABLE, TWIN_FD_VARIABLE]
    stand_in = socket.socket(fileno=os.dup(fds[TWIN_FD_VARIABLE]))
    assert stand_in.getsockname()[0] == "::1" and stand_in.getsockname()[1] != port and listening(stand_in)
    stand_in.close()
    assert f"cannot listen on [::1]:{port} too" in caplog.text and "send it its API key" in caplog.text


def test_the_twin_is_bound_exactly_where_the_host_has_its_address() -> None:
    # What haproxy.cfg's second bind line follows (checked_config.py): a host fact.
    assert twin_of("10.1.2.3") is None
    assert twin_of("127.0.0.1") == ("::1" if has_ipv6_loopback() else None)
    assert twin_of("::1") == "127.0.0.1" or not has_ipv6_loopback()
