"""A client that leaves before its answer: the daemon ends its request (frontdoor/abandoned.py).

The daemon's own front door code over a real HAProxy, with stand-in instances that never
answer a POST and note when the front door closes the connection to them (what makes
llama-server cancel the task: tests/e2e/test_abandoned.py does it with the real engine).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from numad_infer.frontdoor.abandon_watch import AbandonWatch
from numad_infer.frontdoor.abandoned import left_by_client, parse_sessions
from numad_infer.host.portowner import clients_gone
from tests.daemon_harness import wait_for
from tests.frontdoor.harness import Door, with_haproxy

LO = ipaddress.ip_address("127.0.0.1")

# `show sess` as HAProxy 2.6.12 answers it: a request at an instance, one queued, the
# runtime API's own session, and an IPv6 client.
SHOW_SESS = """\
0x55dd2ec98800: proto=tcpv4 src=127.0.0.1:55584 fe=openai be=model srv=infer_0 ts=00 epoch=0 age=4s calls=2 rate=0 \
cpu=0 lat=0 rq[f=48c40080h,i=0,an=8000h,rx=,wx=,ax=] rp[f=80400000h,i=0,an=1400000h,rx=4m55s,wx=,ax=] \
scf=[8,0h,fd=12] scb=[8,11h,fd=13] exp=0s rc=0 c_exp=
0x55dd2ec99900: proto=tcpv4 src=127.0.0.1:55590 fe=openai be=model srv=<none> ts=00 epoch=0 age=1s calls=2 rate=0 \
cpu=0 lat=0 rq[f=48c40080h,i=0,an=8000h,rx=,wx=,ax=] rp[f=80400000h,i=0,an=00h,rx=,wx=,ax=] scf=[8,0h,fd=14] \
scb=[1,1h,fd=-1] exp=29s rc=0 c_exp=
0x55dd2edb2ec0: proto=unix_stream src=unix:1 fe=GLOBAL be=<NONE> srv=<none> ts=00 epoch=0 age=0s calls=1 rate=1 \
cpu=0 lat=0 rq[f=c08002h,i=0,an=00h,rx=10s,wx=,ax=] rp[f=80008002h,i=0,an=00h,rx=,wx=,ax=] scf=[8,0h,fd=14] \
scb=[8,1h,fd=-1] exp=10s rc=0 c_exp=
0x55dd2edb3000: proto=tcpv6 src=::1:40000 fe=openai be=model srv=infer_1 ts=00 epoch=0 age=2m3s calls=2 rate=0 \
cpu=0 lat=0 rq[f=48c40080h,i=0,an=8000h,rx=,wx=,ax=] rp[f=80400000h,i=0,an=1400000h,rx=,wx=,ax=] \
scf=[8,0h,fd=15] scb=[8,11h,fd=16] exp=0s rc=0 c_exp=
"""

# /proc/net/tcp and tcp6 with a client gone (CLOSE_WAIT, 08) from the front door's port
# 18123 (46CB), one still connected (01), a CLOSE_WAIT on another port, and an IPv4 client
# of an IPv6 socket.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
 129: 0100007F:46CB 0100007F:D920 08 00000000:00000001 00:00000000 00000000     0        0 2768276 1 0 20 4 28 10 -1
 130: 0100007F:46CB 0100007F:D926 01 00000000:00000000 00:00000000 00000000     0        0 2768277 1 0 20 4 28 10 -1
 131: 0100007F:1F90 0100007F:D930 08 00000000:00000001 00:00000000 00000000     0        0 2768278 1 0 20 4 28 10 -1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when \
retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:46CB 0000000000000000FFFF00000100007F:9C40 08 00000000:00000001 00:00000000 \
00000000     0        0 2768279 1 0 20 4 28 10 -1
"""


def test_show_sess_is_read_into_streams_with_their_client() -> None:
    sessions = parse_sessions(SHOW_SESS)
    assert [(s.id, s.client, s.backend, s.server, s.queued, s.age) for s in sessions] == [
        ("0x55dd2ec98800", (LO, 55584), "model", "infer_0", False, "4s"),
        ("0x55dd2ec99900", (LO, 55590), "model", "<none>", True, "1s"),
        ("0x55dd2edb3000", (ipaddress.ip_address("::1"), 40000), "model", "infer_1", False, "2m3s")]


def test_only_the_front_doors_streams_of_gone_clients_are_ended() -> None:
    sessions = parse_sessions(SHOW_SESS)
    assert [s.id for s in left_by_client(sessions, "openai", {(LO, 55590), (LO, 1)})] == ["0x55dd2ec99900"]
    assert left_by_client(sessions, "another", {(LO, 55590)}) == []


