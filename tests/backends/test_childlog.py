"""A child's log file under the process backend stays under its bound however fast the
child writes, and keeps the latest output. Before: the child wrote to the file itself, and
the file grew without limit (on /run, a tmpfs, by default)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

from numad_infer.backends.childlog import LOG_MAX_BYTES, ChildOutput, InstanceLogs
from tests.daemon_harness import wait_for

CAP = 64 << 10
LINES = 1_500_000  # 14 bytes a line: 21 MB, over 300 times the cap
# As fast as Python writes: big writes of many lines, then a last line.
CHATTY = f"""
import sys
out = sys.stdout.buffer
for start in range(0, {LINES}, 5000):
    out.write(b"".join(b"line %08d\\n" % i for i in range(start, min(start + 5000, {LINES}))))
out.write(b"END\\n")
"""


def expected_output() -> bytes:
    return b"".join(b"line %08d\n" % i for i in range(LINES)) + b"END\n"


def log_sizes(logs: Path) -> int:
    total = 0
    for path in logs.iterdir():
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            pass  # rotated between the listing and the stat
    return total


def test_a_child_writing_as_fast_as_it_can_keeps_its_logs_under_the_bound_and_the_latest_lines(
        tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    output = ChildOutput(InstanceLogs.FILE, logs, max_bytes=CAP)
    largest = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal largest
        while not done.is_set():
            largest = max(largest, log_sizes(logs))

    sampler = threading.Thread(target=sample)
    child = output.popen("infer@0", [sys.executable, "-c", CHATTY], stdin=subprocess.DEVNULL)
    sampler.start()
    try:
        assert child.wait(120) == 0
        current = logs / "infer@0.log"
        wait_for(lambda: current.read_bytes().endswith(b"END\n"), "the last line in the log", 30)
    finally:
        done.set()
        sampler.join()
    assert sorted(p.name for p in logs.iterdir()) == ["infer@0.log", "infer@0.log.1"]
    rotated = (logs / "infer@0.log.1").read_bytes()
    kept = current.read_bytes()
    assert len(rotated) <= CAP and len(kept) <= CAP
    assert largest <= 2 * CAP, f"{largest} bytes on disk at once, the bound is {2 * CAP}"
    # What is kept is the end of what the child wrote, whole: .1 then the current file,
    # nothing missing between them, nothing else.
    assert expected_output().endswith(rotated + kept)
    assert len(rotated + kept) > CAP


def test_a_log_that_cannot_be_written_drops_the_output_and_never_blocks_the_child(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    output = ChildOutput(InstanceLogs.FILE, logs, max_bytes=CAP)
    # The child waits for its go, so that the directory is gone before it writes.
    child = output.popen("infer@0", [sys.executable, "-c", "import sys; sys.stdin.readline(); " + CHATTY],
                         stdin=subprocess.PIPE)
    assert child.stdin is not None
    shutil.rmtree(logs)
    child.stdin.write(b"go\n")
    child.stdin.close()
    # 21 MB through a 64 KiB pipe: it finishes only if the daemon keeps reading.
    assert child.wait(120) == 0
    assert not logs.exists()


def test_the_docs_and_the_help_state_the_size_the_logs_are_kept_at() -> None:
    import argparse

    from numad_infer.cli.main import build_parser

    mib = f"{LOG_MAX_BYTES >> 20} MiB"
    readme = " ".join((Path(__file__).resolve().parents[2] / "docs/containers.md").read_text().split())
    assert f"`<state dir>/logs/<name>.log`, at most {mib}, and the {mib} before it in `<name>.log.1`" in readme
    assert f"at most {2 * LOG_MAX_BYTES >> 20} MiB of `/run`" in readme
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    [option] = [a for a in sub.choices["run"]._actions if "--instance-logs" in a.option_strings]
    assert f"NAME.log.1 at {mib}" in (option.help or "")
