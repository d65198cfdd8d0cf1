"""`python -m llama_cpp.server` with a relay in front of it, in the same process, that can
make the liveness route drip: bench/chaos.py's "drip-instance" fault.

    PYTHON drip_relay.py FLAG_DIR LIVENESS_PATH DRIP_EVERY_S <llama_cpp.server's arguments>

bench/chaos.py runs its instances through a `server.python` wrapper that starts this file
where the daemon asks for `-m llama_cpp.server` (and the real interpreter for everything
else: the daemon's own checks).

Why a relay, and why in the server's own process:
- the daemon probes an instance only while the instance's own process (or a child of it)
  listens on the instance's port (numad_infer/host/portowner.py): a stranger on the port is
  never probed, so it cannot stand in for a dripping instance;
- uvicorn (FastAPI) writes a response's status line and headers in one go, so no route of
  the app can drip them a byte at a time, which is what defeats a timeout per receive.

So the process is the real llama-cpp-python server: uvicorn listens on a private unix
socket, and a thread of the same process listens on the instance's port, once uvicorn is
up (as llama_cpp.server itself does: after the model is loaded), and relays every
connection to uvicorn byte for byte. While FLAG_DIR/drip-<port> exists, a GET of the
liveness route (the daemon's probe, HAProxy's health check) is answered by the relay
instead: a status line, then a header one byte every DRIP_EVERY_S, never the blank line.
When the flag goes, those connections end unanswered and the next probe is relayed.

What the relay changes for the rest of the soak: every byte is copied once more, by a
thread of the instance's own process, which is pinned, re-pinned, stopped and killed with
it; uvicorn listens on a unix socket, not on the port. The process, its threads, its
memory and its port are the instance's as before, so the soak's placement check still
reads every thread that serves. A stop is uvicorn's as before: at SIGTERM the port stops
taking connections at once (the relay closes it when uvicorn closes its own socket), the
answers under way are finished and passed on, then the process exits.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import runpy
import socket
import sys
import tempfile
import threading
import time
from typing import Any

HEAD_CAP = 8192  # a request line is all the relay reads before it decides
STOP_WAIT_S = 10.0  # at a stop, how long relayed answers may take to reach their clients


def main() -> None:
    flag_dir, liveness, every = sys.argv[1], sys.argv[2], float(sys.argv[3])
    args = sys.argv[4:]
    port = int(args[args.index("--port") + 1])
    flag = os.path.join(flag_dir, f"drip-{port}")
    import uvicorn  # llama_cpp.server's own; its __main__ calls uvicorn.run at run time

    real_run, real_shutdown = uvicorn.run, uvicorn.Server.shutdown

    def run(app: Any, host: str, port: int, **kwargs: Any) -> None:
        upstream = os.path.join(tempfile.mkdtemp(prefix="numa-infer-relay-"), "uvicorn.sock")
        relay = Relay(host, port, upstream, flag, liveness, every)

        async def shutdown(self: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
            # uvicorn stops accepting first, then finishes what it has: so does the port. A
            # connection refused is one HAProxy sends elsewhere (retry-on conn-failure).
            relay.close()
            await real_shutdown(self, sockets)

        uvicorn.Server.shutdown = shutdown  # type: ignore[method-assign]
        threading.Thread(target=relay.serve, daemon=True).start()
        real_run(app, uds=upstream, **kwargs)
        # uvicorn has sent its last answers; the relay's threads end with the process, so
        # let them pass those answers on first.
        relay.wait_idle(STOP_WAIT_S)

    uvicorn.run = run  # type: ignore[assignment]
    sys.argv = [sys.argv[0], *args]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


class Relay:
    def __init__(self, host: str, port: int, upstream: str, flag: str, liveness: str, every: float) -> None:
        self.host, self.port, self.upstream = host, port, upstream
        self.flag, self.liveness, self.every = flag, liveness, every
        self.listener: socket.socket | None = None
        self.closed = False
        self.relaying = 0  # connections being relayed to uvicorn (not the dripping ones)
        self.lock = threading.Condition()

    def serve(self) -> None:
        # The port is free until uvicorn answers, as it is while llama_cpp.server loads its model.
        while not _answers(self.upstream):
            time.sleep(0.05)
        with self.lock:
            if self.closed:
                return
            try:
                self.listener = socket.create_server((self.host, self.port), backlog=64)
            except OSError as exc:  # what llama_cpp.server does when the port is taken: exit
                print(f"drip_relay: cannot listen on {self.host}:{self.port}: {exc}", file=sys.stderr, flush=True)
                os._exit(1)
        print(f"drip_relay: {self.host}:{self.port} -> {self.upstream}; drips {self.liveness} while {self.flag} "
              "exists", file=sys.stderr, flush=True)
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed: the server is stopping
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            if self.listener is not None:
                with contextlib.suppress(OSError):
                    self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept()
                self.listener.close()

    def wait_idle(self, timeout_s: float) -> None:
        with self.lock:
            self.lock.wait_for(lambda: self.relaying == 0, timeout_s)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            try:
                conn.settimeout(30.0)
                while b"\r\n" not in head and len(head) < HEAD_CAP:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                method, _, rest = head.partition(b" ")
                path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
                if method == b"GET" and path == self.liveness.encode() and os.path.exists(self.flag):
                    _drip(conn, self.flag, self.every)
                    return
                conn.settimeout(None)
                with self.lock:
                    self.relaying += 1
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as up:
                        up.connect(self.upstream)
                        up.sendall(head)
                        back = threading.Thread(target=_pump, args=(up, conn), daemon=True)
                        back.start()
                        _pump(conn, up)
                        back.join()
                finally:
                    with self.lock:
                        self.relaying -= 1
                        self.lock.notify_all()
            except OSError:
                pass  # the client or uvicorn went away: so does the connection


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """src -> dst until src's end; then dst's write side ends too. A broken one ends both."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _drip(conn: socket.socket, flag: str, every: float) -> None:
    """A status line, then a header one byte every `every` seconds, while the flag is there.
    `every` is under the prober's timeout: a timeout per receive would never fire."""
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    for byte in itertools.cycle(b"X-Drip: 1\r\n"):
        time.sleep(every)
        if not os.path.exists(flag):
            return
        conn.sendall(bytes([byte]))


if __name__ == "__main__":
    main()
