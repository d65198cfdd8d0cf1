"""The API key and the daemon's environment reach only the instances' own processes.

Real processes on real ports: a squatter (a process that is not the instance's) listening on
an instance's port. The environment a server started by the process backend gets:
tests/backends/test_process.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from numad_infer.backends.process import ProcessBackend
from numad_infer.host.identity import BackendKind
from tests.daemon_harness import free_port
from tests.fakes import loaded_for, private_key, served_of


# Answers every route with 200, as a server taking any key would, and records what it got.
SQUATTER = """
import http.server, sys
seen = open(sys.argv[2], "a", buffering=1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        seen.write(f"{self.path} {self.headers.get('Authorization', '-')}\\n")
        body = b"llamacpp:tokens_predicted_total 1\\nllamacpp:requests_processing 0\\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def squatter(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """Another process listening on what will be an instance's port, and what it was sent."""
    port, script, seen = free_port(), tmp_path / "squatter.py", tmp_path / "seen"
    script.write_text(SQUATTER)
    seen.touch()
    process = subprocess.Popen([sys.executable, str(script), str(port), str(seen)])
    try:
        deadline = time.monotonic() + 20
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert time.monotonic() < deadline and process.poll() is None, "the squatter did not listen"
            time.sleep(0.05)
        yield process, port, seen
    finally:
        process.kill()
        process.wait()


def test_a_squatter_on_an_instance_port_gets_no_key_and_is_never_marked_healthy(tmp_path: Path, squatter) -> None:
    from numad_infer.lifecycle.states import State
    from numad_infer.plan.placement import make_plan
    from numad_infer.supervision.reconcile import Reconciler
    from tests.fakes import RecordingBackend, cfg, loaded_for, three_nodes

    process, port, seen = squatter
    key = private_key(tmp_path / "keys", "k-SQUAT-1")
    # llama-server: the daemon also reads its /metrics with the key.
    config = cfg(f'[placement]\nnodes = [0]\n[server]\nengine = "llama-server"\nbase_port = {port}\n'
                 f'api_key_file = "{key}"\n[monitor]\nstartup_grace_s = 0\n[tuning]\nunhealthy_after = 100\n')
    backend = RecordingBackend()
    rec = Reconciler(backend)
    rec.apply(loaded_for(config, make_plan(config, three_nodes(), served=served_of(config)), api_key="k-SQUAT-1"), 0.0)
    instance = subprocess.Popen(["sleep", "60"])  # the instance's own process, which never got the port
    try:
        backend.running["infer@0"] = instance.pid
        for now in (1.0, 2.0, 3.0):
            rec.monitor(now)
            assert rec.runtimes["infer@0"].supervision.state != State.HEALTHY
    finally:
        instance.kill()
        instance.wait()
    assert "Bearer" not in seen.read_text() and "k-SQUAT-1" not in seen.read_text(), seen.read_text()
    assert rec.runtimes["infer@0"].supervision.last_error.startswith(
        f"port {port} is held by pid {process.pid} (python"), rec.runtimes["infer@0"].supervision.last_error
    assert f"not by the instance (pid {instance.pid})" in rec.runtimes["infer@0"].supervision.last_error
    # The same listener, when it is the instance's own process, is healthy and gets the key.
    backend.running["infer@0"] = process.pid
    rec.monitor(4.0)
    rec.monitor(5.0)
    assert rec.runtimes["infer@0"].supervision.state == State.HEALTHY
    assert "/v1/models Bearer k-SQUAT-1" in seen.read_text() and "/metrics Bearer k-SQUAT-1" in seen.read_text()


def test_the_key_check_sends_no_key_to_a_port_the_instance_does_not_hold(tmp_path: Path, squatter) -> None:
    from numad_infer.host.procfs import ProcReader
    from numad_infer.lifecycle.states import State
    from numad_infer.plan.placement import make_plan
    from numad_infer.supervision.health import KeyCheck
    from numad_infer.supervision.instance import Runtime
    from numad_infer.supervision.keycheck import check_api_key
    from tests.fakes import cfg, three_nodes

    process, port, seen = squatter
    config = cfg(f"[placement]\nnodes = [0]\n[server]\nbase_port = {port}\n")
    instance = subprocess.Popen(["sleep", "60"])
    try:
        # Healthy a moment ago; the port changed hands since (the key check runs after the probe).
        rt = Runtime(make_plan(config, three_nodes(), served=served_of(config)).instances[0], pid=instance.pid)
        rt.supervision.on_started(0.0)
        rt.supervision.change_state(State.HEALTHY, "probe answered")
        check_api_key(rt, config, "k-SQUAT-2", None, ProcReader(), "/v1/models")
        assert rt.key_check == KeyCheck.UNKNOWN and seen.read_text() == ""
        rt.pid = process.pid  # the listener's own process: now it is asked
        check_api_key(rt, config, "k-SQUAT-2", None, ProcReader(), "/v1/models")
        assert rt.key_check == KeyCheck.ACCEPTED and "/v1/models Bearer k-SQUAT-2" in seen.read_text()
    finally:
        instance.kill()
        instance.wait()


def tcp_table(*rows: tuple[str, str]) -> str:
    """/proc/net/tcp{,6} with one listening socket per (local address, inode)."""
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    return header + "".join(f"   {n}: {local} 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 "
                            f"{inode} 1 0000000000000000 100 0 0 10 0\n" for n, (local, inode) in enumerate(rows))


@pytest.mark.skipif(sys.byteorder != "little", reason="the table below is written as a little-endian kernel prints it")
@pytest.mark.parametrize("host, tcp, tcp6, owned", [
    # 127.0.0.1:8080, the instance's socket: ours.
    ("127.0.0.1", [("0100007F:1F90", "111")], [], "instance"),
    # A squatter on 0.0.0.0:8080 (SO_REUSEPORT beside ours) also takes connections to 127.0.0.1.
    ("127.0.0.1", [("0100007F:1F90", "111"), ("00000000:1F90", "222")], [], "other"),
    # [::]:8080 takes IPv4 connections too (unless V6ONLY, which cannot be told from here).
    ("127.0.0.1", [("0100007F:1F90", "111")], [("00000000000000000000000000000000:1F90", "222")], "other"),
    # Another address, another port: not reached by a client of 127.0.0.1:8080.
    ("127.0.0.1", [("0100007F:1F90", "111"), ("0302010A:1F90", "222"), ("0100007F:1F91", "333")], [], "instance"),
    # ::1:8080 (an IPv6 instance), and nothing at all.
    ("::1", [], [("00000000000000000000000001000000:1F90", "111")], "instance"),
    ("0.0.0.0", [], [], "nobody"),
])
def test_every_socket_a_client_of_the_port_may_reach_must_be_the_instances(tmp_path: Path, host: str, tcp, tcp6,
                                                                            owned: str) -> None:
    from numad_infer.host.procfs import ProcReader

    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "tcp").write_text(tcp_table(*tcp))
    (proc / "net" / "tcp6").write_text(tcp_table(*tcp6))
    (proc / "42" / "fd").mkdir(parents=True)
    (proc / "42" / "fd" / "3").symlink_to("socket:[111]")
    (proc / "42" / "fd" / "4").symlink_to("/dev/null")
    assert ProcReader(tmp_path).port_owner(host, 8080, 42).holder.value == owned


