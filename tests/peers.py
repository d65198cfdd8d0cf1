"""Hostile peers on real sockets, each run by threads: what a compromised instance or the
front door's user (who owns admin.sock's directory) can put where the daemon connects.

- `drip`: sends a prefix, then one byte every `every_s`, forever (until the client goes);
- `flood`: sends a prefix, then `size` bytes as fast as the client takes them;
- `answer`: a well-behaved peer (a fixed answer, then close).

`Peer` serves one of them on a TCP port of 127.0.0.1 or on a UNIX socket, every
connection in its own thread, and counts connections and bytes sent.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

Serve = Callable[[socket.socket, bytes, "Peer"], None]  # the connection, the request, the peer


class Peer:
    def __init__(self, serve: Serve, port: int = 0, unix_path: Path | None = None) -> None:
        self.serve = serve
        self.connections = 0
        self.sent = 0
        self.finished = 0  # connections it is done with (it answered, or the client closed)
        self.requests: list[bytes] = []
        self.stopped = threading.Event()
        if unix_path is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(str(unix_path))
        else:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1] if unix_path is None else 0
        self.sock.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(2.0)
            try:
                request = conn.recv(4096)  # one receive is all of a request here
                self.requests.append(request)
                self.serve(conn, request, self)
            except OSError:
                pass  # the client gave up and closed: what these peers are for
        self.finished += 1

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self.stopped.set()
        self.sock.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drip(prefix: bytes, each: bytes, every_s: float = 0.05) -> Serve:
    """`prefix`, then the bytes of `each` over and over, one every `every_s`."""
    def serve(conn: socket.socket, request: bytes, peer: Peer) -> None:
        peer.send(conn, prefix)
        for byte in itertools.cycle(each):
            if peer.stopped.wait(every_s):
                return
            peer.send(conn, bytes([byte]))
    return serve


def flood(prefix: bytes, size: int) -> Serve:
    """`prefix`, then `size` bytes, as fast as the client reads them."""
    block = b"x" * (64 << 10)

    def serve(conn: socket.socket, request: bytes, peer: Peer) -> None:
        peer.send(conn, prefix)
        left = size
        while left > 0 and not peer.stopped.is_set():
            peer.send(conn, block[:left])
            left -= len(block)
    return serve


def answer(by_request: Callable[[bytes], bytes]) -> Serve:
    """A well-behaved peer: the answer to the request it got, then the end of the stream."""
    def serve(conn: socket.socket, request: bytes, peer: Peer) -> None:
        peer.send(conn, by_request(request))
    return serve


def http(status: int, body: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, len(body), body)


# A status line and a header, then header lines one byte at a time: never the blank line.
HEADER_DRIP = (b"HTTP/1.1 200 OK\r\n", b"X-Drip: 1\r\n")
# The headers whole, then the body one byte at a time: never all of it.
BODY_DRIP = (b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n", b"1")


def timed(call: Callable[[], object]) -> tuple[object, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started
