"""What a container needs from the daemon, on the process backend:

- `--instance-logs stdout`: each child's own output on the daemon's stdout, named;
- a bad mount (config, model, state directory): one line naming the path and the fix, a
  non-zero exit, no traceback;
- SIGTERM: the front door refuses new work at once, the requests in flight finish, then
  the instances and HAProxy stop and the daemon exits 0 within `defaults.stop_bound_s`.

Real daemon, real llama-server, real HAProxy (tests/daemon_harness.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from numad_infer.config.defaults import stop_bound_s
from tests.daemon_harness import ROOT, DaemonRun, daemons, engine_keys, generated_model, server_python, shared_dir, wait_for

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


def refused(port: int) -> bool:
    """A connection to `port` refused (its listener closed), not accepted."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


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
        # The loop wakes on the signal and closes the listener at once.
        wait_for(lambda: refused(run.frontend_port), "the front door's listener closed", timeout_s=10,
                 detail=run.logs)
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



def test_a_second_sigterm_cuts_the_drain_short(tmp_path: Path, slow_model: Path) -> None:
    with daemons(tmp_path, slow_model) as start:
        # A stream of ~45 s (900 tokens): longer than the instances' stop bound.
        run = start(engine="llama-server", context_size=1024,
                    frontend='listen = "127.0.0.1:{port}"\ndrain_timeout_s = 120\n')
        in_rotation(run)
        first_token, stream = threading.Event(), Stream()
        client = threading.Thread(target=stream_completion, args=(run.frontend_port, 900, first_token, stream))
        client.start()
        assert first_token.wait(60) and not stream.error, stream.error
        run.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: refused(run.frontend_port), "the drain begun (the listener closed)", timeout_s=10,
                 detail=run.logs)
        assert run.proc.poll() is None and client.is_alive(), "draining: waiting for the stream"
        again = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(60) == 0, run.logs()
        # The instances' stop still has its bound (a busy llama-server finishes its request
        # or is killed), not the 120 s drain.
        assert time.monotonic() - again < stop_bound_s(0) + 2
        assert "1 request(s) still running: stopping anyway" in run.logs()
        client.join(30)

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


# -- bad mounts -------------------------------------------------------------------------------------

NOBODY = 65534


@dataclass(frozen=True)
class Mount:
    """One bad mount: the config and state file to run with, as whom, and what the line names."""

    config: Path
    state_file: Path
    names: str  # the path the line must name
    fix: str  # words of the fix the line must give
    uid: int = 0


def _config(path: Path, model: Path) -> Path:
    path.write_text(f'[model]\npath = "{model}"\n[server]\n{engine_keys("llama-server")}[frontend]\nlisten = ""\n')
    path.chmod(0o644)
    return path


def _read_only(directory: Path) -> Path:
    directory.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,mode=0755,size=1m", "none", str(directory)]).returncode:
        pytest.skip("mounting a read-only tmpfs needs root")
    return directory


def bad_mount(case: str, tmp: Path) -> Mount:
    model, state = generated_model("tiny"), tmp / "state" / "state.json"
    good = _config(tmp / "good.toml", model)
    if case == "missing model":
        missing = tmp / "models" / "model.gguf"
        return Mount(_config(tmp / "c.toml", missing), state, str(missing), "put a GGUF model there")
    if case in ("model unreadable", "model directory closed"):
        models = tmp / "models"
        models.mkdir(mode=0o700 if case == "model directory closed" else 0o755)
        copy = models / "model.gguf"
        copy.write_bytes(model.read_bytes())
        copy.chmod(0o600 if case == "model unreadable" else 0o644)
        state.parent.mkdir()
        os.chown(state.parent, NOBODY, NOBODY)
        return Mount(_config(tmp / "c.toml", copy), state, str(copy), "readable by uid 65534", NOBODY)
    if case == "missing config":
        return Mount(tmp / "absent.toml", state, str(tmp / "absent.toml"), "pass --config")
    if case == "config is a directory":
        (tmp / "dir.toml").mkdir()
        return Mount(tmp / "dir.toml", state, str(tmp / "dir.toml"), "mount or copy the TOML file itself there")
    if case == "config unreadable":
        good.chmod(0o600)  # root's, and the daemon runs as nobody
        state.parent.mkdir()
        os.chown(state.parent, NOBODY, NOBODY)
        return Mount(good, state, str(good), "make it readable", NOBODY)
    if case == "state directory not writable":
        state.parent.mkdir(mode=0o755)  # root's, and the daemon runs as nobody
        return Mount(good, state, str(state.parent), "mount a writable volume", NOBODY)
    if case == "state directory read-only":
        directory = _read_only(tmp / "ro")
        return Mount(good, directory / "state.json", str(directory), "mount a writable volume")
    if case == "state directory missing on a read-only mount":
        directory = _read_only(tmp / "ro") / "sub"
        return Mount(good, directory / "state.json", str(directory), "mount a writable volume")
    assert case == "state directory is a file"
    (tmp / "file").write_text("")
    return Mount(good, tmp / "file" / "state.json", str(tmp / "file"), "not a directory")


@pytest.mark.parametrize("case", ["missing model", "model unreadable", "model directory closed", "missing config", "config is a directory", "config unreadable",
                                  "state directory not writable", "state directory read-only",
                                  "state directory missing on a read-only mount", "state directory is a file"])
def test_a_bad_mount_is_one_line_naming_the_path_and_the_fix_and_a_non_zero_exit(case: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("the cases set up files as root and run the daemon as nobody")
    # A world-readable scratch directory: the daemon may run as nobody, who must reach it.
    tmp = Path(tempfile.mkdtemp(dir=shared_dir()))
    tmp.chmod(0o755)
    mount = bad_mount(case, tmp)
    try:
        done = subprocess.run(
            [server_python(), "-m", "numad_infer", "--config", str(mount.config), "--state-file", str(mount.state_file),
             "run", "--backend", "process"],
            capture_output=True, text=True, timeout=60, cwd="/", env=dict(os.environ, PYTHONPATH=str(ROOT)),
            user=mount.uid, group=mount.uid, extra_groups=[])
    finally:
        for ro in tmp.glob("ro"):
            subprocess.run(["umount", str(ro)])
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout and not done.stdout
    [line] = done.stderr.splitlines()
    assert mount.names in line and mount.fix in line and "ERROR" in line, line


def test_forward_prefixes_every_line_and_splits_one_too_long_to_hold() -> None:
    from numad_infer.backends.childlog import MAX_LINE, forward

    child_r, child_w = os.pipe()
    out_r, out_w = os.pipe()
    os.write(child_w, b"loading\r\n" + b"x" * (MAX_LINE + 10) + b"\nno newline at the end")
    os.close(child_w)
    with os.fdopen(child_r, "rb") as pipe:
        forward(pipe, "infer@0", out_w)
    os.close(out_w)
    with os.fdopen(out_r, "rb") as out:
        lines = out.read().split(b"\n")
    assert lines[0] == b"infer@0: loading"
    assert lines[1] == b"infer@0: " + b"x" * MAX_LINE and lines[2] == b"infer@0: " + b"x" * 10
    assert lines[3:] == [b"infer@0: no newline at the end", b""]
