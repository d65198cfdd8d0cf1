"""One call to a peer over a stream socket: one deadline for all of it, a cap on what it reads.

The peers the daemon asks (an instance's HTTP port, HAProxy's admin socket) run as other
users, and either may be hostile: a compromised instance, or the front door's user, which
owns the directory admin.sock is in. A timeout per receive (http.client's, a socket's)
bounds nothing against a peer that sends one byte just before each one runs out: it holds
the call for as long as it likes, and the daemon's pass, and its watchdog ping, with it.
So here the deadline is for the whole call (connect, send, every receive), recomputed
from a monotonic clock before each step, and every answer has a cap that stops the
reading as soon as it is passed, before the rest is read, not after.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from numad_infer.errors import NumaInferError

# A status line and headers longer than this are no server of ours: llama-server's and
# uvicorn's are a few hundred bytes.
HEAD_CAP = 16 << 10
_CHUNK = 64 << 10  # the most one receive asks for


class PeerError(NumaInferError):
    """The peer answered wrongly, too much or too late (an OSError is raised as it is)."""


class NoAnswer(PeerError):
    """The deadline passed before the whole answer was in."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no answer within {seconds:g}s")


class TooLarge(PeerError):
    """The answer is longer than its cap: refused, and what follows is never read."""


class BadAnswer(PeerError):
    """Not an answer of the protocol asked (a broken status line, header or chunk)."""


