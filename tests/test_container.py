"""What a container needs from the daemon (issue 18, section 2), on the process backend:

- `--instance-logs stdout`: each child's own output on the daemon's stdout, named;
- SIGTERM: the front door refuses new work at once, the requests in flight finish, then
  the instances and HAProxy stop and the daemon exits 0 within `defaults.stop_bound_s`;
- every bad mount (model, config, state directory) is one line on stderr and a non-zero exit.

Real daemon, real llama-server, real HAProxy (tests/daemon_harness.py).
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from numad_infer.defaults import stop_bound_s
from tests.daemon_harness import DaemonRun, daemons, generated_model

DRAIN_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def slow_model() -> Path:
    return generated_model("medium")  # tens of milliseconds a token: a stream lasts seconds


@dataclass
class Stream:
    """One streaming completion as the client saw it."""

    tokens: int = 0
    finish_reason: str | None = None
    error: str = ""


def stream_completion(port: int, max_tokens: int, first_token: threading.Event, out: Stream) -> None:
    body = json.dumps({"prompt": "hello", "max_tokens": max_tokens, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                out.tokens += 1 if choice.get("text") else 0
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
                first_token.set()
    except (OSError, ValueError, KeyError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    first_token.set()


def in_rotation(run: DaemonRun) -> None:
    run.wait(lambda s: (s.get("frontdoor") or {}).get("up") and len(s["instances"]) == 2
             and all(i["state"] == "healthy" and i.get("rotation") == "UP" for i in s["instances"]),
             120, "2 healthy instances in rotation")


def test_sigterm_finishes_the_stream_in_flight_refuses_new_work_and_exits_0_within_the_bound(
        tmp_path: Path, slow_model: Path) -> None:
    with daemons(tmp_path, slow_model) as start:
        run = start(engine="llama-server",
                    frontend=f'listen = "127.0.0.1:{{port}}"\ndrain_timeout_s = {DRAIN_TIMEOUT_S}\n')
        in_rotation(run)
        children = psutil.Process(run.proc.pid).children(recursive=True)
        assert {"llama-server", "haproxy"} <= {c.name() for c in children}
        first_token, stream = threading.Event(), Stream()
        client = threading.Thread(target=stream_completion, args=(run.frontend_port, 80, first_token, stream))
        client.start()
        assert first_token.wait(60) and not stream.error, stream.error
        signalled = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the loop wakes on the signal and closes the listener at once
        assert client.is_alive(), "the stream ended too soon to prove the drain waited for it"
        asked = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", run.frontend_port), timeout=5).close()
        assert time.monotonic() - asked < 1.0, "a new request is refused at once, not left hanging"
        client.join(120)
        assert (stream.error, stream.finish_reason) == ("", "length") and stream.tokens >= 70, stream
        code = run.proc.wait(stop_bound_s(DRAIN_TIMEOUT_S))
        took = time.monotonic() - signalled
        assert code == 0, run.logs()
        assert took < stop_bound_s(DRAIN_TIMEOUT_S)
        left = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"left running after the daemon exited: {left}"
        logs = run.logs()
        assert logs.index("front door: listener") < logs.index("front door: drained") < logs.index(
            "stopping 2 instance(s)") < logs.index("front door: stopping haproxy"), logs


def test_instance_logs_stdout_puts_each_childs_own_output_on_the_daemons_stdout_named(
        tmp_path: Path, slow_model: Path) -> None:
    with daemons(tmp_path, slow_model) as start:
        run = start(engine="llama-server", run_args=("--instance-logs", "stdout"))
        in_rotation(run)
        run.log.flush()
        lines = (run.tmp / "daemon.log").read_text().splitlines()  # stdout and stderr
        for name in ("infer@0", "infer@1"):
            own = [line for line in lines if line.startswith(f"{name}: ")]
            # llama-server's own words, not the daemon's log about it.
            assert any("load_model: loading model" in line for line in own), lines[-40:]
        assert any(line.startswith("frontdoor: [NOTICE]") for line in lines), "HAProxy's own lines too"
        assert not list((run.state_file.parent / "logs").glob("*.log")), "nothing is written to log files"
