"""Request timings from the front door's log: HAProxy (the rendered haproxy.cfg, real)
sends one line per request to the daemon's socket (frontdoor/request_log.py), which
fills the per-instance histograms of time to first token and request duration.

The instance is a small HTTP server here that answers as llama-server does a stream:
headers at once, the first token later, the rest after that, so the figures can be
held to known delays."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import stat
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from numad_infer.backends.process import ProcessBackend
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.frontdoor.haproxy_config import server_name
from numad_infer.frontdoor.request_log import RequestLog, Timings
from numad_infer.util.histogram import TIME_TO_FIRST_TOKEN_BOUNDS, Histogram, Recorder
from tests.daemon_harness import run_dir, wait_for
from tests.frontdoor.harness import Door, as_root, with_haproxy

FIRST_TOKEN_S, REST_S = 0.6, 0.4


def test_a_value_on_a_bound_falls_in_that_bucket_and_the_buckets_add_up() -> None:
    recorder = Recorder((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        recorder.observe(value)
    snap = recorder.snapshot()
    assert snap.counts == (2, 2, 1) and snap.count == 5 and snap.sum == pytest.approx(8.65)
    assert snap.cumulative() == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]
    assert Histogram.empty((0.1,)).cumulative() == [("0.1", 0), ("+Inf", 0)]


@pytest.mark.parametrize("line, counted", [
    ("infer-0 200 41 613\n", True),
    ("infer-1 502 - 12\n", False),  # no byte of an answer came from the instance
    ("<NOSRV> 503 - 0\n", False),  # answered by HAProxy itself (health, full queue)
    ("infer-0 200 41\n", False),
    ("infer-0 200 -5 10\n", False),
    ("\x1b[2J 200 1 1\n", True),  # counted under that name; names come from HAProxy, the only sender
])
def test_only_a_served_requests_line_is_counted(line: str, counted: bool) -> None:
    timings = Timings()
    assert timings.record(line) is counted
    assert bool(timings.snapshot()) is counted


def test_the_lines_fill_each_servers_histograms_in_seconds() -> None:
    timings = Timings()
    for line in ("infer-0 200 40 600", "infer-0 200 3000 9000", "infer-1 200 100 100"):
        timings.record(line)
    first, whole = timings.snapshot()["infer-0"]
    assert first.count == whole.count == 2
    assert first.sum == pytest.approx(3.04) and whole.sum == pytest.approx(9.6)
    assert dict(first.cumulative())["0.05"] == 1 and dict(first.cumulative())["5.0"] == 2
    assert first.bounds == TIME_TO_FIRST_TOKEN_BOUNDS


def send(path: Path, line: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(line.encode(), str(path))


def test_a_datagram_from_another_user_is_not_counted(tmp_path: Path) -> None:
    log = RequestLog(tmp_path / "requests.sock", frozenset({os.geteuid()}))
    log.start()
    try:
        send(log.path, "infer-0 200 10 20")
        wait_for(lambda: "infer-0" in log.timings.snapshot(), "the sender's line")
        if os.geteuid() == 0:
            pid = os.fork()
            if pid == 0:  # the child: another user, as any local user could try
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    send(log.path, "infer-9 200 10 20")
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
        else:
            log.senders = frozenset({os.geteuid() + 1})
            send(log.path, "infer-9 200 10 20")
        time.sleep(0.3)
        assert "infer-9" not in log.timings.snapshot()
    finally:
        log.close()
    assert not log.path.exists()


class StreamLikeLlamaServer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # HAProxy's health check
        body = b'{"status":"ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()  # the headers leave at once, before any token, as llama-server's do
        for delay, data in ((FIRST_TOKEN_S, b'data: {"token": 1}\n\n'), (REST_S, b"data: [DONE]\n\n")):
            time.sleep(delay)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


@as_root
@with_haproxy
def test_haproxy_reports_the_first_token_not_the_headers_and_a_client_gets_it_as_soon(tmp_path: Path) -> None:
    door = Door(tmp_path)
    instance = door.plan.instances[0]
    server = ThreadingHTTPServer(("127.0.0.1", instance.port), StreamLikeLlamaServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        door.start()
        wait_for(lambda: door.door.observe() is not None and door.door.in_flight(instance) is not None,
                 "the server in HAProxy's view", detail=door.log)
        wait_for(lambda: (door.door.stats.servers[f"{instance.name.replace('@', '-')}"].status  # type: ignore[union-attr]
                          .startswith("UP")) if door.door.observe() else False, "the instance UP", detail=door.log)
        # The plan's other instance has no server: until its checks fail it counts as UP, and
        # a prompt that hashes to it (affinity = "prefix") would be refused there and retried
        # here after HAProxy's 1 s turn-around, which is not what this test measures.
        other = server_name(door.plan.instances[1].name)
        wait_for(lambda: door.door.observe() is not None and door.door.stats is not None
                 and door.door.stats.servers[other].status.startswith("DOWN"), "the other instance DOWN",
                 detail=door.log)
        conn = http.client.HTTPConnection("127.0.0.1", door.port, timeout=30)
        started = time.monotonic()
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "stream": True}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        first = response.read1(64)
        client_first = time.monotonic() - started
        response.read()
        assert first.startswith(b"data: ")
        wait_for(lambda: door.door.timings(instance) is not None, "the request's timing line", detail=door.log)
        timings = door.door.timings(instance)
        assert timings is not None
        ttft, whole = timings
        assert ttft.count == whole.count == 1
        # The first token, not the headers (sent at once), and the whole answer after it.
        assert FIRST_TOKEN_S - 0.05 <= ttft.sum <= FIRST_TOKEN_S + 0.5, ttft
        assert ttft.sum + REST_S - 0.05 <= whole.sum <= FIRST_TOKEN_S + REST_S + 1.0, whole
        # The client had that token within a few ms of HAProxy (no Nagle wait on the way).
        assert client_first - ttft.sum < 0.1, (client_first, ttft.sum)
        print(f"ttft {ttft.sum:.3f}s duration {whole.sum:.3f}s client first byte {client_first:.3f}s")
    finally:
        door.stop()
        server.shutdown()


def test_a_tenants_answers_are_counted_by_status_and_its_served_ones_timed() -> None:
    timings = Timings()
    lines = ("infer-0 200 40 600 team-a", "<NOSRV> 429 - 0 team-a", "<NOSRV> 401 - 0 -", "infer-1 502 - 12 team-a",
             "infer-1 200 100 300 team-b", "infer-0 200 50 50")  # the last: a HAProxy from before tenants
    served = [timings.record(line) for line in lines]
    assert served == [True, False, False, False, True, True]
    usage = timings.tenants()
    assert set(usage) == {"team-a", "team-b"}  # a request without a known key is no one's
    assert usage["team-a"].answers == {"200": 1, "429": 1, "502": 1}
    assert usage["team-a"].time_to_first_token.count == 1 and usage["team-a"].request_duration.sum == 0.6
    assert timings.snapshot()["infer-0"][0].count == 2


def test_a_tenants_tokens_are_added_up_where_haproxy_read_them() -> None:
    timings = Timings()
    for line in ("infer-0 200 40 600 team-a 120 30",  # an answer sent whole: its usage
                 "infer-0 200 40 600 team-a - -",  # a stream: not read
                 "<NOSRV> 429 - 0 team-a - -",
                 "infer-0 200 40 600 team-a 7 -",  # half a count is none
                 "infer-1 200 10 90 team-b 5 2"):
        timings.record(line)
    used = timings.tenants()
    assert (used["team-a"].prompt_tokens, used["team-a"].completion_tokens, used["team-a"].counted_answers) == (120, 30, 1)
    assert used["team-a"].answers == {"200": 3, "429": 1}
    assert (used["team-b"].prompt_tokens, used["team-b"].completion_tokens, used["team-b"].counted_answers) == (5, 2, 1)


@pytest.mark.parametrize("line, status", [
    ("infer-0 502/KD - 1200 team-a - -", None),  # at an instance, ended by the daemon's watch: the 502 never sent
    ("<NOSRV> 503/KQ - 800 team-a - -", None),  # ended in the queue
    ("infer-0 200/CD 40 900 team-a - -", None),  # a stream the client cut
    ("<NOSRV> -1/CR - 5 team-a - -", None),  # gone before its request was whole
    ("infer-1 502/SH - 12 team-a - -", "502"),  # the instance died: a failure, as before
    ("<NOSRV> 408/cR - 10000 team-a - -", "408"),  # a client too slow to send its request is answered
    ("infer-0 200/-- 40 600 team-a 12 3", "200"),
    ("infer-1 502 - 12 team-a - -", "502"),  # a HAProxy started before the ending was logged: not known
    ("infer-1 502 - 12 team-a", "502"),
])
def test_a_request_whose_client_left_is_counted_as_left_not_by_the_status_haproxy_logged(
        line: str, status: str | None) -> None:
    timings = Timings()
    timings.record(line)
    used = timings.tenants()["team-a"]
    assert used.answers == ({} if status is None else {status: 1})
    assert used.left == (1 if status is None else 0)


def test_the_ending_changes_nothing_else_in_a_line() -> None:
    timings = Timings()
    assert timings.record("infer-0 200/-- 41 613")  # without tenants
    assert timings.record("infer-0 200/CD 40 900 team-a - -")  # its client had its first token
    assert not timings.record("infer-0 502/KD - 1200 team-a - -")
    assert timings.record("infer-0 200/-- 40 600 team-a 12 3")
    used = timings.tenants()["team-a"]
    assert (used.answers, used.left, used.prompt_tokens, used.counted_answers) == ({"200": 1}, 2, 12, 1)
    assert used.time_to_first_token.count == 2 and timings.snapshot()["infer-0"][0].count == 3


SETPRIV = shutil.which("setpriv")
# Sends one line to the socket in argv[1]; says whether the kernel let it.
_SEND = ("import socket, sys\n"
         "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
         "try:\n    s.sendto(sys.argv[2].encode(), sys.argv[1])\n"
         "except PermissionError:\n    print('refused')\nelse:\n    print('sent')\n")


def _send_as(uid: int, gid: int, path: Path, line: str) -> str:
    assert SETPRIV is not None
    done = subprocess.run([SETPRIV, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "/usr/bin/python3", "-c",
                           _SEND, str(path), line], capture_output=True, text=True, cwd="/", timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="sending as another user needs root")
@pytest.mark.skipif(SETPRIV is None or not os.access("/usr/bin/python3", os.X_OK),
                    reason="setpriv (util-linux) or /usr/bin/python3 missing")
def test_only_haproxy_and_root_may_send_to_the_request_log(tmp_path: Path) -> None:
    directory = run_dir(tmp_path)  # searchable by others, as the daemon's run directory is
    runner = ProcessBackend(directory / "logs").frontdoor_runner(directory)
    log = Frontdoor(runner).requests  # as the daemon makes it
    gid = runner.haproxy_gid
    stranger = next(i for i in (65534, 54321) if i not in runner.haproxy_uids and i != gid)
    # The control: a socket anyone may write to, beside it, takes the stranger's line, so a
    # refusal below is the socket's own mode, not the directory's.
    beside = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    old = os.umask(0)
    try:
        beside.bind(str(directory / "open.sock"))
    finally:
        os.umask(old)
    try:
        assert _send_as(stranger, stranger, directory / "open.sock", "x") == "sent"
        log.start()
        assert _send_as(stranger, stranger, log.path, "infer-9 200/-- 10 20") == "refused"  # EACCES
        info = log.path.stat()
        assert stat.S_ISSOCK(info.st_mode) and info.st_uid == 0
        assert stat.S_IMODE(info.st_mode) == (0o660 if gid is not None else 0o600)
        if gid is not None:
            assert info.st_gid == gid
        # HAProxy's own user still may, and its lines count.
        haproxy = next((u for u in runner.haproxy_uids if u != 0), None)
        if haproxy is not None and gid is not None:
            assert _send_as(haproxy, gid, log.path, "infer-7 200/-- 10 20") == "sent"
            wait_for(lambda: "infer-7" in log.timings.snapshot(), "HAProxy's user's line")
        assert "infer-9" not in log.timings.snapshot()
    finally:
        log.close()
        beside.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_the_request_log_is_its_owners_alone_or_haproxys_groups_too(tmp_path: Path) -> None:
    """Where HAProxy runs as the daemon's user (no group given) 0600 is enough; with its
    group, that group may write too. Never anyone else, not even for a moment: the file is
    made under a umask that leaves only its owner."""
    alone = RequestLog(tmp_path / "alone.sock", frozenset({os.geteuid()}))
    grouped = RequestLog(tmp_path / "grouped.sock", frozenset({os.geteuid()}), os.getegid())
    try:
        for log, mode in ((alone, 0o600), (grouped, 0o660)):
            log.start()
            info = log.path.stat()
            assert stat.S_IMODE(info.st_mode) == mode, oct(info.st_mode)
            assert info.st_gid == os.getegid()
    finally:
        alone.close()
        grouped.close()
