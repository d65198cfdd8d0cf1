"""What a tenant or a client without a key can reach through the front door, over a real
HAProxy with the daemon's own front-door code and echoing stand-ins for the instances:
only the inference API (api_paths.py), with exactly one `Authorization: Bearer KEY`
(tenants.py), and idle connections that hold the door for header_timeout_s at most."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path

from numad_infer.frontdoor import api_paths
from tests.frontdoor.harness import with_haproxy
from tests.frontdoor.tenant_door import INSTANCE_KEY, KEY_A, key_file, post

_BODY = json.dumps({"model": "alpha", "messages": [{"role": "user", "content": "hi"}]})


def raw(port: int, request: str, source: str = "127.0.0.1", timeout: float = 30,
        close_wait_s: float = 0.5) -> tuple[int, dict, bool]:
    """Send one request as written; its status, JSON body, and whether HAProxy closed the
    connection within `close_wait_s` after the answer (0: not looked at)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0)) as sock:
        sock.sendall(request.encode())
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(body) < length:
            body += sock.recv(65536)
        if not close_wait_s:
            return int(head.split()[1]), json.loads(body), False
        sock.settimeout(close_wait_s)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
        return int(head.split()[1]), json.loads(body), closed


def request(method: str, path: str, key: str | None = KEY_A, more: str = "", body: str = _BODY) -> str:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}{more}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}")


@with_haproxy
def test_a_tenant_reaches_the_inference_api_and_nothing_else(door_with, keys_dir: Path) -> None:
    key_file(keys_dir, "instance", INSTANCE_KEY)
    door = door_with(server=f'api_key_file = "{keys_dir / "instance"}"\n')
    # The management paths, as llama-server names them, and ways around an exact match.
    sneaky = ["/v1//chat/completions", "//slots", "/v1/../slots", "/slots%2F0", "/v1/chat/completions/",
              "/SLOTS", "/v1/chat/completions/../../slots", "/", "/index.html"]
    for path in [*api_paths.NEVER, "/slots/0?action=erase", "/slots/0?action=save", *sneaky]:
        for method in ("GET", "POST"):
            status, doc, closed = raw(door.port, request(method, path))
            assert status == 404, (method, path, status, doc)
            assert doc["error"]["type"] == "invalid_request_error" and "no such path" in doc["error"]["message"]
            assert closed, (method, path)
    # Every forwarded path reaches an instance, with the instances' key (the stand-in echoes it).
    for path in [*api_paths.FORWARDED, "/v1/chat/completions?x=1"]:
        status, doc, _ = raw(door.port, request("POST", path), close_wait_s=0)
        assert status == 200 and doc["authorization"] == f"Bearer {INSTANCE_KEY}", (path, status, doc)
    # The tenant's key sent again as X-Api-Key (which llama-server reads too) stays at the door.
    status, doc, _ = raw(door.port, request("POST", "/v1/messages", more=f"X-Api-Key: {KEY_A}\r\n"), close_wait_s=0)
    assert status == 200 and doc["x_api_key"] is None, doc


@with_haproxy
def test_only_one_authorization_header_of_the_form_bearer_key_names_a_tenant(door_with) -> None:
    door = door_with()
    for more in ("Authorization: Basic " + KEY_A + "\r\n",  # a second header, another scheme
                 "Authorization: Bearer " + KEY_A + "\r\n"):  # the same key twice
        status, _, closed = raw(door.port, request("POST", "/v1/chat/completions", "x", more))
        assert status == 401 and closed, more
    for value in (f"Bearer {KEY_A} junk", f"Bearer  {KEY_A}", f"Basic {KEY_A}", f"Bearer{KEY_A}", KEY_A,
                  f"Bearer {KEY_A},x"):
        status, _, _ = raw(door.port, request("POST", "/v1/chat/completions", None, f"Authorization: {value}\r\n"),
                           close_wait_s=0)
        assert status == 401, value
    for value in (f"Bearer {KEY_A}", f"bearer {KEY_A}", f"BEARER {KEY_A}"):
        status, doc, closed = raw(door.port, request("POST", "/v1/chat/completions", None,
                                                     f"Authorization: {value}\r\n"))
        assert status == 200 and not closed, (value, doc)


def _maxconn(door) -> int:
    text = door.door.paths.config.read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("    maxconn ")))


@with_haproxy
def test_connections_that_send_nothing_hold_the_door_for_header_timeout_s_at_most(door_with) -> None:
    door = door_with(frontend="queue_size = 1\n[tuning]\nheader_timeout_s = 1\n")
    idle = []
    try:
        # Every connection HAProxy takes, and more waiting in the kernel's queue behind them.
        for _ in range(_maxconn(door) + 20):
            idle.append(socket.create_connection(("127.0.0.1", door.port), timeout=5))
        started = time.monotonic()
        assert post(door.port, KEY_A).status == 200
        waited = time.monotonic() - started
        # Before header_timeout_s existed, 30 s (HAProxy's `timeout http-request`).
        assert waited < 2.5, waited
    finally:
        for sock in idle:
            sock.close()


@with_haproxy
def test_connections_per_source_caps_one_address_and_not_the_others(door_with) -> None:
    door = door_with(frontend="connections_per_source = 8\n")
    held = [socket.create_connection(("127.0.0.1", door.port), timeout=5, source_address=("127.0.0.2", 0))
            for _ in range(8)]
    try:
        refused = socket.create_connection(("127.0.0.1", door.port), timeout=5, source_address=("127.0.0.2", 0))
        answer = b""
        # Closed or reset without an answer: HAProxy may reset it before the request is sent.
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            refused.sendall(request("POST", "/v1/chat/completions").encode())
            answer = refused.recv(100)
        refused.close()
        assert answer == b"", answer
        status, _, _ = raw(door.port, request("POST", "/v1/chat/completions"), source="127.0.0.3")
        assert status == 200
    finally:
        for sock in held:
            sock.close()
