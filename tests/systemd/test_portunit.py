"""numa-infer-port.socket kept in step with frontend.listen, and given the port back on a stop
(numad_infer/backends/portunit.py). systemctl is a stand-in script here that records its
calls; the VM suite (tests/vm, 2x2) runs the real one."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from numad_infer.backends.portunit import PortUnit
from numad_infer.backends.systemd import FrontdoorHandout, SystemdBackend
from numad_infer.config.load import parse_config
from numad_infer.frontdoor.listener import HeldListener
from numad_infer.host.identity import BackendKind
from numad_infer.plan.model import Plan
from numad_infer.systemd.systemctl import Systemctl
from numad_infer.systemd.unitnames import PORT_DROPIN, PORT_FD_NAME, UNIT_MARKER
from tests.daemon_harness import free_port_block
from tests.fakes import loaded_for
from tests.frontdoor.harness import systemd_socket
from tests.unitfiles import values_of


def stand_in(tmp_path: Path, load_state: str = "loaded") -> Systemctl:
    script = tmp_path / "systemctl"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n'
                      f'case "$1" in show) printf "Id=numa-infer-port.socket\\nLoadState={load_state}\\n";; esac\n')
    script.chmod(0o755)
    return Systemctl(binary=str(script))


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


def config(listen: str):
    return parse_config(f'[model]\npath = "/m.gguf"\n[frontend]\nlisten = "{listen}"\n')


def test_the_drop_in_follows_frontend_listen_and_goes_where_the_shipped_addresses_do(tmp_path: Path) -> None:
    unit = PortUnit(stand_in(tmp_path), tmp_path / "etc")
    dropin = tmp_path / "etc" / PORT_DROPIN
    assert unit.sync(config("127.0.0.1:9000"))  # changed: a daemon-reload is due
    assert values_of(dropin.read_text(), "ListenStream") == ["", "127.0.0.1:9000", "[::1]:9000"]
    assert not unit.sync(config("127.0.0.1:9000"))  # the same again: no reload
    assert unit.sync(config("127.0.0.1:8000")) and not dropin.exists() and not dropin.parent.exists()


def test_an_operator_s_own_file_under_that_name_is_left_alone(tmp_path: Path) -> None:
    dropin = tmp_path / PORT_DROPIN
    dropin.parent.mkdir()
    dropin.write_text("[Socket]\nListenStream=\nListenStream=127.0.0.1:7000\n")
    assert not PortUnit(stand_in(tmp_path), tmp_path).sync(config("127.0.0.1:9000"))
    assert "7000" in dropin.read_text()


def test_without_the_socket_unit_nothing_is_written(tmp_path: Path) -> None:
    # A source install that copied numa-infer.service only: no drop-in for a unit systemd lacks.
    assert not PortUnit(stand_in(tmp_path, "not-found"), tmp_path).sync(config("127.0.0.1:9000"))
    assert not (tmp_path / PORT_DROPIN).exists()


def test_a_changed_drop_in_alone_reloads_systemd_before_the_front_door_binds(tmp_path: Path) -> None:
    # The instances' units as they are; only frontend.listen moved. The reload makes systemd
    # let go of the unit's socket on the old address (the front door binds the new one next).
    systemctl = stand_in(tmp_path)
    handout = FrontdoorHandout(lambda name, fd: None, {}, frozenset({0}), None, tmp_path / "listener.sock",
                               PortUnit(systemctl, tmp_path / "etc"))
    moved = parse_config(f'[model]\npath = "/m.gguf"\n[tuning]\nunit_dir = "{tmp_path / "units"}"\n'
                         '[frontend]\nlisten = "127.0.0.1:9000"\n')
    assert not SystemdBackend(systemctl, handout=handout).sync(loaded_for(moved, Plan(()), kind=BackendKind.PROCESS))
    assert calls(tmp_path)[-1] == "daemon-reload" and (tmp_path / "etc" / PORT_DROPIN).exists()


def test_a_stop_on_a_socket_of_its_own_has_the_unit_bind_beside_it_first(tmp_path: Path) -> None:
    port = free_port_block(1)
    listener = HeldListener()
    listener.hold("127.0.0.2", port)  # a new frontend.listen: bound by the daemon
    PortUnit(stand_in(tmp_path), tmp_path).take_over(listener)
    assert calls(tmp_path)[-2:] == ["stop -- numa-infer-port.service",
                                    "restart --job-mode=ignore-dependencies -- numa-infer-port.socket"]
    own = listener.held()[0].sock
    # Lent (the unit may bind beside it) and refused (so the unit's socket gets every connection).
    assert own.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) and listener.fds == {}
    listener.release()


def test_a_stop_on_the_unit_s_own_socket_asks_systemd_nothing(tmp_path: Path) -> None:
    port = free_port_block(1)
    unit_socket = systemd_socket("127.0.0.2", port)
    listener = HeldListener()
    listener.offer({PORT_FD_NAME: [os.dup(unit_socket.fileno())]})
    listener.hold("127.0.0.2", port)
    PortUnit(stand_in(tmp_path), tmp_path).take_over(listener)
    assert calls(tmp_path) == []
    listener.release()
    unit_socket.close()


def test_the_marker_leads_the_drop_in(tmp_path: Path) -> None:
    PortUnit(stand_in(tmp_path), tmp_path).sync(config("10.0.0.5:8000"))
    assert (tmp_path / PORT_DROPIN).read_text().startswith(UNIT_MARKER + "\n")