def test_the_clients_gone_are_the_half_closed_connections_to_the_port(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(TCP)
    (tmp_path / "net" / "tcp6").write_text(TCP6)
    assert clients_gone(tmp_path, 18123) == {(LO, 55584), (LO, 40000)}
    assert clients_gone(tmp_path, 8080) == {(LO, 55600)}
    assert clients_gone(tmp_path, 9999) == set()


class _Api:
    """HAProxy's runtime API as the watch uses it: `show sess` answers SHOW_SESS."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def command(self, line: str) -> str:
        self.sent.append(line)
        return SHOW_SESS if line == "show sess" else ""


class _FakeDoor:
    def __init__(self, listen: str) -> None:
        self.listen, self.api = listen, _Api()


def _proc_with(tmp_path: Path, *clients: int) -> Path:
    """A /proc/net/tcp with these local clients gone from port 18123 (46CB)."""
    (tmp_path / "net").mkdir(exist_ok=True)
    rows = [f" {k}: 0100007F:46CB 0100007F:{port:04X} 08 00000000:00000001 00:00000000 00000000     0        0 "
            f"{k + 100} 1 0 20 4 28 10 -1" for k, port in enumerate(clients)]
    (tmp_path / "net" / "tcp").write_text(TCP.splitlines()[0] + "\n" + "\n".join(rows) + "\n")
    return tmp_path


def test_the_watch_ends_the_queued_first_and_asks_nothing_while_no_client_left(tmp_path: Path) -> None:
    door = _FakeDoor("127.0.0.1:18123")
    watch = AbandonWatch(door, proc=_proc_with(tmp_path))
    assert watch.poll() == [] and door.api.sent == []  # the usual poll: two tables read, HAProxy not asked
    # Both clients gone: the queued one is ended before the one at an instance, whose slot
    # HAProxy would otherwise hand straight to it.
    watch = AbandonWatch(door, proc=_proc_with(tmp_path, 55584, 55590))
    assert [s.id for s in watch.poll()] == ["0x55dd2ec99900", "0x55dd2ec98800"]
    assert door.api.sent == ["show sess", "shutdown session 0x55dd2ec99900", "shutdown session 0x55dd2ec98800"]
    assert watch.ended == {"model": 2}
    assert AbandonWatch(_FakeDoor(""), proc=tmp_path).poll() == []  # no front door


class _Instance:
    """Answers GET (HAProxy's health check); takes a POST and never answers it, noting when
    the connection to it is closed: what a generating llama-server sees when the front door
    gives up on a request."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", port))
        self.posts = 0
        self.closed_at: list[float] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = conn.recv(65536)
            if head.startswith(b"GET"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
                return
            self.posts += 1
            while conn.recv(65536):  # the rest of the body; then EOF when the front door closes
                pass
            self.closed_at.append(time.monotonic())

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def door(tmp_path: Path) -> Iterator[tuple[Door, list[_Instance]]]:
    made = Door(tmp_path, server="parallel = 1\n")
    instances = [_Instance(i.port) for i in made.plan.instances]
    assert made.apply()
    api = made.door.api
    wait_for(lambda: all(s.status == "UP" for b in made.door.backends.values()
                         for s in api.backend(b).instances.values()), f"every server UP\n{made.log()}")
    yield made, instances
    made.stop()
    for instance in instances:
        instance.close()


def _ask_then_leave(port: int, leave_after_s: float, done: threading.Event | None = None,
                    prompt: str = "Once upon a time") -> tuple[float, tuple[str, int]]:
    """A non-streaming request over a raw socket, closed without reading an answer after
    `leave_after_s`, or as soon as `done` is set."""
    body = json.dumps({"prompt": prompt, "max_tokens": 1800, "stream": False}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        client = sock.getsockname()[:2]
        (done or threading.Event()).wait(leave_after_s)
    return time.monotonic(), client


@with_haproxy
def test_a_non_streaming_request_whose_client_left_is_ended_and_its_instance_freed(door) -> None:
    front, instances = door
    watch = AbandonWatch(front.door, poll_s=0.1)
    left_at, client = _ask_then_leave(front.port, 0.5)
    wait_for(lambda: sum(i.posts for i in instances) == 1, "the request at an instance")
    # Without the watch, HAProxy 2.6 keeps the instance working for a client that is gone.
    time.sleep(1.0)
    assert not any(i.closed_at for i in instances), "HAProxy closed it on its own: the watch is not needed"
    assert (LO, client[1]) in clients_gone(Path("/proc"), front.port)
    watch.start()
    try:
        wait_for(lambda: any(i.closed_at for i in instances), "the front door closing the instance's connection",
                 timeout_s=10)
    finally:
        watch.stop()
    closed = next(t for i in instances for t in i.closed_at)
    assert closed - left_at < 3.0, f"freed {closed - left_at:.1f}s after the client left"
    assert watch.ended == {b: 1 for b in front.door.backends.values()}
    assert clients_gone(Path("/proc"), front.port) == set()


@with_haproxy
def test_a_queued_request_whose_client_left_never_reaches_an_instance(door) -> None:
    front, instances = door
    slots = len(instances)  # parallel = 1: one request fills an instance
    # The holders stay until the end: on a loaded machine a health check may time out and
    # take an instance out for a moment, and a holder's request then waits in the queue
    # for it; one that left meanwhile would never arrive.
    release = threading.Event()
    # One conversation each: under prefix routing (the default) a shared prompt would be one
    # key, kept on one instance within the load bound, and leave another idle.
    holders = [threading.Thread(target=_ask_then_leave, args=(front.port, 120.0, release, f"Holder {n}"), daemon=True)
               for n in range(slots)]
    for holder in holders:
        holder.start()
    try:
        wait_for(lambda: sum(i.posts for i in instances) == slots, "every instance busy", timeout_s=60)
        watch = AbandonWatch(front.door, poll_s=0.1)
        _, client = _ask_then_leave(front.port, 0.5)
        ended = []
        wait_for(lambda: ended.extend(watch.poll()) or ended, "the queued request ended", timeout_s=15)
        assert [(s.client[1], s.queued) for s in ended] == [(client[1], True)]
        assert sum(i.posts for i in instances) == slots  # it never reached one
    finally:
        release.set()
        for holder in holders:
            holder.join()
