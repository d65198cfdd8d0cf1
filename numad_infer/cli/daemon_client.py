"""Talking to the running daemon: whether it is alive and a numa-infer daemon at all, its
published status, and the reload protocol (SIGHUP, then wait for the state file's
generation to move past the one before it)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from numad_infer.cli.present import join_names
from numad_infer.status.statefile import read_status

if TYPE_CHECKING:
    from numad_infer.status.records import Status


def _alive(pid: int | None) -> bool:
    from numad_infer.supervision.holds import alive

    return alive(pid)


def running_daemon(path: Path) -> Status | None:
    """The published status, if its daemon is alive (StatusError for a file of another shape)."""
    status = read_status(path)
    if status is None or not status.daemon.state.live or not _alive(status.daemon.pid):
        return None
    return status


def cmd_reload(args: argparse.Namespace) -> int:
    """Signal the daemon and wait until it has applied (or refused) the configuration."""
    path = Path(args.state_file)
    status = read_status(path)
    pid = args.pid if args.pid is not None else (status.daemon.pid if status else None)
    if args.pid is not None and args.pid <= 1:
        print(f"numa-infer: --pid {args.pid} is not a daemon's PID (it must be > 1)", file=sys.stderr)
        return 1
    if not _alive(pid):
        print("numa-infer: the daemon is not running", file=sys.stderr)
        return 3
    assert pid is not None
    # A stale state file (or a mistyped --pid) must never signal an unrelated process.
    if not _is_numa_infer_daemon(pid):
        print(f"numa-infer: process {pid} is not a numa-infer daemon (`numa-infer run`); not signalling it",
              file=sys.stderr)
        return 3 if args.pid is None else 1
    before = status.daemon.generation if status and status.daemon.pid == pid else 0
    try:
        os.kill(pid, signal.SIGHUP)
    except PermissionError:
        print(f"numa-infer: cannot signal the daemon (pid {pid}): permission denied; run as root", file=sys.stderr)
        return 1
    except ProcessLookupError:
        print("numa-infer: the daemon is not running", file=sys.stderr)
        return 3
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read_status(path)
        if now is not None and now.daemon.pid == pid and now.daemon.generation > before:
            result = now.daemon.last_reload
            if result is not None and result.ok:
                print(f"reloaded: added {join_names(result.added)}, changed {join_names(result.changed)}, "
                      f"removed {join_names(result.removed)}")
                return 0
            error = result.error if result is not None else "unknown"
            print(f"numa-infer: reload failed, still running the previous configuration: {error}", file=sys.stderr)
            return 1
    print(f"numa-infer: the daemon did not finish reloading within {args.timeout:g}s", file=sys.stderr)
    return 1


def _is_numa_infer_daemon(pid: int) -> bool:
    import psutil

    try:
        argv = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return False
    # `numa-infer run ...` (console script) or `python -m numad_infer ... run ...`.
    named = any(Path(a).name == "numa-infer" for a in argv[:2]) or "numad_infer" in argv[:3]
    return named and "run" in argv

