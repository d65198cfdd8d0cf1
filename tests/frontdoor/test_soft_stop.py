"""The front door unit's stop: the signal systemd sends (KillSignal=) lets HAProxy finish
the requests it carries, then exit, within the unit's TimeoutStopSec=. Real HAProxy in
master-worker mode, as the unit runs it (-Ws there: -W here, with no systemd to notify)."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

from numad_infer.config.load import parse_config
from numad_infer.units.render import render_frontdoor_unit
from tests.daemon_harness import free_port, wait_for
from tests.frontdoor.harness import HAPROXY, with_haproxy
from tests.peers import Peer, http


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
    except OSError:
        return False
    return True


def _unit_setting(unit: str, key: str) -> str:
    (value,) = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith(f"{key}=")]
    return value


@with_haproxy
def test_stopping_the_front_door_unit_finishes_the_request_it_carries(tmp_path: Path) -> None:
    config = parse_config('[model]\npath = "/m.gguf"\n[frontend]\ndrain_timeout_s = 20\n', "/etc/x.toml")
    unit = render_frontdoor_unit(config, None, "/usr/bin/python3")
    kill = signal.Signals[_unit_setting(unit, "KillSignal")]
    bound = float(_unit_setting(unit, "TimeoutStopSec"))
    assert bound >= config.frontend.drain_timeout_s

    def slow(conn: socket.socket, request: bytes, peer: Peer) -> None:
        time.sleep(2.0)
        peer.send(conn, http(200, b"done"))

    port = free_port()
    with Peer(slow) as instance:
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text("defaults\n    mode http\n    timeout connect 2s\n    timeout client 30s\n"
                       f"    timeout server 30s\nfrontend f\n    bind 127.0.0.1:{port}\n    default_backend b\n"
                       f"backend b\n    server s 127.0.0.1:{instance.port}\n")
        cli = tmp_path / "master.sock"
        master = subprocess.Popen([HAPROXY, "-W", "-S", str(cli), "-f", str(cfg)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            answers: list[object] = []

            def ask() -> None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/completions", timeout=20) as r:
                        answers.append((r.status, r.read()))
                except OSError as exc:
                    answers.append(exc)

            wait_for(lambda: _listens(port), "HAProxy listening")
            # The master re-executes itself once its worker runs; a signal that lands while
            # it does is lost (seen once on a loaded host: the master never stopped). Its CLI
            # answers only once it is back, waiting for signals.
            wait_for(lambda: "master" in _master_cli(cli, "show proc"), "HAProxy's master ready")
            client = threading.Thread(target=ask)
            client.start()
            wait_for(lambda: instance.connections == 1, "the request at the instance")
            assert instance.connections == 1
            master.send_signal(kill)
            master.wait(bound)
            client.join(10)
            assert answers == [(200, b"done")]
        finally:
            master.kill()
            master.wait()


def _master_cli(path: Path, command: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        sock.connect(str(path))
        sock.sendall(command.encode() + b"\n")
        return sock.recv(4096).decode(errors="replace")  # "#<PID> <type> ...": its first line says master
