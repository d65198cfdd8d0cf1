"""A real daemon (process backend, a real HAProxy) whose peers drip: one instance answers its
probe one byte every 100 ms, forever, then admin.sock is replaced by a server that does the
same. The daemon's passes go on, each within its deadline, its state file keeps being
rewritten, its watchdog keeps being pinged, and both peers are reported.

The instances are stand-ins, not llama-cpp-python: `server.python` is a wrapper that runs
the real interpreter for the daemon's own checks, and for each instance a small server
(tests/peers.py's behaviours, on the instance's port): infer@0 answers at once, infer@1
drips. The wrapper tells them apart by OMP_PLACES, which the daemon sets per instance."""

from __future__ import annotations

import time
from pathlib import Path

from numad_infer.supervision.reconcile import PASS_SLACK_S
from tests import daemon_harness
from tests.daemon_harness import daemons, generated_model, shared_dir
from tests.peers import Peer, drip

PROBE_TIMEOUT_S = 1.0  # the harness's tuning.probe_timeout_s
RUNTIME_API_S = PROBE_TIMEOUT_S  # the front door gives its runtime API tuning.probe_timeout_s
WATCHDOG_S = 10.0

INSTANCE = """
import socket, sys, threading, time
HEALTHY = b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\nConnection: close\\r\\n\\r\\nok"
def serve(conn, dripping):
    with conn:
        try:
            conn.recv(4096)
            if not dripping:
                conn.sendall(HEALTHY)
                return
            conn.sendall(b"HTTP/1.1 200 OK\\r\\n")
            while True:
                for byte in b"X-Drip: 1\\r\\n":
                    time.sleep(0.1)
                    conn.sendall(bytes([byte]))
        except OSError:
            pass
args = sys.argv[1:]
port, dripping = int(args[args.index("--port") + 1]), sys.argv[1] == "drip"
server = socket.create_server(("127.0.0.1", port))
while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn, dripping), daemon=True).start()
"""

WRAPPER = """#!/bin/sh
# server.python for this test: the real interpreter for the daemon's checks, a stand-in
# server for each instance (OMP_PLACES is the instance's CPU).
case "$OMP_PLACES" in
  "{{0}}") exec {python} {script} ok "$@" ;;
  "{{1}}") exec {python} {script} drip "$@" ;;
esac
exec {python} "$@"
"""


def _wrapper(python: str) -> str:
    directory = shared_dir()
    script = directory / "dripping_instance.py"
    script.write_text(INSTANCE)
    wrapper = directory / "dripping-python"
    wrapper.write_text(WRAPPER.format(python=python, script=script))
    for path in (script, wrapper):
        path.chmod(0o755)
    return str(wrapper)


def _updates(run: daemon_harness.DaemonRun, count: int, timeout: float) -> list[dict]:
    """The next `count` states the daemon writes (each a new updated_at)."""
    seen: list[dict] = []
    last = (run.state() or {}).get("daemon", {}).get("updated_at")
    deadline = time.monotonic() + timeout
    while len(seen) < count:
        assert time.monotonic() < deadline, f"{len(seen)} update(s) in {timeout}s\n{run.logs()}"
        state = run.state()
        if state is not None and state["daemon"]["updated_at"] != last:
            last = state["daemon"]["updated_at"]
            seen.append(state)
        time.sleep(0.05)
    return seen


def _pings(run: daemon_harness.DaemonRun) -> list[float]:
    return [at for at, message in run.notify.messages if "WATCHDOG=1" in message.split("\n")]


def test_a_dripping_instance_and_admin_socket_stall_no_pass(tmp_path: Path) -> None:
    wrapper = _wrapper(daemon_harness.server_python())
    with daemons(tmp_path, generated_model("tiny")) as start:
        run = start(env={"WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))}, python=wrapper)
        state = run.wait(lambda s: len(s["instances"]) == 2 and run.instance(s, "infer@0")["state"] == "healthy"
                         and run.instance(s, "infer@1").get("error") == f"no answer within {PROBE_TIMEOUT_S:g}s"
                         and bool(s.get("frontdoor")) and s["frontdoor"]["up"],
                         60, "infer@0 healthy, infer@1 reported not answering")
        assert run.instance(state, "infer@1")["state"] == "starting"  # its start-up grace: reported, not restarted
        for update in _updates(run, 4, 4 * (PROBE_TIMEOUT_S + PASS_SLACK_S + 1)):
            assert update["daemon"]["pass_duration_s"] < PROBE_TIMEOUT_S + PASS_SLACK_S
            assert run.instance(update, "infer@1")["error"] == "no answer within 1s"

        # The front door's user replaces admin.sock with a server that drips.
        admin = run.state_file.parent / "frontdoor" / "admin.sock"
        admin.unlink()
        with Peer(drip(b"", b"# pxname,svname\n", 0.1), unix_path=admin) as dripping:
            since = time.monotonic()
            updates = _updates(run, 4, 4 * (RUNTIME_API_S + PROBE_TIMEOUT_S + PASS_SLACK_S + 1))
            assert dripping.connections >= 3 and dripping.sent > 10
        print("passes with admin.sock dripping:", [u["daemon"]["pass_duration_s"] for u in updates])
        last = updates[-1]
        assert not last["frontdoor"]["up"]
        assert last["frontdoor"]["error"] == f"runtime API {admin}: no answer within {RUNTIME_API_S:g}s"
        assert all(u["daemon"]["pass_duration_s"] < RUNTIME_API_S + PROBE_TIMEOUT_S + PASS_SLACK_S
                   for u in updates[1:])  # the first may have begun before the swap
        assert run.instance(last, "infer@0")["state"] == "healthy"
        pings = [at for at in _pings(run) if at >= since - WATCHDOG_S]
        assert len(pings) >= 2 and max(b - a for a, b in zip(pings, pings[1:], strict=False)) < WATCHDOG_S
        assert run.proc.poll() is None
