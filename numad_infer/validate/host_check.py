"""The host as the instances will meet it: files and programs seen with their privilege
(`InstanceHost`, what an engine's check uses), and the host settings that quietly undo
numa-infer's work (`host_warnings`: check, journal, status)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from typing import Any

from numad_infer.host.identity import DYNAMIC_USER, BackendKind, RunAs
from numad_infer.host.pinning import SECCOMP_DOC, MemoryCalls
from numad_infer.host.procfs import ProcReader

# Programs that ran successfully, by argv, file identity and user: a reload does not run
# them again unless the file changed. Failures are not kept: they are told until fixed.
# llama-server's log leaves from a thread of its own, which a process that exits at once
# may not let run: under load, 28 of 300 `--list-devices` runs lost the line naming the CPU
# variant (2 cores, 4 spinning processes beside it). Ten tries make a lost line a 1e-10 event.
RUN_TRIES = 10
_SUCCEEDED: dict[tuple[tuple[str, ...], tuple[int, int, float], RunAs | None], subprocess.CompletedProcess[str]] = {}


class InstanceHost:
    """`engines.HostAccess` for the instances' user: `run` never runs the operator's
    program with more privilege than the servers get.

    Starting an interpreter runs code from its environment (a `.pth` file in a venv that
    another user owns), and a binary is code: where the servers run unprivileged, so does
    the check, never as root.
    """

    def __init__(self, runs_as: RunAs | None) -> None:
        self.runs_as = runs_as
        self.who = f" as {runs_as.name}" if runs_as is not None else ""

    def stat(self, path: str) -> os.stat_result:
        return os.stat(path)

    def run(self, argv: list[str], timeout_s: float,
            until: Callable[[subprocess.CompletedProcess[str]], bool] | None = None,
            ) -> subprocess.CompletedProcess[str] | None:
        try:
            st = os.stat(argv[0])
            key = (tuple(argv), (st.st_dev, st.st_ino, st.st_mtime), self.runs_as)
        except OSError:
            return run_as(argv, self.runs_as, timeout_s)
        if key not in _SUCCEEDED:
            for _ in range(RUN_TRIES if until is not None else 1):
                done = run_as(argv, self.runs_as, timeout_s)
                if done is None or done.returncode != 0:
                    return done
                if until is None or until(done):
                    break
            else:
                return done  # what it said, not kept: asked again next time
            _SUCCEEDED[key] = done
        return _SUCCEEDED[key]


def run_as(argv: list[str], runs_as: RunAs | None, timeout_s: float) -> subprocess.CompletedProcess[str] | None:
    """Run `argv` as the instances would run, or None when it cannot run or outlives the
    timeout. As a DynamicUser (systemd backend): a transient unit with one, since the
    daemon holds no CAP_SETUID to drop privileges itself."""
    drop: dict[str, Any] = {}
    if runs_as == DYNAMIC_USER and os.geteuid() == 0:
        argv = ["systemd-run", "--quiet", "--wait", "--pipe", "--collect", "-p", "DynamicUser=yes",
                "-p", f"RuntimeMaxSec={int(timeout_s)}", "-p", "ProtectSystem=strict", "-p", "PrivateTmp=yes",
                "--", *argv]
    elif runs_as is not None and runs_as.uid is not None and os.geteuid() == 0:
        drop = runs_as.popen_kwargs()
    try:
        return subprocess.run(argv, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL,
                              timeout=timeout_s + 5, cwd="/", env={"PATH": "/usr/bin:/bin"}, **drop)
    except (OSError, subprocess.SubprocessError):
        return None


def host_warnings(proc: ProcReader, runs_as: RunAs | None) -> list[str]:
    found: list[str] = []
    if proc.numa_balancing() == 1:
        found.append("kernel.numa_balancing = 1: the kernel migrates pages behind numa-infer's back; "
                     "set it to 0 (sysctl kernel.numa_balancing=0)")
    if proc.running_commands("numad"):
        found.append("numad is running: it re-pins processes and fights numa-infer; stop and disable it")
    if runs_as is not None and runs_as.is_root:
        found.append("server.user = root: the servers run as root; any flaw in the HTTP server is a root "
                     "compromise. Name an unprivileged user (the default is numa-infer)")
    if runs_as is not None and runs_as.fallback:
        found.append(f"server.user: {runs_as.fallback}")
    return found


def memory_call_warnings(calls: MemoryCalls, kind: BackendKind) -> list[str]:
    """What a seccomp profile that refuses the memory calls costs, in the operator's words.

    Under the systemd backend systemd binds each instance (NUMAPolicy=), so only the
    repair depends on the daemon's own calls."""
    found: list[str] = []
    if calls.bind_refused is not None and kind == BackendKind.PROCESS:
        found.append(f"set_mempolicy is refused here ({calls.bind_refused}: a seccomp profile, such as Kubernetes' "
                     "RuntimeDefault without CAP_SYS_NICE): the instances start pinned to their CPUs but not bound "
                     "to their memory node(s); their memory follows first touch from their pinned threads, within "
                     f"the cgroup's memory nodes. Allow set_mempolicy and mbind in the profile ({SECCOMP_DOC})")
    if calls.migrate_refused is not None:
        found.append(f"migrate_pages is refused here ({calls.migrate_refused}: a seccomp profile; podman's and "
                     "Kubernetes' defaults refuse it): memory drift is reported, not repaired. Allow migrate_pages "
                     f"in the profile ({SECCOMP_DOC})")
    return found