@pytest.mark.skipif(sys.byteorder != "little", reason="the table below is written as a little-endian kernel prints it")
def test_only_listening_rows_are_listeners_and_a_pass_judges_by_the_table_it_read(tmp_path: Path) -> None:
    from numad_infer.host.portowner import listeners
    from numad_infer.host.procfs import ProcReader

    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "42" / "fd").mkdir(parents=True)
    (proc / "42" / "fd" / "3").symlink_to("socket:[111]")
    # A connection to the port in every other state (established, time-wait, close-wait) is no listener.
    rows = tcp_table(("0100007F:1F90", "111"))
    for n, state in enumerate(("01", "06", "08")):
        rows += (f"   {n + 5}: 0100007F:1F90 0100007F:9C4{n} {state} 00000000:00000000 00:00000000 00000000     0"
                 f"        0 {500 + n} 1 0000000000000000 100 0 0 10 0\n")
    (proc / "net" / "tcp").write_text(rows)
    reader = ProcReader(tmp_path)
    table = reader.listeners()
    assert [(str(address), port, inode) for address, port, inode, _ in table.sockets] == [("127.0.0.1", 8080, 111)]
    assert reader.port_owner("127.0.0.1", 8080, 42, table).ours
    # The table read before the instance listened is the one judged: nothing listened then.
    (proc / "net" / "tcp").write_text(tcp_table())
    before = listeners(proc)
    (proc / "net" / "tcp").write_text(rows)
    assert reader.port_owner("127.0.0.1", 8080, 42, before).holder.value == "nobody"


def test_a_socket_held_by_a_child_of_the_instance_process_is_the_instances(squatter) -> None:
    from numad_infer.host.procfs import ProcReader

    process, port, _ = squatter
    # The squatter is a child of this test's process: seen from here, it is one of ours.
    assert ProcReader().port_owner("127.0.0.1", port, os.getpid()).ours
    sibling = subprocess.Popen(["sleep", "60"])
    try:
        assert not ProcReader().port_owner("127.0.0.1", port, sibling.pid).ours
    finally:
        sibling.kill()
        sibling.wait()


