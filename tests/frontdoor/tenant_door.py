"""What the tenants' front-door tests share: keys, echoing stand-ins for the instances
that answer with the Authorization header they got, and a client."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

KEY_A = "team-a-" + "a" * 40
KEY_B = "team-b-" + "b" * 40
INSTANCE_KEY = "instance-" + "c" * 40
TWO_MODELS = ('[[models]]\nname = "alpha"\npath = "/a.gguf"\nnodes = [0]\n'
              '[[models]]\nname = "beta"\npath = "/b.gguf"\nnodes = [1]\n')
SLOW = "please-answer-late"
STREAM_GAP_S = 1.0
LONG_STREAM = 3000  # events sent at once after the first (~300 KiB)


class Echo(BaseHTTPRequestHandler):
    """An instance's stand-in: 200 to the health check; a POST gets back the Authorization
    header that reached it (after SLOW in the body: 2 s later)."""

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer({"ok": True})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if SLOW.encode() in body:
            time.sleep(2)
        usage = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}  # as llama-server reports them
        if b'"stream": true' in body:  # as llama-server streams: the counts in the last event
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            # Its `timings` always; `usage` too when the client asked for it. A text that looks
            # like a count, as a model could write it (escaped inside its string), counts not.
            last = {"choices": [], "timings": {"cache_n": 5, "prompt_n": 2, "predicted_n": 4}}
            if b'"include_usage": true' in body:
                last = {**last, "usage": usage}
            first = {"choices": [{"delta": {"content": 'say "prompt_tokens":900 and "predicted_n":900'}}]}
            self.wfile.write(f"data: {json.dumps(first)}\n\n".encode())
            self.wfile.flush()
            time.sleep(STREAM_GAP_S)  # the first token long before the end
            if b'"long": true' in body:  # a long answer at once: HAProxy reads it in full buffers
                self.wfile.write(f"data: {json.dumps(first)}\n\n".encode() * LONG_STREAM)
            # The last event in two writes, cut inside a number: HAProxy gets two chunks.
            text = f"data: {json.dumps(last)}\n\n".encode()
            cut = text.index(b'"prompt_n": 2') + len(b'"prompt_n": ')
            for part in (text[:cut], text[cut:]):
                self.wfile.write(part)
                self.wfile.flush()
                time.sleep(0.3)
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True
            return
        self._answer({"authorization": self.headers.get("Authorization"), "x_api_key": self.headers.get("X-Api-Key"),
                      "port": self.server.server_port,
                      "usage": usage})


class EchoServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # HAProxy's health checks close without reading the answer


@dataclass
class Reply:
    status: int
    headers: Message  # names case-insensitive (HAProxy sends its own in lower case)
    body: dict


def post(port: int, key: str | None, model: str = "alpha", content: str = "hi", more: dict | None = None) -> Reply:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(more or {})}
    data = json.dumps({"model": model, "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return Reply(response.status, response.headers, json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.headers, json.loads(exc.read()))


def key_file(directory: Path, name: str, key: str) -> Path:
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / name
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


def tenant_tables(keys_dir: Path, a: str = "", b: str = "") -> str:
    return (f'[[tenants]]\nname = "team-a"\nkey_file = "{keys_dir / "a"}"\n{a}'
            f'[[tenants]]\nname = "team-b"\nkey_file = "{keys_dir / "b"}"\n{b}')
