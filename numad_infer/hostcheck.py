"""Checks of the host the daemon reports as warnings (check, journal, status): things
that quietly undo numa-infer's work or keep its instances from starting."""

from __future__ import annotations

import os
import subprocess
from typing import Any

from numad_infer.config import Config
from numad_infer.identity import RunAs
from numad_infer.procfs import ProcReader
from numad_infer.systemctl import pid1_is_systemd


class HostCheck:
    def __init__(self, proc: ProcReader) -> None:
        self.proc = proc
        # a subprocess per interpreter and user, not per reload
        self._python_checked: dict[tuple[str, RunAs | None], bool] = {}

    def warnings(self, config: Config, runs_as: RunAs | None) -> list[str]:
        found: list[str] = []
        if self.proc.numa_balancing() == 1:
            found.append("kernel.numa_balancing = 1: the kernel migrates pages behind numa-infer's back; "
                         "set it to 0 (sysctl kernel.numa_balancing=0)")
        if self.proc.running_commands("numad"):
            found.append("numad is running: it re-pins processes and fights numa-infer; stop and disable it")
        if runs_as is not None and runs_as.is_root:
            found.append("server.user = root: the servers run as root; any flaw in the HTTP server is a root "
                         "compromise. Name an unprivileged user (the default is nobody)")
        python = config.server.python
        if (python, runs_as) not in self._python_checked:
            self._python_checked[python, runs_as] = python_has_llama_cpp(python, runs_as)
        if not self._python_checked[python, runs_as]:
            who = f" as {runs_as.name}" if runs_as is not None else ""
            found.append(f"server.python = {python} cannot import llama_cpp{who}: install llama-cpp-python[server] "
                         "into it (e.g. python3 -m venv /opt/llm && /opt/llm/bin/pip install 'llama-cpp-python[server]')"
                         + (", where that user can read and run it" if who else ""))
        return found


NOBODY = 65534


def python_has_llama_cpp(python: str, runs_as: RunAs | None, timeout_s: float = 30.0) -> bool:
    """Does `python` find llama_cpp? Run as the servers will run, never with more privilege.

    Starting an interpreter runs code from its environment (a `.pth` file in a venv that
    another user owns): where the servers run unprivileged, so does the check, never as
    root. find_spec only locates the package: importing llama_cpp would load the C
    library (slow).
    """
    argv = [python, "-I", "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"]
    drop: dict[str, Any] = {}
    if runs_as is not None and runs_as.uid is not None:
        if os.geteuid() == 0:
            drop = runs_as.popen_kwargs()
    elif runs_as is not None and os.geteuid() == 0:
        if pid1_is_systemd():
            # As the instances themselves run: a transient unit with a DynamicUser (the
            # daemon holds no CAP_SETUID to drop privileges itself).
            argv = ["systemd-run", "--quiet", "--wait", "--pipe", "--collect", "-p", "DynamicUser=yes",
                    "-p", f"RuntimeMaxSec={int(timeout_s)}", "-p", "ProtectSystem=strict", "-p", "PrivateTmp=yes",
                    "--", *argv]
        else:
            drop = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    try:
        return subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL, timeout=timeout_s + 5, cwd="/",
                              env={"PATH": "/usr/bin:/bin"}, **drop).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
