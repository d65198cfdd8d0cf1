"""A client that leaves before its answer: the daemon ends its request (frontdoor/abandoned.py).

The daemon's own front door code over a real HAProxy, with stand-in instances that never
answer a POST and note when the front door closes the connection to them (what makes
llama-server cancel the task: tests/e2e/test_abandoned.py does it with the real engine).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
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
from tests.frontdoor.silent_instance import SilentInstance

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

# /proc/net/tcp and tcp6 with the front door listening (0A) on 127.0.0.1 and its twin ::1 at
# port 18123 (46CB), and on 127.0.0.1:8080 (1F90), all root's (uid 0); a client gone
# (CLOSE_WAIT, 08) from the front door's port, one still connected (01), a CLOSE_WAIT on
# another port, and an IPv4 client of an IPv6 socket, accepted by HAProxy's user (994).
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:46CB 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2768270 1 0 20 4 28 10 -1
   1: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2768271 1 0 20 4 28 10 -1
 129: 0100007F:46CB 0100007F:D920 08 00000000:00000001 00:00000000 00000000     0        0 2768276 1 0 20 4 28 10 -1
 130: 0100007F:46CB 0100007F:D926 01 00000000:00000000 00:00000000 00000000     0        0 2768277 1 0 20 4 28 10 -1
 131: 0100007F:1F90 0100007F:D930 08 00000000:00000001 00:00000000 00000000     0        0 2768278 1 0 20 4 28 10 -1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when \
retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:46CB 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 \
00000000     0        0 2768272 1 0 20 4 28 10 -1
   1: 00000000000000000000000001000000:46CB 0000000000000000FFFF00000100007F:9C40 08 00000000:00000001 00:00000000 \
00000000   994        0 2768279 1 0 20 4 28 10 -1
"""
FRONT_DOOR = ["127.0.0.1", "::1"]  # frontend.listen's address and its loopback twin
HAPROXY = frozenset({0, 994})  # who HAProxy runs as (and root): accept() makes a connection theirs


def _row(k: int, local: str, remote: str, state: str, uid: int) -> str:
    """One /proc/net/tcp row (addresses as the kernel prints them)."""
    return (f" {k:3d}: {local} {remote} {state} 00000000:00000001 00:00000000 00000000 {uid:5d}        0 "
            f"{k + 900} 1 0 20 4 28 10 -1")


# Another local user (uid 65534, nobody) listens on 127.0.0.2:18123 (the front door holds
# 127.0.0.1 and ::1 only), connects to it from the client's address and port, and closes
# that end: CLOSE_WAIT at 127.0.0.2, naming client 127.0.0.1:55590 (D926). And rows no
# front door listener accepted at its own address either: another user's, and a root
# socket at an address the front door does not listen on.
ATTACK = [_row(10, "0200007F:46CB", "00000000:0000", "0A", 65534),
          _row(11, "0200007F:46CB", "0100007F:D926", "08", 65534),
          _row(12, "0100007F:46CB", "0100007F:D92A", "08", 65534),
          _row(13, "0300007F:46CB", "0100007F:D930", "08", 0)]


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
    assert clients_gone(tmp_path, FRONT_DOOR, 18123, HAPROXY) == {(LO, 55584), (LO, 40000)}
    assert clients_gone(tmp_path, FRONT_DOOR, 8080, HAPROXY) == {(LO, 55600)}
    assert clients_gone(tmp_path, FRONT_DOOR, 9999, HAPROXY) == set()
    assert clients_gone(tmp_path, ["127.0.0.1"], 18123, HAPROXY) == {(LO, 55584)}  # no twin: ::1's are not its
    # The listener's user (root, still in its queue) or HAProxy's: not user 994's if HAProxy is not.
    assert clients_gone(tmp_path, FRONT_DOOR, 18123, {0}) == {(LO, 55584)}


