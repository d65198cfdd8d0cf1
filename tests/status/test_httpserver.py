"""The metrics endpoint under clients that connect and do not ask, or ask slowly: threads
and held connections stay bounded, a scrape is still answered, idle ones are dropped.

Before: prometheus_client's ThreadingWSGIServer, one thread per connection and no
deadline; 40 idle half-requests left 42 threads."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from numad_infer.status import httpserver, metrics
from numad_infer.status.httpserver import BoundedHTTPServer
from tests.daemon_harness import free_port, wait_for

IDLE = 3000
SPARE_FDS = 256  # pytest, the server's own descriptors, the scrapes


def os_threads() -> int:
    """The process's threads as the kernel counts them (what a pids limit counts)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("Threads:"))
    return int(line.split()[1])


def established(port: int) -> int:
    """TCP connections in ESTABLISHED whose local end is `port`: the server's side only
    (accepted or waiting in its backlog). One it closed is in FIN_WAIT, not counted."""
    count = 0
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
            count += 1
    return count


def server_side(port: int) -> list[tuple[str, int, int]]:
    """(state, send queue, receive queue) of each TCP socket whose local end is `port`, as
    /proc/net/tcp has them: for the listener (state 0A) the receive queue is its accept
    queue, the connections the kernel holds that the server has not accepted yet."""
    rows = []
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port:
            tx, rx = fields[4].split(":")
            rows.append((fields[3], int(tx, 16), int(rx, 16)))
    return rows


def accept_queue(port: int) -> int:
    return sum(rx for state, _, rx in server_side(port) if state == "0A")


def closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# The idle clients: another process, as an attacker is (in this one they would share the
# server thread's interpreter lock). It raises RLIMIT_NOFILE's soft limit to the hard one
# where needed, opens as many of `count` connections as that allows (and 20 s: a server
# with a small backlog makes each connect past it wait a second), says how many, and for
# each line read says how many of them the server has not closed.
CLIENTS = """
import resource, socket, sys, time
port, count, spare = (int(a) for a in sys.argv[1:])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
wanted = count + spare if hard == resource.RLIM_INFINITY else min(hard, count + spare)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
idle, deadline = [], time.monotonic() + 20
while len(idle) < min(count, max(soft, wanted) - spare) and time.monotonic() < deadline:
    idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
for s in idle:
    s.setblocking(False)
def still_open(s):
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
print(len(idle), flush=True)
for _ in sys.stdin:
    print(sum(still_open(s) for s in idle), flush=True)
"""


def scrape(port: int, path: str = "/metrics", timeout: float = 5.0) -> tuple[int, float]:
    started = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as answer:
        answer.read()
        return answer.status, time.monotonic() - started


