"""What tests/test_troubleshooting.py uses: the README's troubleshooting table as rows, a
row's cell as patterns, a client of the front door, a stream held open, a llama-server
that loads slowly, and a daemon whose configuration a test edits before it starts."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from tests.daemon_harness import ROOT, DaemonRun

HEADER = "| what you see | likely cause | fix |"


def _cells(line: str) -> list[str]:
    """A Markdown table line's cells; a `|` inside a code span is not a separator."""
    cells, current, code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            code = not code
        if char == "|" and not code:
            cells.append(current.strip())
            current = ""
        else:
            current += char
    return [*cells, current.strip()]


def table(readme: Path = ROOT / "README.md") -> list[dict[str, str]]:
    """The rows of the README's troubleshooting table, each by its header's names."""
    lines = readme.read_text().splitlines()
    start = lines.index(HEADER)
    names = _cells(HEADER)
    rows = []
    for line in lines[start + 2:]:  # after the header and its |---| line
        if not line.startswith("|"):
            break
        cells = _cells(line)
        assert len(cells) == len(names), line
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


def cell_pattern(cell: str) -> list[re.Pattern[str]]:
    """The code spans of a "what you see" cell as patterns, "..." matching any text; a
    leading "`command`: " names the command whose output it is, and is left out."""
    cell = re.sub(r"^`[a-z-]+`: ", "", cell)
    return [re.compile(".*?".join(re.escape(part) for part in span.split("...")))
            for span in re.findall(r"`([^`]+)`", cell)]


def post(port: int, key: str | None, body: dict | bytes, path: str = "/v1/completions",
         content_type: str | None = "application/json") -> tuple[int, dict[str, str], dict]:
    """One request to the front door: (status, headers by lower-case name, JSON body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**({"Content-Type": content_type} if content_type else {}),
               **({"Authorization": f"Bearer {key}"} if key else {})}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", path, body=data, headers=headers)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read() or b"{}")
    finally:
        connection.close()


class LongStream:
    """A streamed completion of up to 2000 tokens (seconds on the "small" model), read as it
    comes until close(): its slot stays busy meanwhile, or it waits in the queue."""

    def __init__(self, port: int, key: str, prompt: str) -> None:
        self.status = 0
        self.events = 0
        self.error = ""
        self._closed = False
        self._sock: socket.socket | None = None
        self._body = json.dumps({"prompt": prompt, "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
        self._headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        self._connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._connection.connect()
            self._sock = self._connection.sock
            if self._closed:
                return
            self._connection.request("POST", "/v1/completions", body=self._body, headers=self._headers)
            response = self._connection.getresponse()
            self.status = response.status
            if self.status != 200:
                self.error = response.read().decode(errors="replace")
                return
            while not self._closed:
                line = response.readline()
                if not line:
                    return
                if line.startswith(b"data: {"):
                    self.events += 1
        except (OSError, ValueError, AttributeError, http.client.HTTPException):
            pass  # closed under it (close() from the test's thread)

    def wait_first_token(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.events == 0:
            assert time.monotonic() < deadline and self._thread.is_alive(), f"no token (status {self.status})"
            time.sleep(0.02)

    def close(self) -> None:
        """Leave, as a client that hangs up does (the front door and llama-server stop it)."""
        self._closed = True
        if self._sock is not None:
            with suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        self._connection.close()
        self._thread.join(10)


def long_stream(port: int, key: str, prompt: str) -> LongStream:
    return LongStream(port, key, prompt)


# A llama-server that loads its model for LOADING seconds, as a big one does: it listens at
# once and answers 503 "Loading model" (llama-server's answer while it loads), then becomes
# the real llama-server, same arguments, same PID.
_LOADER = """
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

loading, real, args = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
port = int(args[args.index("--port") + 1])
host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"


class Loading(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self):
        body = json.dumps({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


server = HTTPServer((host, port), Loading)
server.timeout = 0.1
deadline = time.monotonic() + loading
while time.monotonic() < deadline:
    server.handle_request()
server.server_close()
os.execv(real, [real, *args])
"""


def loading_llama_server(directory: Path, real: Path, python: str, loading_s: float) -> Path:
    """A stand-in for llama-server in `directory` (readable by the servers' user): the real
    one for `check`'s questions (--version, --help, --list-devices), a slow loader before it
    for a start."""
    loader = directory / "slow-loader.py"
    loader.write_text(_LOADER)
    loader.chmod(0o644)
    wrapper = directory / f"slow-llama-server-{loading_s:g}"
    wrapper.write_text(f'#!/bin/sh\ncase "$1" in\n--version|--help|-lv|--list-devices) exec "{real}" "$@" ;;\nesac\n'
                       f'exec "{python}" "{loader}" {loading_s:g} "{real}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


class EditedRun(DaemonRun):
    """A DaemonRun whose configuration file `edit` changes each time it is written, from
    the first (the harness writes its [monitor] keys itself: one of them cannot be set twice)."""

    edit: Callable[[str], str] = staticmethod(lambda text: text)

    def __init__(self, *args: Any, edit: Callable[[str], str] | None = None, **kwargs: Any) -> None:
        if edit is not None:
            self.edit = edit
        super().__init__(*args, **kwargs)

    def write_config(self, placement: str = "", monitor: str = "", extra: str = "") -> None:
        super().write_config(placement, monitor, extra)
        self.config.write_text(self.edit(self.config.read_text()))


@contextmanager
def started(tmp: Path, model: Path, edit: Callable[[str], str], **kwargs: Any) -> Iterator[EditedRun]:
    """An EditedRun, stopped afterwards with every server it started (as daemons() does)."""
    tmp.mkdir(parents=True, exist_ok=True)
    run = EditedRun(tmp, model, edit=edit, **kwargs)
    try:
        yield run
    finally:
        pids = [i["pid"] for i in (run.state() or {"instances": []})["instances"] if i.get("pid")]
        for pid in pids:
            _signal(pid, signal.SIGCONT)
        run.stop()
        for pid in pids:
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, sig)
