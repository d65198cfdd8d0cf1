"""What others name reaches no terminal or log raw (issue 30, item 3).

Anyone may name a thread or a process (prctl PR_SET_NAME) with ESC and a newline in it,
and /proc shows the name as it is. Here a real thread of this process, and a real busy
child process, are so named; then what `doctor` prints of the child, what `status` prints
of a drift naming the thread, what the daemon's log handler writes, and what the process
backend forwards of a child's output: no ESC, no line that the name started.
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from numad_infer.backends.childlog import forward
from numad_infer.cli.commands import log_handler
from numad_infer.cli.present import format_status
from numad_infer.config.schema import MonitorSection
from numad_infer.doctor.pipeline import read_facts
from numad_infer.doctor.verdicts import check_neighbours, format_checks
from numad_infer.host.identity import BackendKind
from numad_infer.host.procfs import ProcReader
from numad_infer.host.proc_types import ThreadInfo
from numad_infer.lifecycle.drift import EventKind
from numad_infer.lifecycle.states import State
from numad_infer.plan.model import Instance, Policy
from numad_infer.status.records import DaemonState, DaemonStatus, Event, InstanceStatus, Status
from numad_infer.supervision.drift_checks import CheckContext, HostPinner
from numad_infer.supervision.instance import Runtime
from numad_infer.validate.pipeline import load
from tests.doctor import hosts as doctor_base

PR_SET_NAME = 15
NAME = b"\x1b[1mA\nERROR: x"  # 14 bytes: the kernel keeps up to 15
SHOWN = "\\x1b[1mA\\nERROR: x"  # printable(NAME)
FORGED = "ERROR: x"  # the line the name would start


def _no_raw(text: str) -> None:
    assert "\x1b" not in text
    assert not any(line.startswith(FORGED) for line in text.splitlines()), text


@contextmanager
def named_thread() -> Iterator[int]:
    """A thread of this process named NAME, until the block ends; its tid."""
    libc = ctypes.CDLL(None, use_errno=True)
    ready, done = threading.Event(), threading.Event()
    tids: list[int] = []

    def body() -> None:
        tids.append(threading.get_native_id())
        if libc.prctl(PR_SET_NAME, ctypes.c_char_p(NAME), 0, 0, 0) == 0:
            ready.set()
            done.wait(60)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    try:
        assert ready.wait(10), "prctl(PR_SET_NAME) failed"
        # What the kernel shows is the name as it is: the premise of all that follows.
        assert Path(f"/proc/self/task/{tids[0]}/comm").read_bytes() == NAME + b"\n"
        yield tids[0]
    finally:
        done.set()
        thread.join()


class OneThread(ProcReader):
    """This host's /proc, one thread of the process only (pytest's own threads left out)."""

    def __init__(self, tid: int) -> None:
        super().__init__("/")
        self.tid = tid

    def threads(self, pid: int) -> list[ThreadInfo]:
        return [t for t in (self.thread(pid, self.tid),) if t is not None]


def test_the_proc_reader_escapes_a_thread_name_as_it_reads_it() -> None:
    with named_thread() as tid:
        info = ProcReader("/").thread(os.getpid(), tid)
    assert info is not None and info.name == SHOWN


def test_a_drift_naming_the_thread_is_escaped_in_status_and_in_the_log() -> None:
    # A CPU this process may not run on: every thread of it is outside the instance.
    cpu = max(os.sched_getaffinity(0)) + 1
    instance = Instance("infer@0", 0, (cpu,), ((cpu,),), (0,), Policy.BIND, 1, 8080)
    runtime = Runtime(instance)
    runtime.new_process(os.getpid())
    stream = io.StringIO()
    handler = log_handler("%(levelname)s: %(message)s", stream)
    logger = logging.getLogger("numad_infer")
    logger.addHandler(handler)
    old_level, logger.level = logger.level, logging.INFO
    try:
        with named_thread() as tid:
            ctx = CheckContext(instance, os.getpid(), 0.0, lambda: 1000.0, MonitorSection(repair=False),
                               OneThread(tid), False, runtime, HostPinner())
            assert runtime.checks[EventKind.AFFINITY].run(ctx)
    finally:
        logger.removeHandler(handler)
        logger.level = old_level
    assert runtime.last_drift is not None and f"thread {tid} ({SHOWN})" in runtime.last_drift.detail
    status = Status(DaemonStatus(DaemonState.RUNNING, "/etc/numa-infer.toml", pid=1),
                    (InstanceStatus.planned(instance, os.getpid(), State.HEALTHY, last_drift=runtime.last_drift,
                                            drifting=True),))
    printed = format_status(status)
    assert SHOWN in printed
    _no_raw(printed)
    logged = stream.getvalue()
    assert SHOWN in logged and logged.count("\n") == 1
    _no_raw(logged)


def test_status_escapes_what_the_state_file_carries_raw() -> None:
    """The presenter escapes too: a detail written raw (by an older daemon, or anyone who
    wrote the state file) is shown escaped, as are an error and a warning."""
    cpu = 0
    instance = Instance("infer@0", 0, (cpu,), ((cpu,),), (0,), Policy.BIND, 1, 8080)
    raw = NAME.decode()
    status = Status(DaemonStatus(DaemonState.RUNNING, "/etc/numa-infer.toml", pid=1, warnings=(raw,), status=raw),
                    (InstanceStatus.planned(instance, 42, State.HEALTHY, error=raw, unit_state=raw,
                                            last_drift=Event(1000.0, "affinity", f"thread 7 ({raw})")),))
    printed = format_status(status)
    assert printed.count(SHOWN) == 5
    _no_raw(printed)


def test_the_daemons_log_is_one_escaped_line_per_record() -> None:
    """`numa-infer run`'s own logging set-up (main calls setup_logging), in a process of its own."""
    script = ("import argparse, logging\n"
              "from numad_infer.cli.commands import cmd_run, setup_logging\n"
              "setup_logging(argparse.Namespace(func=cmd_run, verbose=False))\n"
              f"logging.getLogger('numad_infer.supervision').warning('thread %s drifted', {NAME.decode()!r})\n")
    for journal in ("", "8:1234"):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "JOURNAL_STREAM": journal})
        assert done.returncode == 0, done.stderr
        assert done.stderr.endswith(f"WARNING: thread {SHOWN} drifted\n") and done.stderr.count("\n") == 1
        _no_raw(done.stderr)