class Deadline:
    """A moment on the monotonic clock by which the call is over, whatever the peer does."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        self.at = clock() + seconds

    def remaining(self) -> float:
        return self.at - self.clock()

    def arm(self, sock: socket.socket) -> None:
        """The next blocking step on `sock` may take what is left, and no more."""
        left = self.remaining()
        if left <= 0:
            raise NoAnswer(self.seconds)
        sock.settimeout(left)


class _Reader:
    """Reads from `sock` into a buffer, each receive armed with the deadline; at most `limit`
    bytes in all (one more and TooLarge is raised)."""

    def __init__(self, sock: socket.socket, deadline: Deadline, limit: int, refusal: str) -> None:
        self.sock, self.deadline = sock, deadline
        self.limit, self.refusal = limit, refusal  # the cap, and what passing it is called
        self.buf = bytearray()
        self.received = 0  # bytes taken from the socket, kept or consumed

    def fill(self) -> bool:
        """One receive; False at the end of the stream."""
        self.deadline.arm(self.sock)
        try:
            # Never more than one byte past the cap: a huge answer is refused having read
            # only that much of it.
            data = self.sock.recv(max(1, min(_CHUNK, self.limit - self.received + 1)))
        except TimeoutError:
            raise NoAnswer(self.deadline.seconds) from None
        if not data:
            return False
        self.received += len(data)
        if self.received > self.limit:
            raise TooLarge(self.refusal)
        self.buf += data
        return True

    def line(self, cap: int) -> bytes:
        """One line, without its CRLF; at most `cap` bytes long."""
        while (end := self.buf.find(b"\n", 0, cap + 1)) < 0:
            if len(self.buf) > cap:
                raise BadAnswer(f"a line longer than {_size(cap)}")
            if not self.fill():
                raise BadAnswer("closed in the middle of a line")
        line = bytes(self.buf[:end]).rstrip(b"\r")
        del self.buf[:end + 1]
        return line

    def exact(self, count: int) -> bytes:
        while len(self.buf) < count:
            if not self.fill():
                raise BadAnswer(f"closed {count - len(self.buf)} byte(s) short")
        data = bytes(self.buf[:count])
        del self.buf[:count]
        return data

    def to_end(self) -> bytes:
        while self.fill():
            pass
        data = bytes(self.buf)
        self.buf.clear()
        return data


def _size(count: int) -> str:
    for shift, unit in ((20, "MiB"), (10, "KiB")):
        if count >= 1 << shift and not count % (1 << shift):
            return f"{count >> shift} {unit}"
    return f"{count} bytes"


def _connect(family: socket.AddressFamily, address: str | tuple[str, int], deadline: Deadline) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        deadline.arm(sock)
        sock.connect(address)
    except TimeoutError:
        sock.close()
        raise NoAnswer(deadline.seconds) from None
    except BaseException:
        sock.close()
        raise
    return sock


def _send(sock: socket.socket, data: bytes, deadline: Deadline) -> None:
    deadline.arm(sock)  # sendall's timeout bounds all of it, not each send (Python >= 3.5)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise NoAnswer(deadline.seconds) from None


def exchange(path: str, request: bytes, deadline_s: float, cap: int) -> bytes:
    """A line protocol on a UNIX socket (HAProxy's runtime API): send `request`, read the
    answer until the peer closes; within `deadline_s` in all and at most `cap` bytes."""
    deadline = Deadline(deadline_s)
    with _connect(socket.AF_UNIX, path, deadline) as sock:
        _send(sock, request, deadline)
        return _Reader(sock, deadline, cap, f"an answer longer than {_size(cap)}").to_end()


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: bytes  # empty when the body was not asked for


def http_get(host: str, port: int, path: str, headers: Mapping[str, str], deadline_s: float,
             body_cap: int | None) -> HttpAnswer:
    """`GET path` from an IP address `host`; the status and, when `body_cap` is not None, the
    body (at most `body_cap` bytes). The status line and headers: at most HEAD_CAP bytes.
    Raises PeerError (NoAnswer past the deadline), or OSError where it cannot connect."""
    return _http("GET", host, port, path, headers, deadline_s, body_cap, None)


def http_post_json(host: str, port: int, path: str, headers: Mapping[str, str], deadline_s: float,
                   body_cap: int, document: object) -> HttpAnswer:
    """`POST path` with `document` as its JSON body; otherwise as http_get."""
    return _http("POST", host, port, path, headers, deadline_s, body_cap, json.dumps(document).encode())


def _http(method: str, host: str, port: int, path: str, headers: Mapping[str, str], deadline_s: float,
          body_cap: int | None, body: bytes | None) -> HttpAnswer:
    deadline = Deadline(deadline_s)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
             *(f"{name}: {value}" for name, value in headers.items())]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    with _connect(family, (host, port), deadline) as sock:
        _send(sock, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b""), deadline)
        # One receive may run past the headers into the body: room for it, not more.
        reader = _Reader(sock, deadline, HEAD_CAP + _CHUNK, f"headers longer than {_size(HEAD_CAP)}")
        status, fields = _head(reader)
        if body_cap is None:
            return HttpAnswer(status, b"")
        return HttpAnswer(status, _body(reader, fields, body_cap))


def _head(reader: _Reader) -> tuple[int, dict[str, str]]:
    """The status code and the header fields (names in lower case), HEAD_CAP bytes in all."""
    words = reader.line(HEAD_CAP).split(None, 2)
    if len(words) < 2 or not words[0].startswith(b"HTTP/1.") or not (words[1].isdigit() and len(words[1]) == 3):
        raise BadAnswer("not an HTTP status line")
    fields: dict[str, str] = {}
    while line := reader.line(HEAD_CAP):
        if reader.received - len(reader.buf) > HEAD_CAP:
            raise TooLarge(f"headers longer than {_size(HEAD_CAP)}")
        name, colon, value = line.partition(b":")
        if not colon:
            raise BadAnswer("a header line without a colon")
        fields[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return int(words[1]), fields


def _body(reader: _Reader, fields: Mapping[str, str], cap: int) -> bytes:
    chunked = "chunked" in fields.get("transfer-encoding", "").lower()
    head = reader.received - len(reader.buf)  # what is still buffered is body already
    # Chunked, the framing (sizes, CRLFs) is read too: room for it besides the body.
    reader.limit = head + (2 * cap + HEAD_CAP if chunked else cap)
    reader.refusal = f"a body longer than {_size(cap)}"
    if reader.received > reader.limit:
        raise TooLarge(reader.refusal)
    if chunked:
        return _chunked(reader, cap)
    length = fields.get("content-length")
    if length is None:
        return reader.to_end()  # the end of the body is the end of the connection
    if not length.isdigit():
        raise BadAnswer(f"Content-Length: {length[:40]!r}")
    if int(length) > cap:  # refused on its word, before any of it is read
        raise TooLarge(f"a body longer than {_size(cap)} (Content-Length: {length})")
    return reader.exact(int(length))


def _chunked(reader: _Reader, cap: int) -> bytes:
    body = bytearray()
    while True:
        size_text = reader.line(1024).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadAnswer("a chunk without its size") from None
        if size == 0:
            while reader.line(HEAD_CAP):  # the trailer, if any
                pass
            return bytes(body)
        if len(body) + size > cap:
            raise TooLarge(reader.refusal)
        body += reader.exact(size)
        if reader.line(2):  # each chunk ends with a CRLF, right after its `size` bytes
            raise BadAnswer("a chunk longer than its size")