def test_thousands_of_idle_connections_hold_no_thread_keep_no_scraper_out_and_are_dropped_after_the_read_timeout(
        ) -> None:
    port = free_port()
    threads_before, os_threads_before = threading.active_count(), os_threads()
    server = metrics.serve(f"127.0.0.1:{port}", lambda: None)
    fds_before = open_fds() + 2  # and the two pipes to the clients
    clients = subprocess.Popen([sys.executable, "-c", CLIENTS, str(port), str(IDLE), str(SPARE_FDS)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert clients.stdin is not None and clients.stdout is not None
    ask, answer = clients.stdin, clients.stdout

    def still_open() -> int:
        ask.write("?\n")
        ask.flush()
        return int(answer.readline())

    try:
        count = int(answer.readline())
        opened = time.monotonic()
        # One thread serves them all, the loop's, whatever their number.
        assert threading.active_count() <= threads_before + 1
        assert os_threads() <= os_threads_before + 1
        # A hard limit under IDLE + SPARE_FDS: as many as it allows, at least 1000.
        assert count >= 1000, f"{count} of {IDLE} connections opened: RLIMIT_NOFILE's hard limit, or slow connects"
        # It holds at most its cap of them, not thousands. The kernel's backlog still drains
        # into it when the clients are done connecting, and between an accept and the
        # eviction that makes room it holds one more: so the bound, on the descriptors and
        # on the connections, once it has taken what was queued. Waited for well within the
        # read timeout: after that one a server holding them all would pass any bound.
        def held() -> str:
            return (f"{open_fds()} descriptors (bound {fds_before} + {httpserver.MAX_CONNECTIONS}), "
                    f"{established(port)} connections, {accept_queue(port)} not accepted yet")

        wait_for(lambda: open_fds() <= fds_before + httpserver.MAX_CONNECTIONS
                 and established(port) <= httpserver.MAX_CONNECTIONS,
                 "the server to hold at most its cap", timeout_s=httpserver.READ_TIMEOUT_S / 2, detail=held)
        assert still_open() >= httpserver.MAX_CONNECTIONS  # the newest are held, not refused
        status, took = scrape(port)
        assert status == 200 and took < 3.0, took
        # The ones still held never sent a request: dropped at the read timeout.
        wait_for(lambda: still_open() == 0, "the idle connections dropped at the read timeout",
                 timeout_s=opened + httpserver.READ_TIMEOUT_S + 10 - time.monotonic(), detail=held)
        assert established(port) == 0 and open_fds() <= fds_before
        assert scrape(port)[0] == 200
    finally:
        clients.kill()
        clients.wait()
        ask.close()
        answer.close()
        server.shutdown()
        server.server_close()


def serve(app: Any = None, **limits: Any) -> tuple[BoundedHTTPServer, int]:
    def hello(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"hello\n"]

    server = BoundedHTTPServer("127.0.0.1", 0, app or hello, **limits)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def test_a_client_sending_its_request_a_byte_at_a_time_is_dropped_at_the_total_read_timeout() -> None:
    server, port = serve(read_timeout_s=1.0)
    try:
        request = b"GET /metrics HTTP/1.1\r\n" + b"X-Slow: " + b"x" * 200 + b"\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            started = time.monotonic()
            # Each byte comes well within a second of the last: a per-read timeout would
            # keep this client for the whole request (44 s), and a longer one for ever.
            for byte in request:
                try:
                    client.sendall(bytes([byte]))
                except OSError:
                    break
                if closed_by_server(client):
                    break
                client.setblocking(True)
                time.sleep(0.2)
            took = time.monotonic() - started
        assert 0.9 <= took < 2.5, took
    finally:
        server.shutdown()
        server.server_close()


def test_over_the_cap_the_oldest_connection_is_evicted_and_the_new_one_answered() -> None:
    server, port = serve(max_connections=4, read_timeout_s=30.0)
    try:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        wait_for(lambda: accept_queue(port) == 0, "the server to accept the four")
        assert not any(closed_by_server(s) for s in idle)
        status, took = scrape(port, "/")
        assert status == 200 and took < 2.0
        # Evicted before the scrape was answered; its close may reach the client a moment after.
        wait_for(lambda: closed_by_server(idle[0]), "the oldest connection closed", timeout_s=5)
        assert [closed_by_server(s) for s in idle] == [True, False, False, False]
        for sock in idle:
            sock.close()
    finally:
        server.shutdown()
        server.server_close()


def test_a_client_that_never_reads_its_answer_is_dropped_at_the_write_timeout() -> None:
    def big(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"x" * (64 << 20)]  # far more than both sockets' buffers

    server, port = serve(big, write_timeout_s=1.0)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.sendall(b"GET / HTTP/1.0\r\n\r\n")
            # Held while it sends: established with its send queue full. One it dropped at
            # once would be closing (FIN_WAIT) with the data still queued.
            wait_for(lambda: any(state == "01" and tx > 0 for state, tx, _ in server_side(port)),
                     "the server sending, its send queue full", timeout_s=10)
            assert established(port) == 1
            wait_for(lambda: established(port) == 0, "the connection dropped at the write timeout", timeout_s=10)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"nonsense\r\n\r\n", b"400"),
    (b"GET / HTTP/1.0\r\nX: " + b"y" * (httpserver.MAX_REQUEST_BYTES + 10) + b"\r\n\r\n", b"431"),
])
def test_a_malformed_or_oversized_request_is_answered_and_closed(request_bytes: bytes, status: bytes) -> None:
    server, port = serve()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            with contextlib.suppress(OSError):  # the server may answer (and close) before all is sent
                client.sendall(request_bytes)
            answer = b""
            while chunk := client.recv(4096):
                answer += chunk
        assert answer.split(b" ")[1] == status
    finally:
        server.shutdown()
        server.server_close()


def test_the_kubernetes_guide_states_the_limits_the_server_has() -> None:
    guide = " ".join((Path(__file__).resolve().parents[2] / "docs/kubernetes.md").read_text().split())
    assert f"at most {httpserver.MAX_CONNECTIONS} are held" in guide
    assert (f"{httpserver.READ_TIMEOUT_S:g} s to send its request and {httpserver.WRITE_TIMEOUT_S:g} s to take the "
            "answer") in guide


# The server alone in a process with 4 descriptors to spare; it prints its port, and for
# each line read its CPU time and the warnings it logged.
STARVED = """
import logging, os, resource, sys, threading
from numad_infer.status.httpserver import BoundedHTTPServer
warnings = []
logging.getLogger().addHandler(logging.Handler())
logging.getLogger().handlers[0].emit = lambda record: warnings.append(record.getMessage())
server = BoundedHTTPServer("127.0.0.1", 0, lambda e, r: (r("200 OK", []), [b"ok"])[1])
threading.Thread(target=server.serve_forever, daemon=True).start()
spare = len(os.listdir("/proc/self/fd")) + 4
resource.setrlimit(resource.RLIMIT_NOFILE, (spare, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(server.server_address[1], flush=True)
for _ in sys.stdin:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(usage.ru_utime + usage.ru_stime, len(warnings), repr(warnings[-1:]), flush=True)
"""


def test_out_of_descriptors_the_server_waits_for_one_without_spinning_and_says_so_once() -> None:
    child = subprocess.Popen([sys.executable, "-c", STARVED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=Path(__file__).resolve().parents[2])
    assert child.stdin is not None and child.stdout is not None
    ask, answer = child.stdin, child.stdout

    def cpu_and_warnings() -> tuple[float, int, str]:
        ask.write("?\n")
        ask.flush()
        cpu, count, last = answer.readline().split(" ", 2)
        return float(cpu), int(count), last

    try:
        port = int(answer.readline())
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
        wait_for(lambda: cpu_and_warnings()[1] >= 1, "the server out of descriptors, and saying so", timeout_s=10)
        before, _, _ = cpu_and_warnings()
        time.sleep(2.0)  # a window to measure its CPU time over, not a wait for something
        after, warnings, last = cpu_and_warnings()
        assert after - before < 0.5  # a loop retrying accept at once burns the whole 2 s
        assert warnings == 1 and "cannot accept a connection (Too many open files)" in last  # not one a retry
        for sock in clients:
            sock.close()
        status, took = scrape(port)  # the held ones closed, descriptors are free again
        assert status == 200 and took < 3.0
    finally:
        child.kill()
        child.wait()
        ask.close()
        answer.close()
