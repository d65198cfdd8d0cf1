"""A client that left before its answer is its tenant's "left before the answer", never
the 502 HAProxy logs for a stream the daemon ended (frontdoor/request_log.py): an alert on
5xx must not fire because users gave up.

The daemon's own front door code over a real HAProxy with one tenant, and stand-in
instances that never finish a POST: a non-streaming one gets nothing, a stream gets an
event every 0.2 s until the front door closes the connection.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from numad_infer.config.apikey import read_tenant_keys
from numad_infer.frontdoor.abandoned import parse_sessions
from tests.daemon_harness import wait_for
from tests.frontdoor.harness import Door, with_haproxy
from tests.frontdoor.silent_instance import SilentInstance

KEY = "team-a-" + "a" * 40


def test_status_and_metrics_show_the_requests_whose_client_left_apart() -> None:
    from numad_infer.cli.present import _tenant_line
    from numad_infer.status.metrics import _tenant_metrics
    from numad_infer.status.records import TenantStatus

    shown = (TenantStatus("team-a", answers={"200": 4}, left=2), TenantStatus("team-b", left=1))
    assert _tenant_line(shown[0]) == ("  tenant team-a: answers since the daemon started: 200 x4; 2 left before the "
                                      "answer")
    assert _tenant_line(shown[1]) == "  tenant team-b: answers since the daemon started: none; 1 left before the answer"
    families = {f.name: f for f in _tenant_metrics(shown)}
    assert [(s.labels, s.value) for s in families["numa_infer_tenant_requests"].samples if s.name.endswith("_total")] \
        == [({"tenant": "team-a", "code": "200"}, 4), ({"tenant": "team-a", "code": "client_left"}, 2),
            ({"tenant": "team-b", "code": "client_left"}, 1)]


@pytest.fixture
def door(tmp_path: Path) -> Iterator[tuple[Door, list[SilentInstance], list[str]]]:
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    (keys / "a").write_text(KEY + "\n")
    (keys / "a").chmod(0o600)
    os.chmod(tmp_path, 0o755)
    made = Door(tmp_path, server="parallel = 1\n",
                extra=f'[[tenants]]\nname = "team-a"\nkey_file = "{keys / "a"}"\n')
    instances = [SilentInstance(i.port) for i in made.plan.instances]
    # The lines as HAProxy sent them, for a failure's message.
    lines: list[str] = []
    timings = made.door.requests.timings
    record = timings.record
    timings.record = lambda line: lines.append(line) or record(line)  # type: ignore[method-assign]
    assert made.apply(read_tenant_keys(made.config, "test.toml"))
    api = made.door.api
    wait_for(lambda: all(s.status == "UP" for b in made.door.backends.values()
                         for s in api.backend(b).instances.values()), f"every server UP\n{made.log()}")
    yield made, instances, lines
    made.stop()
    for instance in instances:
        instance.close()


def _ask(port: int, stream: bool) -> socket.socket:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 1800, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


@with_haproxy
def test_a_client_that_left_is_counted_as_left_not_as_a_502(door) -> None:
    front, instances, lines = door
    timings = front.door.requests.timings
    # Non-streaming: the client leaves, and its stream is ended as the daemon's watch ends
    # one (abandon_watch.py: `shutdown session`), done here so that only the log is tested.
    sock = _ask(front.port, stream=False)
    client = sock.getsockname()[1]
    wait_for(lambda: sum(i.posts for i in instances) == 1, "the request at an instance")
    sock.close()
    streams = [s for s in parse_sessions(front.door.api.command("show sess")) if s.client[1] == client]
    assert len(streams) == 1, streams
    assert front.door.api.command(f"shutdown session {streams[0].id}").strip() == ""
    wait_for(lambda: "team-a" in timings.tenants() and timings.tenants()["team-a"].left == 1,
             "the non-streaming request counted as left", timeout_s=15, detail=lambda: "\n".join(lines))
    assert "/K" in lines[-1], lines  # HAProxy's own word: killed by an admin
    # Streaming: HAProxy's next write to the gone client fails.
    sock = _ask(front.port, stream=True)
    wait_for(lambda: b"data: " in sock.recv(65536), "the stream's first event")
    sock.close()
    wait_for(lambda: timings.tenants()["team-a"].left == 2, "the stream counted as left", timeout_s=15,
             detail=lambda: "\n".join(lines))
    assert "/C" in lines[-1], lines  # the client aborted
    used = timings.tenants()["team-a"]
    assert used.answers == {}, lines  # no 502, nor the stream's 200
    print("\n".join(lines))
