"""The daemon's own code over a fleet of stand-ins (issue 59 part 2): `numa-infer run`, in
this process, with a bench-side `Backend` (numad_infer/backends/base.py) in place of the
process backend. numad_infer/ has no branch for it.

`FleetBackend` is the process backend (its specs, sync, the real front door: HAProxy as a
child with the rendered haproxy.cfg and Lua, the held listener, reloads) but for where an
instance runs: every instance is an `Instance` of one stand-in host process
(bench/standin/fleet_host.py), started with the instance's own llama-server argv, without
pinning (the plan comes from a captured topology this host does not have). Every instance
reports that process's PID, which owns its port (the daemon's port-owner check holds).

    .venv/bin/python -m bench.standin.fleet_daemon --config FILE --fsroot ROOT --state-file FILE \\
        [--calibration bench/standin/calibration.json] [--jitter 0.1]

What differs from the process backend, exactly: no pinning and no memory policy (drift is
reported, never repaired: run it with monitor.repair = false); the instances run as this
process's user (no switch to server.user); no saved prompt caches across restarts
(slots_dir None); the engine's key variable is not passed (no API key in the bench).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from numad_infer.backends.base import Observation
from numad_infer.backends.childlog import InstanceLogs
from numad_infer.backends.process import ProcessBackend
from numad_infer.engines.launch import launch_of
from numad_infer.plan.model import Instance

log = logging.getLogger("bench.fleet")
ROOT = Path(__file__).resolve().parents[2]


class FleetBackend(ProcessBackend):
    name = "process"  # what status shows; the front door and specs are the process backend's

    def __init__(self, log_dir: Path, calibration: str | None, jitter: float = 0.0) -> None:
        super().__init__(log_dir, InstanceLogs.FILE, None)
        self.calibration, self.jitter = calibration, jitter
        self.host: subprocess.Popen[str] | None = None
        self.served: set[str] = set()
        self._lock = threading.Lock()

    # -- the one stand-in host process -------------------------------------------------------
    def _host(self) -> subprocess.Popen[str]:
        if self.host is None or self.host.poll() is not None:
            self.served.clear()
            self.log_dir.mkdir(parents=True, exist_ok=True)
            argv = [sys.executable, "-m", "bench.standin.fleet_host", "--jitter", str(self.jitter)]
            if self.calibration:
                argv += ["--calibration", self.calibration]
            with open(self.log_dir / "standins.log", "a") as errors:  # the child keeps its own descriptor
                self.host = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                                             text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                             start_new_session=True)
            log.info("bench: stand-in host pid %d", self.host.pid)
        return self.host

    def _ask(self, command: dict[str, object]) -> dict[str, object]:
        with self._lock:
            host = self._host()
            assert host.stdin is not None and host.stdout is not None
            host.stdin.write(json.dumps(command) + "\n")
            host.stdin.flush()
            line = host.stdout.readline()
        if not line:
            raise OSError(f"the stand-in host exited ({host.poll()})")
        answer: dict[str, object] = json.loads(line)
        return answer

    def _run(self, instance: Instance, argv: list[str]) -> None:
        answer = self._ask({"op": "start", "name": instance.name, "argv": argv})
        if not answer.get("ok"):
            log.error("%s: the stand-in did not start: %s", instance.name, answer.get("error"))
            return
        self.served.add(instance.name)
        log.info("%s: stand-in on port %d in pid %d (not pinned: planned CPUs %s)", instance.name, instance.port,
                 self.host.pid if self.host else -1, instance.cpus)

    # -- Backend ------------------------------------------------------------------------------
    def start(self, instance: Instance) -> None:
        if self.main_pid(instance.name) is not None:
            return
        loaded = self._synced(instance.name)
        self._run(instance, list(loaded.launches[instance.name].argv))

    def start_copy(self, copy: Instance) -> None:
        loaded = self._synced(copy.name)
        self._run(copy, list(launch_of(loaded.engine, loaded.model(copy.model).served, copy).argv))

    def stop(self, name: str, timeout_s: float = 0.0) -> None:
        if name not in self.served:
            return
        self.served.discard(name)
        with contextlib.suppress(OSError):
            self._ask({"op": "stop", "name": name})

    def restart(self, instance: Instance) -> None:
        self.stop(instance.name)
        self.start(instance)

    def main_pid(self, name: str) -> int | None:
        host = self.host
        if host is None or host.poll() is not None or name not in self.served:
            return None
        return host.pid

    def describe(self, name: str) -> str:
        if name not in self.served:
            return "inactive"
        code = self.host.poll() if self.host else -1
        return "active (running)" if code is None else f"failed (exit {code})"

    def observe(self, names: list[str]) -> dict[str, Observation]:
        return {n: Observation(self.main_pid(n), False, self.describe(n)) for n in names}

    def close(self) -> None:
        host = self.host
        if host is not None and host.poll() is None:
            assert host.stdin is not None
            host.stdin.close()
            try:
                host.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(host.pid, signal.SIGKILL)
                host.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--fsroot", required=True)
    parser.add_argument("--state-file", required=True)
    parser.add_argument("--calibration", default=str(Path(__file__).with_name("calibration.json")))
    parser.add_argument("--jitter", type=float, default=0.0)
    args = parser.parse_args()
    from numad_infer.cli.commands import log_handler
    from numad_infer.daemon.loop import Daemon
    from numad_infer.systemd.notify import Notifier

    logging.basicConfig(level=logging.INFO, handlers=[log_handler("%(asctime)s %(levelname)s: %(message)s")])
    state_file = Path(args.state_file)
    notifier = Notifier()
    backend = FleetBackend(state_file.parent / "logs", args.calibration, args.jitter)
    daemon = Daemon(args.config, args.fsroot, backend, state_file, notifier)
    try:
        code = daemon.run()
    finally:
        backend.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
