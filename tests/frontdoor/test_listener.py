"""The front door's listening socket, held by the daemon (numad_infer/frontdoor/listener.py): HAProxy's
death or reload refuses no connection.

In the chaos soaks most failures before a first byte came while HAProxy was dead: the port
was HAProxy's alone, so every connection was refused until it was back. These tests run
the daemon's own front-door code (`Frontdoor` over `ProcessFrontdoorRunner`) on a real
HAProxy with stub instances. Under systemd the front door's unit asks the daemon for the
socket (`frontdoor_exec`, `listener.Handout`): the tests of that path run the unit's own
ExecStart= line, as rendered, with systemd's part (Restart=, the file descriptor store)
played by the test; the VM suite runs it under systemd.
"""

from __future__ import annotations

from numad_infer.config.models import served_models
from numad_infer.engines import engine_of

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from numad_infer.units.render import FRONTDOOR_HANDOUT, FRONTDOOR_RUN_DIR, render_frontdoor_unit
from numad_infer.frontdoor import handover as frontdoor_exec
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.frontdoor.listener import (
    FD_VARIABLE,
    STORE_NAME,
    TWIN_FD_VARIABLE,
    TWIN_STORE_NAME,
    Handout,
    HeldListener,
    receive,
)
from numad_infer.systemd.notify import Notifier, inherited_fds
from tests.conftest import searchable_by_others
from tests.daemon_harness import free_port_block, wait_for
from tests.frontdoor.harness import SLOW_MARKER, STUB, _accepts
from tests.frontdoor.harness import binds_beside
from tests.frontdoor.harness import HAPROXY, Door, as_root, children_of, with_haproxy


def post(port: int, prompt: str = "numa", timeout_s: float = 30.0) -> int:
    body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


class Stubs:
    """One stand-in per planned instance (tests/frontdoor/test_haproxy_config.py's STUB)."""

    def __init__(self, door: Door, tmp: Path) -> None:
        script = tmp / "stub.py"
        script.write_text(STUB)
        self.procs = []
        self.logs = [tmp / f"stub{index}.log" for index in range(len(door.plan.instances))]
        for index, instance in enumerate(door.plan.instances):
            self.procs.append(subprocess.Popen([sys.executable, str(script), f"stub{index}", str(instance.port),
                                                str(tmp / f"stub{index}.log"), "0"]))
            wait_for(lambda: _accepts(instance.port), f"stub {index} on {instance.port}")

    def received(self) -> int:
        """Requests the stubs have been sent so far (each logs one line as it arrives)."""
        return sum(len(log.read_text().splitlines()) for log in self.logs if log.exists())

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def serving(door: Door) -> None:
    wait_for(lambda: post(door.port, timeout_s=2) == 200, "a completion through the front door", 30,
             lambda: f"{door.log()}{_unit_log(door)}")


def _unit_log(door: Door) -> str:
    path: Path | None = getattr(door, "unit_log", None)  # UnitRunner's: frontdoor_exec's and HAProxy's output
    return f"\nunit log:\n{path.read_text(errors='replace')}" if path and path.exists() else ""


@with_haproxy
def test_a_request_sent_while_haproxy_is_dead_waits_and_is_answered_once_it_is_back(doors, tmp_path: Path) -> None:
    door = doors()
    stubs = Stubs(door, tmp_path)
    try:
        door.start()
        serving(door)
        master = door.master
        os.killpg(master, signal.SIGKILL)
        door.door.runner.child.wait()  # type: ignore[attr-defined]
        answered: list[int] = []
        client = threading.Thread(target=lambda: answered.append(post(door.port)))
        client.start()
        time.sleep(1.0)
        # Before: nothing listened while HAProxy was dead, and this request was refused at once.
        assert client.is_alive() and not answered, "the request failed while HAProxy was dead"
        door.door.observe()  # the daemon's next pass starts HAProxy again, on the same socket
        client.join(30)
        assert answered == [200]
        assert door.master != master
    finally:
        stubs.stop()


@with_haproxy
def test_a_seamless_reload_keeps_the_held_socket(doors, tmp_path: Path) -> None:
    door = doors()
    stubs = Stubs(door, tmp_path)
    try:
        door.start()
        serving(door)
        held = door.door.runner.listener.fd  # type: ignore[attr-defined]
        workers = set(children_of(door.master))
        door.door.reloads.ask()
        # Each pass asks again for a reload HAProxy dropped while starting (test_control.py).
        wait_for(lambda: door.door.observe() is not None and set(children_of(door.master)) - workers,
                 "a new worker after the reload")
        serving(door)
        assert door.door.runner.listener.fd == held  # type: ignore[attr-defined]
    finally:
        stubs.stop()


