"""The front door's listening socket, held by the daemon (numad_infer/listener.py; issue 19).

In the chaos soaks most failures before a first byte came while HAProxy was dead: the port
was HAProxy's alone, so every connection was refused until it was back. These tests run
the daemon's own front-door code (`Frontdoor` over `ProcessFrontdoorRunner`) on a real
HAProxy with stub instances. The systemd backend still lets HAProxy bind the address in
its unit: the daemon cannot hand a descriptor to a unit that systemd starts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.test_frontdoor_haproxy import SLOW_MARKER, STUB, _accepts
from tests.test_frontdoor_user import Door, doors, wait_for, with_haproxy  # noqa: F401 (doors: a fixture)


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
    """One stand-in per planned instance (tests/test_frontdoor_haproxy.py's STUB)."""

    def __init__(self, door: Door, tmp: Path) -> None:
        script = tmp / "stub.py"
        script.write_text(STUB)
        self.procs = []
        for index, instance in enumerate(door.plan.instances):
            self.procs.append(subprocess.Popen([sys.executable, str(script), f"stub{index}", str(instance.port),
                                                str(tmp / f"stub{index}.log")]))
            wait_for(lambda: _accepts(instance.port), f"stub {index} on {instance.port}")

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def serving(door: Door) -> None:
    wait_for(lambda: post(door.port, timeout_s=2) == 200, f"a completion through the front door\n{door.log()}", 30)


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
        door.door.runner.reload()
        time.sleep(1.0)
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
        slow.start()
        time.sleep(0.5)
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
