"""The metrics endpoint's HTTP server: one thread, however many clients connect.

`[metrics] listen` may be every address of a pod (Kubernetes: 0.0.0.0:9464), which any
pod of the cluster can reach. A thread per connection with no deadline (the server
prometheus_client ships) let idle half-requests pile up threads until the pod's pids
limit stopped the daemon starting servers or HAProxy. Here one thread serves every
connection (non-blocking sockets, one selector):

- an idle connection costs a descriptor, never a thread, and at most `max_connections`
  are held: one more evicts the oldest. Refusing the new one instead would let a flood
  of idle connections keep a scraper out; evicted, the flood only evicts itself, and a
  scraper, whose request follows its connect within milliseconds, is answered long
  before it is the oldest;
- a connection has `read_timeout_s` from its accept to the end of its request's
  headers, in total (a per-read timeout would keep a client that sends one byte a
  second forever), and `write_timeout_s` to take the answer (one that never reads it
  would otherwise hold its buffer);
- the request is its headers only, at most `MAX_REQUEST_BYTES`.

HTTP/1.0, one request per connection, answered by a WSGI app (prometheus_client's, which
chooses the format and the compression) run in this thread: it reads a published
snapshot and never waits.
"""

from __future__ import annotations

import contextlib
import io
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import unquote
from wsgiref.handlers import SimpleHandler

if TYPE_CHECKING:
    from wsgiref.types import WSGIApplication

    from _typeshed import OptExcInfo

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64  # held at once; a scrape needs one
READ_TIMEOUT_S = 5.0  # accept -> end of the request's headers (a scraper sends them at once)
WRITE_TIMEOUT_S = 10.0  # first byte of the answer -> last
MAX_REQUEST_BYTES = 8192  # request line and headers: a GET needs a few hundred
BACKLOG = 512  # kernel memory, no descriptor of ours; a burst over it drops SYNs: a scrape waits 1 s to retry
ACCEPT_PAUSE_S = 0.1  # out of descriptors: accept again this much later, never spin
_READ_SIZE = 4096


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    peer: str
    deadline: float
    received: bytearray = field(default_factory=bytearray)
    answer: memoryview | None = None  # set once the request is read: what is left to send


class _Handler(SimpleHandler):
    server_software = "numa-infer"

    def log_exception(self, exc_info: OptExcInfo) -> None:
        log.error("metrics: the answer failed", exc_info=exc_info)


def _plain(status: str, text: str) -> bytes:
    body = text.encode()
    return (f"HTTP/1.0 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


class BoundedHTTPServer:
    """Listens on (host, port) at once; `serve_forever` in one thread answers with `app`."""

    def __init__(self, host: str, port: int, app: WSGIApplication, *, max_connections: int = MAX_CONNECTIONS,
                 read_timeout_s: float = READ_TIMEOUT_S, write_timeout_s: float = WRITE_TIMEOUT_S) -> None:
        self.listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind((host, port))
            self.listener.listen(BACKLOG)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.server_address: tuple[str, int] = self.listener.getsockname()[:2]
        self.app = app
        self.max_connections = max_connections
        self.read_timeout_s, self.write_timeout_s = read_timeout_s, write_timeout_s
        # Oldest first (a dict keeps insertion order): the one to evict is the first.
        self._open: dict[int, _Connection] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._paused_until: float | None = None
        self._starved = False  # accept failed for want of descriptors: said once, not each retry
        self._stopping = False
        self._running = threading.Event()
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        self._running.set()
        try:
            while not self._stopping:
                now = time.monotonic()
                self._expire(now)
                for key, mask in self._selector.select(self._next_wake(now)):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif isinstance(key.data, _Connection):
                        try:
                            self._serve(key.data, mask)
                        except Exception:  # one connection's fault ends that connection, never the endpoint
                            log.exception("metrics: a connection from %s failed", key.data.peer)
                            self._close(key.data)
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop `serve_forever` and wait until it has returned."""
        self._stopping = True
        self._wake_w.send(b"x")
        if self._running.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        for conn in list(self._open.values()):
            self._close(conn)
        self._selector.close()
        for sock in (self.listener, self._wake_r, self._wake_w):
            sock.close()

    def _next_wake(self, now: float) -> float | None:
        deadlines = [c.deadline for c in self._open.values()]
        if self._paused_until is not None:
            deadlines.append(self._paused_until)
        return max(0.0, min(deadlines) - now) if deadlines else None

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._open.values() if c.deadline <= now]:
            self._close(conn)
        if self._paused_until is not None and self._paused_until <= now:
            self._paused_until = None
            self._selector.register(self.listener, selectors.EVENT_READ)

    def _accept(self) -> None:
        # A burst at most as large as the cap per turn: the connections already held are served too.
        for _ in range(self.max_connections):
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                # EMFILE/ENFILE: the listener stays readable; retrying at once would spin a core.
                if not self._starved:
                    log.warning("metrics: cannot accept a connection (%s); trying again every %.1f s",
                                exc.strerror, ACCEPT_PAUSE_S)
                self._starved = True
                self._selector.unregister(self.listener)
                self._paused_until = time.monotonic() + ACCEPT_PAUSE_S
                return
            self._starved = False
            sock.setblocking(False)
            if len(self._open) >= self.max_connections:
                self._close(next(iter(self._open.values())))
            conn = _Connection(sock, str(peer[0]), time.monotonic() + self.read_timeout_s)
            self._open[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _serve(self, conn: _Connection, mask: int) -> None:
        if conn.answer is not None:
            self._send(conn)
            return
        try:
            data = conn.sock.recv(_READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.received += data
        end = conn.received.find(b"\r\n\r\n")
        if end >= 0 and end <= MAX_REQUEST_BYTES:
            self._answer(conn, self._respond(bytes(conn.received[:end]), conn.peer))
        elif len(conn.received) > MAX_REQUEST_BYTES:
            self._answer(conn, _plain("431 Request Header Fields Too Large", "numa-infer: request too large\n"))

    def _answer(self, conn: _Connection, answer: bytes) -> None:
        conn.answer, conn.received = memoryview(answer), bytearray()
        conn.deadline = time.monotonic() + self.write_timeout_s
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._send(conn)  # a scrape's answer usually fits the socket's buffer: done now

    def _send(self, conn: _Connection) -> None:
        assert conn.answer is not None
        try:
            conn.answer = conn.answer[conn.sock.send(conn.answer):]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not conn.answer:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)  # the client reads the whole answer, then EOF
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        self._open.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def _respond(self, head: bytes, peer: str) -> bytes:
        """One request's headers -> the whole answer, through the WSGI app."""
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _plain("400 Bad Request", "numa-infer: not an HTTP request\n")
        method, target, version = parts
        path, _, query = target.partition("?")
        environ = {"REQUEST_METHOD": method, "PATH_INFO": unquote(path, "latin-1"), "QUERY_STRING": query,
                   "SCRIPT_NAME": "", "SERVER_PROTOCOL": version, "SERVER_NAME": str(self.server_address[0]),
                   "SERVER_PORT": str(self.server_address[1]), "REMOTE_ADDR": peer}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if sep:
                environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
        out = io.BytesIO()
        handler = _Handler(io.BytesIO(), out, io.StringIO(), environ, multithread=False)
        handler.os_environ = {}  # wsgiref starts from the daemon's environment, no part of a request's
        try:
            handler.run(self.app)
        except Exception:  # the app failed, and so did the error page: never the loop
            log.exception("metrics: the answer failed")
            return _plain("500 Internal Server Error", "numa-infer: the metrics could not be made\n")
        return out.getvalue()