@with_haproxy
def test_closing_refuses_new_connections_at_once_and_the_request_in_flight_finishes(doors, tmp_path: Path) -> None:
    door = doors()
    stubs = Stubs(door, tmp_path)
    try:
        door.start()
        serving(door)
        answered: list[int] = []
        slow = threading.Thread(target=lambda: answered.append(post(door.port, SLOW_MARKER)))
        had = stubs.received()
        slow.start()
        wait_for(lambda: stubs.received() > had, "the slow request at its instance")
        assert door.door.close()
        started = time.monotonic()
        # HAProxy's `disable frontend` alone pauses its listener, and on an inherited socket
        # the kernel would queue this connection with no one to accept it.
        try:
            with socket.create_connection(("127.0.0.1", door.port), timeout=5):
                refused = False
        except ConnectionRefusedError:
            refused = True
        assert refused and time.monotonic() - started < 1.0
        slow.join(30)
        assert answered == [200]
    finally:
        stubs.stop()


# -- under systemd: the unit's ExecStart= asks the daemon for the socket ------------------------------

class UnitRunner:
    """numa-infer-frontdoor.service without systemd: its rendered ExecStart= and ExecReload=
    lines, run as they are with the test's paths; `start` is also what Restart= does."""

    restarted_by_manager = True

    haproxy_uids = frozenset({0})
    haproxy_gid = None

    def __init__(self, door: Door, tmp: Path, stored: list[tuple[str, int | None]]) -> None:
        self.run_dir, self.socket_path = door.run_dir, door.run_dir / "admin.sock"
        self.handout_path = tmp / "listener.sock"
        self.listener = HeldListener(lambda name, fd: stored.append((name, fd)))
        self.handout = Handout(self.listener, self.handout_path, frozenset({os.getuid()}), None)
        self.handout.start()
        unit = render_frontdoor_unit(door.config, None)
        self.lines = {key: [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith(key + "=")]
                      for key in ("ExecStart", "ExecStartPre", "ExecReload")}
        self.child: subprocess.Popen[bytes] | None = None
        self.log = open(tmp / "unit.log", "ab")
        door.unit_log = tmp / "unit.log"  # type: ignore[attr-defined]  # shown when a wait times out

    def argv(self, line: str) -> list[str]:
        line = line.replace(FRONTDOOR_HANDOUT, str(self.handout_path))
        line = line.replace(f"{FRONTDOOR_RUN_DIR}/haproxy.cfg", str(self.run_dir / "haproxy.cfg"))
        return [word for word in shlex.split(line) if word != "-Ws"] + ["-db"]  # -Ws needs systemd; stay in front

    def running(self) -> bool:
        return self.child is not None and self.child.poll() is None

    def start(self, binary: str, config_path: Path) -> None:
        pre = subprocess.run(self.argv(self.lines["ExecStartPre"][0])[:-1], capture_output=True, text=True)
        assert pre.returncode == 0, pre.stderr  # the check runs on the socket too
        self.child = subprocess.Popen(self.argv(self.lines["ExecStart"][0]), stdout=self.log, stderr=self.log,
                                      start_new_session=True)

    def reload(self) -> None:
        assert self.child is not None
        os.kill(self.child.pid, signal.SIGUSR2)

    def stop(self) -> None:
        if self.running():
            assert self.child is not None
            os.killpg(self.child.pid, signal.SIGTERM)
            self.child.wait(20)

    def hand_back(self) -> None:
        pass  # numa-infer-port.socket's part: tests/backends/test_portunit.py, and the VM suite


@pytest.fixture
def unit_door(tmp_path: Path):
    stored: list[tuple[str, int | None]] = []
    door = Door(tmp_path)
    runner = UnitRunner(door, tmp_path, stored)
    door.door = Frontdoor(runner)
    stubs = Stubs(door, tmp_path)
    yield door, runner, stored
    door.stop()
    runner.handout.close()
    stubs.stop()


@with_haproxy
def test_under_systemd_haproxy_starts_on_the_daemons_socket_and_a_request_sent_while_it_is_dead_is_answered(
        unit_door) -> None:
    door, runner, stored = unit_door
    assert door.apply()
    serving(door)
    held = runner.listener.fds
    # Kept in the daemon unit's file descriptor store, with the twin where this host has ::1.
    assert stored == [(STORE_NAME, held[FD_VARIABLE])] + [(TWIN_STORE_NAME, held[v]) for v in held if v != FD_VARIABLE]
    # The unit's HAProxy binds no address of its own: its only TCP listener is the daemon's.
    assert runner.child is not None
    os.killpg(runner.child.pid, signal.SIGKILL)
    runner.child.wait()
    answered: list[int] = []
    client = threading.Thread(target=lambda: answered.append(post(door.port)))
    client.start()
    time.sleep(1.0)
    assert client.is_alive() and not answered, "the request failed while HAProxy was dead"
    runner.start(HAPROXY, door.door.paths.config)  # systemd's Restart=on-failure
    client.join(30)
    assert answered == [200]
    door.door.observe()
    kept = list(stored)
    assert door.door.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", door.port), timeout=5).close()
    # Refused, but the port is still the daemon's: no one else binds it while it drains.
    assert not binds_beside("127.0.0.1", door.port) and stored == kept
    door.door.stop()
    assert stored[-1][1] is None and binds_beside("127.0.0.1", door.port)  # a stop lets go of it