def test_tune_refuses_a_measuring_port_another_process_holds_before_any_request(tmp_path: Path, squatter) -> None:
    from numad_infer.plan.placement import make_plan
    from numad_infer.topology.cgroup_limits import UNRESTRICTED
    from numad_infer.tune.errors import TuneError
    from numad_infer.tune.measure import Measurer, Settings
    from tests.fakes import cfg, loaded_for, three_nodes

    process, port, seen = squatter
    key = private_key(tmp_path / "keys", "k-TUNE-1")
    config = cfg(f'[placement]\nnodes = [0]\n[server]\nbase_port = {port}\napi_key_file = "{key}"\n')
    server = subprocess.Popen(["sleep", "60"])  # tune's measuring server, which never got its port

    class Started:
        def main_pid(self, name: str) -> int:
            return server.pid

    try:
        plan = make_plan(config, three_nodes(), served=served_of(config))
        measurer = Measurer(loaded_for(config, plan, api_key="k-TUNE-1"), UNRESTRICTED,
                            tmp_path, Settings(1, 2, 10.0), lambda line: None)
        with pytest.raises(TuneError, match=rf"port {port} is held by pid {process.pid} "):
            measurer._wait_ready(Started(), config, plan.instances[0])
    finally:
        server.kill()
        server.wait()
    assert seen.read_text() == ""


def listen_as(uid: int) -> tuple[subprocess.Popen, int]:
    """A process of user `uid` listening on a free loopback port (the system python: the
    project's venv may sit where that user cannot reach)."""
    code = ("import socket, sys, time\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\n"
            "print(s.getsockname()[1], flush=True)\ntime.sleep(120)\n")
    process = subprocess.Popen(["/usr/bin/python3", "-c", code], stdout=subprocess.PIPE, text=True, user=uid)
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def owner_as(uid: int, port: int, pid: int) -> str:
    """port_owner as seen by a process of user `uid` (which may not read `pid`'s descriptors)."""
    from numad_infer.host.procfs import ProcReader

    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.setuid(uid)
            owner = ProcReader().port_owner("127.0.0.1", port, pid)
            os.write(write, f"{owner.holder.value}|{owner.detail}".encode())
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails
            os.write(write, f"error|{type(exc).__name__}: {exc}".encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    return os.read(read, 4096).decode()


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/python3").exists(), reason="needs root to switch users")
def test_under_systemd_an_instance_is_told_by_its_own_user_when_its_descriptors_cannot_be_read() -> None:
    # Under systemd the daemon (root with CAP_SYS_NICE alone) may not read a DynamicUser
    # instance's /proc/PID/fd: seen in the VM suite, every instance stayed unhealthy ("the
    # sockets of process N cannot be read"). Each instance's DynamicUser is its own, so the
    # socket's user (/proc/net/tcp) tells instead. Here: a daemon of uid 65533 looking at an
    # instance of uid 65534.
    instance, port = listen_as(65534)
    squatter, squatted = listen_as(0)
    try:
        said = owner_as(65533, port, instance.pid)
        assert said.startswith("instance|"), said
        said = owner_as(65533, squatted, instance.pid)
        assert said.startswith("other|") and "held by uid 0" in said, said
    finally:
        for process in (instance, squatter):
            process.kill()
            process.wait()


def test_a_key_file_changed_after_validation_is_never_half_used(tmp_path: Path) -> None:
    """What the pipeline checked is what the instances get, the probes send and the specs
    compare: a key file replaced between validation and start waits for the next reload,
    whole, instead of reaching some consumers and not others."""
    from numad_infer.backends.systemd import SystemdBackend
    from numad_infer.config.apikey import fingerprint, read_api_key
    from numad_infer.plan.placement import make_plan
    from numad_infer.supervision.reconcile import Reconciler
    from tests.fakes import RecordingBackend, cfg, three_nodes

    key = private_key(tmp_path / "keys", "k-CHECKED")
    config = cfg(f'[server]\napi_key_file = "{key}"\n')
    plan = make_plan(config, three_nodes(), served=served_of(config))
    checked = loaded_for(config, plan, api_key=read_api_key(config, "/etc/numa-infer.toml"))
    key.write_text("k-CHANGED\n")  # after validation, before the apply
    process = ProcessBackend(tmp_path / "logs")
    process.sync(checked)
    assert process.loaded is not None and process.loaded.api_key == "k-CHECKED"  # what a started instance gets in its environment
    assert all(json.loads(spec)["key"] == fingerprint("k-CHECKED") for spec in process.specs(checked).values())
    units = loaded_for(config, plan, api_key="k-CHECKED", kind=BackendKind.SYSTEMD)
    assert all(spec.endswith(fingerprint("k-CHECKED")) for spec in SystemdBackend().specs(units).values())
    rec = Reconciler(RecordingBackend())
    rec.apply(checked, 0.0)
    assert rec.loaded is checked and rec.loaded.api_key == "k-CHECKED"  # what the probes and the key check send
    # The next reload reads the new file once, and every consumer moves to it together.
    reloaded = loaded_for(config, plan, api_key=read_api_key(config, "/etc/numa-infer.toml"))
    rec.apply(reloaded, 1.0)
    process.sync(reloaded)
    assert rec.loaded is reloaded and process.loaded is reloaded and reloaded.api_key == "k-CHANGED"
