"""Talking to the running daemon: whether it is alive and a numa-infer daemon at all, its
published status, the reload protocol (SIGHUP, then wait for the state file's
generation to move past the one before it) and the restart protocol (a request file, then
SIGUSR1, then follow the roll in the state file). What it prints of the state file is
escaped (`printable`): the daemon's errors may quote what a program or a peer said."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from numad_infer.cli.present import join_names, rotation_words
from numad_infer.errors import NumaInferError
from numad_infer.status.statefile import read_status
from numad_infer.util.printable import printable

if TYPE_CHECKING:
    from numad_infer.status.records import ReloadResult, Status


def _alive(pid: int | None) -> bool:
    from numad_infer.supervision.holds import alive

    return alive(pid)


def running_daemon(path: Path) -> Status | None:
    """The published status, if its daemon is alive (StatusError for a file of another shape)."""
    status = read_status(path)
    if status is None or not status.daemon.state.live or not _alive(status.daemon.pid):
        return None
    return status


def cmd_health(args: argparse.Namespace) -> int:
    """For liveness and readiness probes (a container's HEALTHCHECK, Kubernetes): one line,
    exit 0 yes, 1 no, 3 no daemon; the code always the line's first word. Reads only the
    state file: cheap and never blocks. Ready is `Status.ready`: what /healthz answers."""
    status = running_daemon(Path(args.state_file))
    if status is None:
        print("not live: the daemon is not running")
        return 3
    live = status.live(time.time())
    if args.ready:
        ok = live and status.ready
        print(printable(f"{'ready' if ok else 'not ready'}: {rotation_words(status)}"
                        + ("" if live else "; the daemon's loop is not turning")))
        return 0 if ok else 1
    age = time.time() - (status.daemon.updated_at or 0)
    print(f"{'live' if live else 'not live'}: last pass {age:.0f}s ago")
    return 0 if live else 1


class _NotSignalled(NumaInferError):
    """The daemon could not be asked (said on stderr); `rc` is the command's exit code."""

    def __init__(self, message: str, rc: int) -> None:
        super().__init__(message)
        self.rc = rc


def _signal_daemon(args: argparse.Namespace, status: Status | None, signum: int) -> int:
    """Send `signum` to the daemon and return its PID (_NotSignalled: why not)."""
    pid = args.pid if args.pid is not None else (status.daemon.pid if status else None)
    if args.pid is not None and args.pid <= 1:
        raise _NotSignalled(f"--pid {args.pid} is not a daemon's PID (it must be > 1)", 1)
    if not _alive(pid):
        raise _NotSignalled("the daemon is not running", 3)
    assert pid is not None
    # A stale state file (or a mistyped --pid) must never signal an unrelated process.
    if not _is_numa_infer_daemon(pid):
        raise _NotSignalled(f"process {pid} is not a numa-infer daemon (`numa-infer run`); not signalling it",
                            3 if args.pid is None else 1)
    try:
        os.kill(pid, signum)
    except PermissionError:
        raise _NotSignalled(f"cannot signal the daemon (pid {pid}): permission denied; run as root", 1) from None
    except ProcessLookupError:
        raise _NotSignalled("the daemon is not running", 3) from None
    return pid


def cmd_reload(args: argparse.Namespace) -> int:
    """Signal the daemon and wait until it has applied (or refused) the configuration."""
    path = Path(args.state_file)
    status = read_status(path)
    try:
        pid = _signal_daemon(args, status, signal.SIGHUP)
    except _NotSignalled as exc:
        print(f"numa-infer: {exc}", file=sys.stderr)
        return exc.rc
    before = status.daemon.generation if status and status.daemon.pid == pid else 0
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read_status(path)
        if now is not None and now.daemon.pid == pid and now.daemon.generation > before:
            result = now.daemon.last_reload
            if result is not None and result.ok:
                print(printable(f"reloaded: {_what_changed(result)}"))
                return 0
            error = result.error if result is not None else "unknown"
            # The daemon's error names files and may quote what an engine or HAProxy answered.
            print(printable(f"numa-infer: reload failed, still running the previous configuration: {error}"),
                  file=sys.stderr)
            return 1
    print(f"numa-infer: the daemon did not finish reloading within {args.timeout:g}s", file=sys.stderr)
    return 1


def _what_changed(result: ReloadResult) -> str:
    """`added a, changed b, removed none`; a reload that changed only the front door (a
    tenant added, a key rotated) says that, not `added none, changed none, removed none`."""
    door = "front door: tenants, keys or routing changed, HAProxy reloaded"
    if not (result.added or result.changed or result.removed):
        return f"no instance changed; {door}" if result.frontdoor_reloaded else "nothing changed"
    text = (f"added {join_names(result.added)}, changed {join_names(result.changed)}, "
            f"removed {join_names(result.removed)}")
    return f"{text}; {door}" if result.frontdoor_reloaded else text


def cmd_restart(args: argparse.Namespace) -> int:
    """Ask the daemon to restart instances one at a time behind the front door (drained
    first, the next once the last is healthy), and follow the roll until it is over."""
    from numad_infer.supervision import restart_request

    path = Path(args.state_file)
    status = running_daemon(path)
    if status is None:
        print("numa-infer: the daemon is not running", file=sys.stderr)
        return 3
    names = _instance_names(args.instances, status)
    if isinstance(names, str):
        print(printable(f"numa-infer: {names}"), file=sys.stderr)
        return 1
    try:
        request = restart_request.write(path, names)
    except PermissionError:
        print(f"numa-infer: cannot leave a request in {path.parent}: run this as the daemon's user (root)",
              file=sys.stderr)
        return 1
    try:
        _signal_daemon(args, status, signal.SIGUSR1)
    except _NotSignalled as exc:
        restart_request.request_path(path).unlink(missing_ok=True)
        print(f"numa-infer: {exc}", file=sys.stderr)
        return exc.rc
    return _follow_restart(path, request.id, args.timeout)


def _instance_names(given: list[str], status: Status) -> tuple[str, ...] | str:
    """The instances named (`infer@1`, the node's number `1`, with `[[models]]` also
    `chat-1` or a model's name, `chat`, for all of its instances); empty for all; a str
    saying which name matches none."""
    known = [i.name for i in status.instances]
    names: list[str] = []
    for name in given:
        # An instance's part after "@" is `<node>[.<k>]`, or `<model>-<node>[.<k>]` with [[models]].
        match = [k for k in known if name in (k, k.rsplit("@", 1)[-1], k.rsplit("@", 1)[-1].rpartition("-")[0])]
        if not match:
            return f"no instance named {name!r}; the instances are {', '.join(known) or 'none'}"
        names.extend(match)
    return tuple(dict.fromkeys(names))


def _follow_restart(path: Path, request_id: str, timeout_s: float) -> int:
    """Print each instance's state as it changes until the roll is over (exit 0), refused
    or stuck past the timeout (exit 1)."""
    deadline = time.monotonic() + timeout_s
    said: dict[str, str] = {}
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = read_status(path)
        result = now.daemon.last_restart if now is not None else None
        if now is None or result is None or result.id != request_id:
            continue
        if not result.ok:
            print(printable(f"numa-infer: restart refused: {result.error}"), file=sys.stderr)
            return 1
        for instance in now.instances:
            if instance.name in result.instances and said.get(instance.name) != instance.state.value:
                said[instance.name] = instance.state.value
                print(printable(f"{instance.name}: {instance.state.value}"), flush=True)
        if not result.left:
            print(printable(f"restarted: {join_names(result.instances)}"))
            return 0
    print(f"numa-infer: the restart was not over within {timeout_s:g}s; `numa-infer status` shows where it is",
          file=sys.stderr)
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