def test_doctor_prints_a_busy_neighbour_named_with_escapes_escaped(tmp_path: Path) -> None:
    """This host's /proc: a busy process on an inference CPU, named NAME, as doctor reads it."""
    config, _ = doctor_base.setup(tmp_path)
    loaded = load(str(config), BackendKind.PROCESS, "/")
    cpu = loaded.plan.instances[0].cpus[0]
    code = ("import ctypes, os\n"
            f"os.sched_setaffinity(0, {{{cpu}}})\n"
            f"assert ctypes.CDLL(None).prctl({PR_SET_NAME}, ctypes.c_char_p({NAME!r}), 0, 0, 0) == 0\n"
            "print(flush=True)\nwhile True: pass")
    busy = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert busy.stdout is not None and busy.stdout.readline() == b"\n"
        assert Path(f"/proc/{busy.pid}/comm").read_bytes() == NAME + b"\n"
        facts, plan = read_facts(loaded, "/", None, 0.5)
        mine = tuple(n for n in facts.neighbours if n.pid == busy.pid)
        assert [n.name for n in mine] == [SHOWN]
        printed = format_checks([check_neighbours(replace(facts, neighbours=mine), plan)])
        assert f"{SHOWN} (pid {busy.pid})" in printed
        _no_raw(printed)
        # The command itself, whatever else is busy here.
        done = subprocess.run([sys.executable, "-m", "numad_infer", "--config", str(config), "--state-file",
                               str(tmp_path / "no-state.json"), "doctor", "--sample", "0.5"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode in (0, 1, 2) and "Traceback" not in done.stderr, done.stderr
        _no_raw(done.stdout + done.stderr)
    finally:
        busy.kill()
        busy.wait()


def test_a_childs_output_is_forwarded_escaped_one_line_each() -> None:
    """The process backend's `--instance-logs stdout`: a compromised instance cannot
    overwrite the `infer@0: ` prefix (\\r) nor send its terminal sequences."""
    source_r, source_w = os.pipe()
    out_r, out_w = os.pipe()
    os.write(source_w, b"loaded\x1b[2K\rfrontdoor: forged\nok \xff\n")
    os.close(source_w)
    forward(os.fdopen(source_r, "rb"), "infer@0", out_w)
    os.close(out_w)
    with os.fdopen(out_r, "rb") as handle:
        lines = handle.read().decode().splitlines()
    assert lines == ["infer@0: loaded\\x1b[2K\\rfrontdoor: forged", "infer@0: ok \ufffd"]


def test_a_status_for_systemd_cannot_add_fields_of_its_own(tmp_path: Path) -> None:
    """sd_notify's message is one `KEY=value` a line: a reload error quoting a program's
    output with a newline in it must not become READY=1 or MAINPID= of its own."""
    import socket

    from numad_infer.systemd.notify import Notifier

    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        Notifier({"NOTIFY_SOCKET": str(path)}).send("STATUS=reload failed: x\nMAINPID=1\x1b[2J", "ERRNO=5")
        message = sock.recv(4096).decode()
    assert message.split("\n") == ["STATUS=reload failed: x\\nMAINPID=1\\x1b[2J", "ERRNO=5"]


def test_what_restart_prints_of_the_state_file_is_escaped(tmp_path: Path, capsys) -> None:
    """`numa-infer restart` follows the roll in the state file and prints the daemon's
    refusal: text the daemon wrote, which may quote a program or a peer."""
    from numad_infer.cli.daemon_client import _follow_restart
    from numad_infer.status.records import RestartResult
    from numad_infer.status.statefile import write_status

    path = tmp_path / "state.json"
    refused = RestartResult("r1", 1000.0, False, error=f"instance {NAME.decode()} is held")
    write_status(path, Status(DaemonStatus(DaemonState.RUNNING, "/etc/numa-infer.toml", pid=1,
                                           last_restart=refused), ()))
    assert _follow_restart(path, "r1", 5.0) == 1
    err = capsys.readouterr().err
    assert f"restart refused: instance {SHOWN} is held" in err
    _no_raw(err)
