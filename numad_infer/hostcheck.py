"""Checks of the host the daemon reports as warnings (check, journal, status): things
that quietly undo numa-infer's work or keep its instances from starting."""

from __future__ import annotations

import os
import subprocess
from typing import Any

from numad_infer.config import Config
from numad_infer.procfs import ProcReader
from numad_infer.systemctl import pid1_is_systemd


class HostCheck:
    def __init__(self, proc: ProcReader, unprivileged_instances: bool) -> None:
        self.proc = proc
        self.unprivileged_instances = unprivileged_instances
        self._python_checked: dict[str, bool] = {}  # a subprocess per interpreter, not per reload

    def warnings(self, config: Config) -> list[str]:
        found: list[str] = []
        if self.proc.numa_balancing() == 1:
            found.append("kernel.numa_balancing = 1: the kernel migrates pages behind numa-infer's back; "
                         "set it to 0 (sysctl kernel.numa_balancing=0)")
        if self.proc.running_commands("numad"):
            found.append("numad is running: it re-pins processes and fights numa-infer; stop and disable it")
        python = config.server.python
        if python not in self._python_checked:
            self._python_checked[python] = python_has_llama_cpp(python, self.unprivileged_instances)
        if not self._python_checked[python]:
            found.append(f"server.python = {python} cannot import llama_cpp: install llama-cpp-python[server] "
                         "into it (e.g. python3 -m venv /opt/llm && /opt/llm/bin/pip install 'llama-cpp-python[server]')")
        return found


NOBODY = 65534


def python_has_llama_cpp(python: str, unprivileged: bool, timeout_s: float = 30.0) -> bool:
    """Does `python` find llama_cpp? Run with no more privilege than the servers get.

    Starting an interpreter runs code from its environment (a `.pth` file in a venv that
    another user owns): where the servers run unprivileged (systemd's DynamicUser), the
    check runs as nobody, never as root. find_spec only locates the package: importing
    llama_cpp would load the C library (slow).
    """
    argv = [python, "-I", "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"]
    drop: dict[str, Any] = {}
    if unprivileged and os.geteuid() == 0:
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
