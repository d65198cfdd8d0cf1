"""systemctl as a thin edge: every call the systemd backend makes goes through here."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Callable

from numad_infer.errors import NumaInferError
from numad_infer.systemd.notify import child_environ

log = logging.getLogger(__name__)


class SystemctlError(NumaInferError):
    pass


def pid1_is_systemd(fsroot: str = "/") -> bool:
    return os.path.isdir(os.path.join(fsroot, "run/systemd/system"))


class Systemctl:
    def __init__(self, binary: str | None = None, timeout_s: float = 90.0,
                 progress: Callable[[], None] | None = None) -> None:
        self.binary = binary or shutil.which("systemctl") or "/usr/bin/systemctl"
        self.timeout_s = timeout_s
        # Called before and after every call: the daemon feeds its watchdog here, so a
        # reload made of many slow (but finishing) calls is not taken for a hang.
        self.progress = progress

    # Every call puts "--" before unit names: a name is never read as an option.
    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        if self.progress is not None:
            self.progress()
        try:
            return self._run(args, check)
        finally:
            if self.progress is not None:
                self.progress()

    def _run(self, args: tuple[str, ...], check: bool) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=self.timeout_s,
                                  env=child_environ())
        except subprocess.TimeoutExpired as exc:
            raise SystemctlError(f"systemctl {' '.join(args)}: no answer within {self.timeout_s:g}s") from exc
        if check and proc.returncode < 0:
            raise SystemctlError(f"systemctl {' '.join(args)}: killed by {signal.Signals(-proc.returncode).name}")
        if check and proc.returncode != 0:
            raise SystemctlError(f"systemctl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def daemon_reload(self) -> None:
        self.run("daemon-reload")

    def start(self, *units: str) -> None:
        if units:
            self.run("start", "--no-block", "--", *units)

    def stop(self, *units: str) -> None:
        if units:
            self.run("stop", "--", *units)

    def restart(self, *units: str) -> None:
        if units:
            self.run("restart", "--no-block", "--", *units)

    def reload(self, *units: str) -> None:
        if units:
            self.run("reload", "--", *units)

    def show_many(self, units: list[str], *props: str) -> dict[str, dict[str, str]]:
        """One systemctl call for many units (one fork per pass, not one per instance)."""
        if not units:
            return {}
        # check=True: a failed call (systemd busy reloading during a package upgrade) must
        # read as "unknown", never as "not running" -- that would restart healthy instances.
        proc = self.run("show", f"--property=Id,{','.join(props)}", "--", *units)
        result: dict[str, dict[str, str]] = {}
        for block in proc.stdout.strip().split("\n\n"):
            fields = dict(line.partition("=")[::2] for line in block.splitlines() if "=" in line)
            if "Id" in fields:
                result[fields["Id"]] = fields
        return result

    def jobs(self) -> list[tuple[str, str, str, str]]:
        """Queued and running jobs as (id, unit, type, state)."""
        proc = self.run("list-jobs", "--plain", "--no-legend", "--full")
        rows = []
        for line in proc.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[0].isdigit():
                rows.append((parts[0], parts[1], parts[2], parts[3]))
        return rows
