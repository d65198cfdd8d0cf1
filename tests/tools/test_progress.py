"""scripts/progress: a long build shows its progress and never sits silent for minutes.

The filter runs for real on a stream of a build's lines (cmake's and ninja's counters),
with its 30-s heartbeat shortened through the environment."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRESS = ROOT / "scripts" / "progress"


def run(feed: str, tmp_path: Path, heartbeat_s: str = "30") -> tuple[list[str], str, float]:
    """Run `feed` (a shell snippet printing a build's output) through the filter: the lines
    it showed, what it kept in its log, and how long it took."""
    log = tmp_path / "build.log"
    started = time.monotonic()
    done = subprocess.run(["bash", "-c", f"set -o pipefail; {{ {feed}; }} | {sys.executable} {PROGRESS} build {log}"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, NUMA_INFER_PROGRESS_HEARTBEAT_S=heartbeat_s))
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines(), log.read_text(), time.monotonic() - started


def test_percentages_are_shown_every_five_points_and_everything_is_logged(tmp_path: Path) -> None:
    feed = "; ".join(f"echo '[{p:3d}%] Building CXX object ggml/src/f{p}.o'" for p in range(0, 101, 1))
    shown, log, _ = run(feed, tmp_path)
    percents = [int(line.split(": ")[1].split("%")[0]) for line in shown]
    assert percents[0] == 0 and percents[-1] == 100
    assert all(b - a >= 5 for a, b in zip(percents, percents[1:])), percents
    assert len(log.splitlines()) == 101 and "f57.o" in log


def test_ninja_counts_become_percentages(tmp_path: Path) -> None:
    shown, _, _ = run("echo '[1/4] cc a'; echo '[2/4] cc b'; echo '[4/4] link'", tmp_path)
    assert [line.split(" (")[0] for line in shown] == ["build: 25%", "build: 50%", "build: 100%"]


def test_a_silent_build_still_says_it_is_alive(tmp_path: Path) -> None:
    # Nothing for 2.5 s from the build: a line each heartbeat (here 0.5 s), with the log's path.
    shown, _, took = run("echo '[ 10%] a'; sleep 2.5; echo '[ 20%] b'", tmp_path, heartbeat_s="0.5")
    alive = [line for line in shown if "still working, 10%" in line]
    assert len(alive) >= 3, shown
    assert all(str(tmp_path / "build.log") in line for line in alive)
    assert took < 10


def test_a_failing_build_fails_the_pipeline(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    done = subprocess.run(["bash", "-c", f"set -o pipefail; {{ echo '[ 50%] x'; exit 3; }} | {PROGRESS} build {log}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "[ 50%] x" in log.read_text()
