"""Checks of the host the daemon reports as warnings (check, journal, status): things
that quietly undo numa-infer's work or keep its instances from starting."""

from __future__ import annotations

import os
import stat
import subprocess
from typing import Any

from numad_infer.config import Config, ConfigError, Engine
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
        if config.server.engine != Engine.LLAMA_CPP_PYTHON:
            return found
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


def run_as(argv: list[str], runs_as: RunAs | None, timeout_s: float) -> subprocess.CompletedProcess[str] | None:
    """Run a program of the operator's choice with no more privilege than the servers get,
    or None when it cannot run or outlives the timeout.

    Starting an interpreter runs code from its environment (a `.pth` file in a venv that
    another user owns), and a binary is code: where the servers run unprivileged, so does
    this, never as root.
    """
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
        return subprocess.run(argv, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL,
                              timeout=timeout_s + 5, cwd="/", env={"PATH": "/usr/bin:/bin"}, **drop)
    except (OSError, subprocess.SubprocessError):
        return None


def python_has_llama_cpp(python: str, runs_as: RunAs | None, timeout_s: float = 30.0) -> bool:
    """Does `python` find llama_cpp, run as the servers will run? find_spec only locates
    the package: importing llama_cpp would load the C library (slow)."""
    argv = [python, "-I", "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"]
    done = run_as(argv, runs_as, timeout_s)
    return done is not None and done.returncode == 0


_checked_binaries: dict[tuple[str, int, float, RunAs | None], str] = {}


def check_llama_server(config: Config, source: str, runs_as: RunAs | None, timeout_s: float = 30.0) -> str:
    """server.llama_server is llama.cpp's server and the instances' user can run it; its
    version line, or a ConfigError naming the key. Run once per file version."""
    path = config.server.llama_server
    key = "server.llama_server"
    hint = "build it with scripts/build-llama-server or install Debian's llama.cpp package, and point here"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(source, key, f"no such file; {hint}", path, True) from None
    except OSError as exc:
        raise ConfigError(source, key, f"cannot be read: {exc.strerror}", path, True) from None
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o111:
        raise ConfigError(source, key, f"is not an executable file (chmod 755 {path})", path, True)
    cache_key = (path, st.st_ino, st.st_mtime, runs_as)
    if cache_key in _checked_binaries:
        return _checked_binaries[cache_key]
    version = run_as([path, "--version"], runs_as, timeout_s)
    usage = run_as([path, "--help"], runs_as, timeout_s)
    who = f" as {runs_as.name}" if runs_as is not None else ""
    if version is None or usage is None or version.returncode != 0:
        raise ConfigError(source, key, f"does not run{who} (`{path} --version` failed); check that this user can "
                          f"run it and that its libraries are installed; {hint}", path, True)
    text = version.stdout + version.stderr
    # llama-server's --help lists its own options; llama-cli and the others print the same --version.
    if "version:" not in text or "--api-key-file" not in usage.stdout + usage.stderr:
        raise ConfigError(source, key, f"is not llama.cpp's llama-server (its --version and --help say otherwise); "
                          f"{hint}", path, True)
    line = next((ln.strip() for ln in text.splitlines() if ln.startswith("version:")), "")
    _checked_binaries[cache_key] = line
    return line