def test_only_connections_the_front_doors_listeners_accepted_count(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(TCP + "\n".join(ATTACK) + "\n")
    (tmp_path / "net" / "tcp6").write_text(TCP6)
    # Not 127.0.0.2's (another user's listener), not one of another uid at the front door's
    # own address, not root's at an address the front door does not listen on.
    assert clients_gone(tmp_path, FRONT_DOOR, 18123, HAPROXY) == {(LO, 55584), (LO, 40000)}


def test_a_wildcard_front_door_accepts_at_every_address_of_its_family_but_as_its_own_user(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    rows = [_row(0, "00000000:46CB", "00000000:0000", "0A", 0),  # 0.0.0.0:18123, root's
            _row(1, "0200007F:46CB", "0100007F:D920", "08", 0),  # a client of it at 127.0.0.2
            _row(2, "0300007F:46CB", "0100007F:D926", "08", 65534)]  # not its user's
    (tmp_path / "net" / "tcp").write_text(TCP.splitlines()[0] + "\n" + "\n".join(rows) + "\n")
    assert clients_gone(tmp_path, ["0.0.0.0", "::1"], 18123, HAPROXY) == {(LO, 55584)}
    # IPv6's wildcard takes IPv6 sockets only (IPv4 clients of it as ::ffff:a.b.c.d).
    assert clients_gone(tmp_path, ["::"], 18123, HAPROXY) == set()


class _Api:
    """HAProxy's runtime API as the watch uses it: `show sess` answers SHOW_SESS."""

    def __init__(self, local: str = "127.0.0.1:18123") -> None:
        self.sent: list[str] = []
        self.local = local  # where each stream's client connected to, as `show sess ID` says

    def command(self, line: str) -> str:
        self.sent.append(line)
        if line == "show sess":
            return SHOW_SESS
        if line.startswith("show sess "):  # HAProxy 2.6's detail of one stream, its client side
            return (f"{line[10:]}: [06/Dec/2026:18:13:56.316043] id=0 proto=tcpv4 source=127.0.0.1:55584\n"
                    "  flags=0xc4a, conn_retries=0, conn_exp=<NEVER> conn_et=0x000 srv_conn=0x1, pend_pos=(nil)\n"
                    f"  frontend=openai (id=2 mode=http), listener=? (id=1) addr={self.local}\n"
                    "  backend=model (id=3 mode=http) addr=127.0.0.1:59248\n")
        return ""


class _Runner:
    haproxy_uids = HAPROXY


class _FakeDoor:
    def __init__(self, listen: str) -> None:
        self.listen, self.api, self.runner = listen, _Api(), _Runner()


def _proc_with(tmp_path: Path, *clients: int) -> Path:
    """A /proc/net/tcp with these local clients gone from port 18123 (46CB)."""
    (tmp_path / "net").mkdir(exist_ok=True)
    rows = [TCP.splitlines()[1]]  # the front door's listening socket
    rows += [f" {k}: 0100007F:46CB 0100007F:{port:04X} 08 00000000:00000001 00:00000000 00000000     0        0 "
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
    assert door.api.sent == ["show sess", "show sess 0x55dd2ec99900", "shutdown session 0x55dd2ec99900",
                             "show sess 0x55dd2ec98800", "shutdown session 0x55dd2ec98800"]
    assert watch.ended == {"model": 2}
    assert AbandonWatch(_FakeDoor(""), proc=tmp_path).poll() == []  # no front door


def test_a_stream_whose_client_connected_to_another_local_address_is_not_ended(tmp_path: Path) -> None:
    # A wildcard front door: a client with a key connects at 127.0.0.2 from the address and
    # port of someone's running request (at 127.0.0.1), then closes. `show sess` names
    # clients only; the stream's own local address tells the two connections apart.
    door = _FakeDoor("0.0.0.0:18123")
    door.api.local = "127.0.0.2:18123"
    proc = _proc_with(tmp_path, 55590)
    table = (proc / "net" / "tcp").read_text()  # the listener on 0.0.0.0, the client gone at 127.0.0.1
    (proc / "net" / "tcp").write_text(table.replace(" 0: 0100007F:46CB 00000000:0000 0A", " 0: 00000000:46CB 00000000:0000 0A"))
    watch = AbandonWatch(door, proc=proc)
    assert watch.poll() == [] and watch.ended == {}
    assert not any(line.startswith("shutdown") for line in door.api.sent)
    door.api.local = "127.0.0.1:18123"  # the stream whose client did leave
    assert [s.id for s in watch.poll()] == ["0x55dd2ec99900"]


def test_the_watch_ends_nothing_for_another_users_half_closed_connections(tmp_path: Path) -> None:
    # The half-closed connections name clients with streams (55590, 55594), but no front
    # door listener accepted them: HAProxy is not even asked.
    door = _FakeDoor("127.0.0.1:18123")
    proc = _proc_with(tmp_path)
    (proc / "net" / "tcp").write_text((proc / "net" / "tcp").read_text() + "\n".join(ATTACK) + "\n")
    watch = AbandonWatch(door, proc=proc)
    assert watch.poll() == [] and door.api.sent == [] and watch.ended == {}


@pytest.fixture
def door(tmp_path: Path) -> Iterator[tuple[Door, list[SilentInstance]]]:
    made = Door(tmp_path, server="parallel = 1\n")
    instances = [SilentInstance(i.port) for i in made.plan.instances]
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


def _gone(front: Door) -> set[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """What the watch sees of this front door's clients that left (in /proc)."""
    return clients_gone(Path("/proc"), FRONT_DOOR, front.port, front.door.runner.haproxy_uids)


@with_haproxy
def test_a_non_streaming_request_whose_client_left_is_ended_and_its_instance_freed(door) -> None:
    front, instances = door
    watch = AbandonWatch(front.door, poll_s=0.1)
    left_at, client = _ask_then_leave(front.port, 0.5)
    wait_for(lambda: sum(i.posts for i in instances) == 1, "the request at an instance")
    # Without the watch, HAProxy 2.6 keeps the instance working for a client that is gone.
    time.sleep(1.0)
    assert not any(i.closed_at for i in instances), "HAProxy closed it on its own: the watch is not needed"
    assert (LO, client[1]) in _gone(front)
    watch.start()
    try:
        wait_for(lambda: any(i.closed_at for i in instances), "the front door closing the instance's connection",
                 timeout_s=10)
    finally:
        watch.stop()
    closed = next(t for i in instances for t in i.closed_at)
    assert closed - left_at < 3.0, f"freed {closed - left_at:.1f}s after the client left"
    assert watch.ended == {b: 1 for b in front.door.backends.values()}
    assert _gone(front) == set()


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


# Another local user's attack on the watch: the victim's source port, read in /proc/net/tcp
# (world-readable); a listener on 127.0.0.2 at the front door's port (it holds 127.0.0.1
# and ::1 only); a connection to it from the victim's address and port (the kernel hands
# out a source port in use towards another destination: connect until it does), whose
# client end is closed while the accepted end stays open, in CLOSE_WAIT, naming the victim.
ATTACKER = """
import socket, struct, sys, time
front, hold = int(sys.argv[1]), float(sys.argv[2])
victims = [int(f[1].split(":")[1], 16) for f in (line.split() for line in open("/proc/net/tcp").readlines()[1:])
           if f[3] == "01" and f[2] == "0100007F:%04X" % front and f[1].startswith("0100007F:")]
victim = victims[0]
listener = socket.socket()
listener.bind(("127.0.0.2", front))
listener.listen(64)
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    client = socket.socket()
    client.connect(("127.0.0.2", front))
    accepted, _ = listener.accept()
    if client.getsockname()[1] == victim:
        break
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # no TIME_WAIT left
    client.close()
    accepted.close()
else:
    sys.exit("the kernel never handed out the victim's port")
client.close()
print("holding", victim, flush=True)
time.sleep(hold)
"""


def _ask_and_wait(port: int, client: list[int], answer: list[bytes]) -> None:
    """A non-streaming request whose client stays for its answer (read to the end)."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 1800, "stream": False}).encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            client.append(sock.getsockname()[1])
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            answer.append(data)
    except OSError as exc:
        answer.append(repr(exc).encode())


@with_haproxy
def test_another_user_cannot_make_the_watch_end_a_request_whose_client_stays(door) -> None:
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or shutil.which("setpriv") is None or python is None:
        pytest.skip("needs root, setpriv and /usr/bin/python3 to run the attack as another user (uid 65534)")
    front, instances = door
    # Nobody, unless HAProxy runs as nobody (a host without its packaged user): another then.
    attacker_uid = next(uid for uid in (65534, 65533) if uid not in front.door.runner.haproxy_uids)
    release = threading.Event()
    for instance in instances:
        instance.answer = release  # the request is answered once the attack is over
    client: list[int] = []
    answer: list[bytes] = []
    victim = threading.Thread(target=_ask_and_wait, args=(front.port, client, answer), daemon=True)
    victim.start()
    watch = AbandonWatch(front.door, poll_s=0.1)
    attacker = None
    try:
        wait_for(lambda: sum(i.posts for i in instances) == 1, "the request at an instance")
        attacker = subprocess.Popen(["setpriv", f"--reuid={attacker_uid}", f"--regid={attacker_uid}", "--clear-groups",
                                     python, "-c", ATTACKER, str(front.port), "2"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd="/")
        assert attacker.stdout is not None
        line = attacker.stdout.readline()
        assert line == f"holding {client[0]}\n", f"the attack did not take: {line!r} {attacker.stderr.read()}"
        # What the watch once counted: a half-closed connection to the front door's port
        # naming the victim (another user's, at 127.0.0.2), and the victim's stream.
        tcp = Path("/proc/net/tcp").read_text()
        assert f"0200007F:{front.port:04X} 0100007F:{client[0]:04X} 08" in tcp
        assert f"src=127.0.0.1:{client[0]} " in front.door.api.command("show sess")
        ended = []
        for _ in range(15):  # 1.5 s of the watch's polls while the attacker holds it
            ended += watch.poll()
            time.sleep(0.1)
        assert ended == [] and watch.ended == {}
        assert _gone(front) == set()
    finally:
        release.set()
        if attacker is not None:
            attacker.wait(timeout=10)
        victim.join(timeout=30)
    assert answer and answer[0].startswith(b"HTTP/1.1 200"), answer  # not a 502: its request ran to the end
