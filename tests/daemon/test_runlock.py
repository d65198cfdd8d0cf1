"""One daemon per state file (util/runlock.py): the lock itself, and a second `numa-infer run`
on a running daemon's state file refused at once, touching nothing the first one owns."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from numad_infer.util.runlock import LockHeld, RunLock, lock_path
from tests.daemon_harness import ROOT, daemons, free_port, generated_model


def test_a_second_holder_is_refused_naming_the_first_ones_pid(tmp_path: Path) -> None:
    path = lock_path(tmp_path / "state.json")
    first = RunLock.take(path)
    assert path.read_text() == f"{os.getpid()}\n"
    with pytest.raises(LockHeld) as refused:  # another open file description, as another process has
        RunLock.take(path)
    assert refused.value.pid == os.getpid() and f"pid {os.getpid()}" in str(refused.value)
    assert path.read_text() == f"{os.getpid()}\n"  # the refused one wrote nothing
    first.close()
    again = RunLock.take(path)  # released on close
    again.close()


def descriptors(pid: int) -> list[str]:
    """What the process's descriptors name. One closed between the listing and its read is
    passed over: the child is a Python starting up, which opens and closes its files."""
    held = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            held.append(os.readlink(fd))
        except FileNotFoundError:
            continue
    return held


def test_the_lock_is_not_inherited_across_exec(tmp_path: Path) -> None:
    path = lock_path(tmp_path / "state.json")
    lock = RunLock.take(path)
    try:
        assert fcntl.fcntl(lock.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        # A child the daemon execs (HAProxy, a server) does not keep it: the lock is the
        # daemon's alone, and a new daemon may start while they still run. Judged from the
        # child's own descriptors: retaking the lock alone could be refused for a moment by a
        # fork another thread of this test process makes (its child holds every descriptor
        # until it execs), which says nothing about the child started here.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], close_fds=False)
        try:
            assert str(path) not in descriptors(child.pid)
            lock.close()
            deadline = time.monotonic() + 5
            while True:
                try:
                    RunLock.take(path).close()
                    break
                except LockHeld:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            child.kill()
            child.wait()
    finally:
        lock.close()


def test_a_stale_pid_without_the_lock_does_not_refuse(tmp_path: Path) -> None:
    path = lock_path(tmp_path / "state.json")
    path.write_text("999999\n")  # left by a daemon that died: the lock decides, not the pid
    RunLock.take(path).close()
    assert path.read_text() == f"{os.getpid()}\n"


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return generated_model("tiny")


def test_a_second_run_on_the_same_state_file_is_refused_and_leaves_the_first_alone(
        tmp_path: Path, tiny_model: Path) -> None:
    metrics_port = free_port()
    with daemons(tmp_path, tiny_model) as start:
        run = start(extra_config=f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n')
        run.all_healthy(2)
        run_dir = run.state_file.parent
        before = {name: os.stat(run_dir / name).st_ino for name in ("requests.sock", "haproxy.cfg")}
        cfg = (run_dir / "haproxy.cfg").read_text()
        started = time.monotonic()
        env = {k: v for k, v in run.env.items() if k != "NOTIFY_SOCKET"}
        second = subprocess.run(
            [sys.executable, "-m", "numad_infer", "--config", str(run.config), "--fsroot", str(run.fsroot),
             "--state-file", str(run.state_file), "run", "--backend", "process"],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=30)
        assert second.returncode != 0
        assert time.monotonic() - started < 10
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"pid {run.proc.pid}" in lines[0], second.stderr
        assert second.stdout == ""
        # Nothing of the first one's was touched: same socket, same config, it still runs.
        assert {name: os.stat(run_dir / name).st_ino for name in before} == before
        assert (run_dir / "haproxy.cfg").read_text() == cfg
        assert run.proc.poll() is None
        status = run.cli("status")
        assert status.returncode == 0 and "not running" not in status.stdout, status.stdout
        state = run.state()
        assert state is not None and state["daemon"]["pid"] == run.proc.pid
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as answer:
            assert b"numa_infer_config_ok 1" in answer.read()