@with_haproxy
def test_a_restarted_daemon_takes_back_the_kept_socket_and_leaves_haproxy_running(unit_door) -> None:
    door, runner, stored = unit_door
    assert door.apply()
    serving(door)
    master = runner.child.pid if runner.child else 0
    # What the store gives the next daemon (LISTEN_FDS), the loopback twin with it.
    kept = {STORE_NAME if var == FD_VARIABLE else TWIN_STORE_NAME: [os.dup(fd)] for var, fd in runner.listener.fds.items()}
    # The next daemon: a new listener and front door that take the kept descriptors.
    runner.listener = HeldListener(lambda name, fd: stored.append((name, fd)))
    runner.handout.listener = runner.listener
    runner.listener.offer(kept)
    door.door = Frontdoor(runner)
    assert not door.apply()  # nothing to do: same socket, same file
    assert runner.child is not None and runner.child.pid == master
    serving(door)
    assert runner.listener.fd == kept[STORE_NAME][0]


def test_the_store_gets_the_descriptor_and_a_restarted_daemon_finds_it_by_name(tmp_path: Path) -> None:
    # The real datagram a daemon sends systemd (sd_pid_notify_with_fds), on a socket of ours.
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(tmp_path / "notify"))
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")})
    with socket.socket() as held:
        notifier.store_fd(STORE_NAME, held.fileno())
        message, fds, _, _ = socket.recv_fds(sink, 256, 4)
        # FDPOLL=0: a drained socket hangs up and would be dropped, port and all.
        assert message == b"FDSTORE=1\nFDNAME=frontdoor\nFDPOLL=0" and len(fds) == 1
        assert os.fstat(fds[0]).st_ino == os.fstat(held.fileno()).st_ino
        os.close(fds[0])
    notifier.store_fd(STORE_NAME, None)
    assert sink.recv(256) == b"FDSTOREREMOVE=1\nFDNAME=frontdoor"
    sink.close()
    env = {"LISTEN_FDS": "4", "LISTEN_PID": str(os.getpid()), "LISTEN_FDNAMES": "port:port:other:frontdoor"}
    # numa-infer-port.socket names its two sockets alike (FileDescriptorName=).
    assert inherited_fds(env) == {"port": [3, 4], "other": [5], "frontdoor": [6]} and "LISTEN_FDS" not in env
    assert inherited_fds({"LISTEN_FDS": "1", "LISTEN_PID": "1", "LISTEN_FDNAMES": "frontdoor"}) == {}  # not ours


def test_a_kept_descriptor_that_is_not_a_listening_socket_is_dropped(tmp_path: Path) -> None:
    stored: list[tuple[str, int | None]] = []
    listener = HeldListener(lambda name, fd: stored.append((name, fd)))
    connected, _ = socket.socketpair()
    listener.offer({STORE_NAME: [os.dup(connected.fileno())]})
    assert stored == [(STORE_NAME, None)]
    port = free_port_block(1)
    listener.hold("127.0.0.1", port)
    assert listener.address == ("127.0.0.1", port) and stored[1] == (STORE_NAME, listener.fd)  # its own, bound
    listener.release()
    connected.close()


@as_root
def test_the_handout_gives_the_socket_to_haproxys_user_only(tmp_path: Path) -> None:
    import pwd

    nobody = pwd.getpwnam("nobody")
    listener = HeldListener()
    listener.hold("127.0.0.1", 0)
    path = tmp_path / "listener.sock"
    handout = Handout(listener, path, frozenset({0}), None)
    handout.start()
    try:
        assert oct(path.stat().st_mode & 0o777) == "0o600"  # no front door group: its owner alone
        fds = receive(str(path))
        assert fds is not None and fds.keys() == listener.fds.keys()
        assert os.fstat(fds[FD_VARIABLE]).st_ino == os.fstat(listener.fd).st_ino  # the same socket
        for fd in fds.values():
            os.close(fd)
        path.chmod(0o666)  # even where the file lets it connect, the peer's uid decides
        searchable_by_others(tmp_path)
        asks = (f"import socket; c = socket.socket(socket.AF_UNIX); c.connect({str(path)!r}); "
                "print(len(socket.recv_fds(c, 64, 1)[1]))")
        probe = subprocess.run(["python3", "-c", asks], user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[],
                               capture_output=True, text=True, cwd="/")
        assert probe.stdout.strip() == "0", probe.stderr  # connected, and given nothing
        listener.refuse()
        assert receive(str(path)) is None  # draining: HAProxy must not start on it
    finally:
        handout.close()
        listener.release()


def test_frontdoor_exec_says_what_is_wrong_where_the_daemon_holds_nothing(tmp_path: Path, capsys, monkeypatch) -> None:
    listener = HeldListener()
    handout = Handout(listener, tmp_path / "listener.sock", frozenset({os.getuid()}), None)
    handout.start()
    try:
        assert frontdoor_exec.main([str(tmp_path / "listener.sock"), "--", "true"]) == 1
        assert "holds no listening socket" in capsys.readouterr().err
    finally:
        handout.close()
    monkeypatch.setattr(frontdoor_exec, "WAIT_S", 0.5)
    assert frontdoor_exec.main([str(tmp_path / "listener.sock"), "--", "true"]) == 1
    assert "is numa-infer.service running?" in capsys.readouterr().err
