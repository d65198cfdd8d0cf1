"""A client that leaves stops the work done for it (issue 39, part 4): on a CPU an answer
nobody waits for still burns the cores. The real daemon (process backend), real HAProxy, a
real llama-server on the generated "medium" model (one token takes tens of milliseconds on
one CPU, so the answer asked for would take a minute or more), loopback only.

What frees the slot of a stream: HAProxy's next write to the gone client fails, it closes its
side towards the instance, and llama-server stops a task whose connection is closed. A
non-streaming request is not freed so by HAProxy 2.6 (it reads nothing more from a client
whose request is whole, and learns of the close only when the answer comes; `option
abortonclose` changes nothing): the daemon's watch sees the client's half-closed connection
and ends the request (frontdoor/abandoned.py), and llama-server stops it the same way."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from numad_infer.engines import slot_cache
from tests.daemon_harness import DaemonRun, daemons, door_settled, generated_model

# More than a minute of decoding here (the context is 2048 tokens); end-of-sequence ignored.
ASKED_TOKENS = 1800
LEAVE_AFTER_S = 1.0
# Freed at once in the measurements (docs/frontdoor.md); this bound is for a loaded machine,
# far below the minute the answer would have taken.
FREED_WITHIN_S = 15.0
# How long a request may take to reach its slot on a loaded machine (CI runs a VM guest
# beside the tests): the client stays until it has.
REACHED_WITHIN_S = 30.0


@pytest.fixture
def run(tmp_path: Path):
    with daemons(tmp_path, generated_model("medium")) as start:
        yield start(engine="llama-server", placement="nodes = [0]", context_size=2048)


def _processing(run: DaemonRun, port: int) -> bool | None:
    found = slot_cache.slots("127.0.0.1", port, None, 5.0)
    return None if found is None else any(s.get("is_processing") is True for s in found)


def ask_then_leave(port: int, stream: bool, tokens: int = ASKED_TOKENS, leave_after_s: float = LEAVE_AFTER_S,
                   reached: Callable[[], bool | None] | None = None, poll_s: float = 0.1) -> None:
    """A request sent over a raw socket, closed `leave_after_s` later without reading the
    answer (a client's timeout, a closed browser tab). bench/abandoned.py sends the same.
    `reached`: and not before it says the request is at a slot (read every `poll_s`), so
    that a loaded machine's slow start is not mistaken for a slot already freed."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True,
                       "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(leave_after_s)
        deadline = time.monotonic() + REACHED_WITHIN_S
        while reached is not None and not reached():
            assert time.monotonic() < deadline, "the request never reached a slot"
            time.sleep(poll_s)


def _freed_after_leaving(run: DaemonRun, stream: bool, poll_s: float) -> float:
    """Seconds from the client leaving until the instance's slot is free, read every `poll_s`."""
    state = run.wait(lambda s: len(s["instances"]) == 1 and s["instances"][0]["state"] == "healthy"
                     and s["instances"][0].get("rotation") == "UP" and door_settled(s, required=True),
                     120, "one instance in rotation")
    port = run.instance(state, "infer@0")["port"]
    ask_then_leave(run.frontend_port, stream, reached=lambda: _processing(run, port), poll_s=poll_s)
    left = time.monotonic()
    while _processing(run, port) is not False:
        took = time.monotonic() - left
        assert took < FREED_WITHIN_S, f"the slot still generates {took:.1f}s after the client left"
        time.sleep(poll_s)
    return time.monotonic() - left


def test_a_client_that_leaves_a_stream_frees_its_slot(run: DaemonRun) -> None:
    print(f"streaming: slot free {_freed_after_leaving(run, True, 0.1):.2f}s after the client left")


@pytest.fixture
def quiet_run(tmp_path: Path):
    """The daemon's own pass every 5 s (its default), not the harness's 0.5 s: its read of
    /slots and /metrics each pass is a result on the engine's queue too (see below)."""
    with daemons(tmp_path, generated_model("medium")) as start:
        yield start(engine="llama-server", placement="nodes = [0]", context_size=2048, interval_s=5.0)


def test_a_client_that_leaves_a_non_streaming_request_frees_its_slot(quiet_run: DaemonRun) -> None:
    """HAProxy 2.6 alone keeps the slot generating to the last token (docs/frontdoor.md): the
    daemon's watch (frontdoor/abandon_watch.py) ends the request, and the engine stops.

    llama-server looks at a closed connection of a non-streaming request only after a second
    in which no result of any task reached its result queue: a read of /slots or /metrics,
    or a token of another stream, starts that second again (server-queue.cpp,
    recv_with_timeout). So this test reads /slots every 1.5 s, not faster."""
    run = quiet_run
    print(f"non-streaming: slot free {_freed_after_leaving(run, False, 1.5):.2f}s after the client left")
    shown = run.wait(lambda s: sum(s["frontdoor"]["abandoned"].values()) == 1, 20, "the stop counted in status")
    assert list(shown["frontdoor"]["abandoned"].values()) == [1]  # one model
    assert "1 client(s) left before their answer: stopped" in run.logs()
    assert "1 stopped as their client left" in run.cli("status").stdout
