"""The daemon's own code over a fleet of stand-ins (issue 59 part 2): `numa-infer run`, in
this process, with a bench-side `Backend` (numad_infer/backends/base.py) in place of the
process backend. numad_infer/ has no branch for it.

`FleetBackend` is the process backend (its specs, sync, the real front door: HAProxy as a
child with the rendered haproxy.cfg and Lua, the held listener, reloads) but for where an
instance runs: every instance is an `Instance` of one stand-in host process
(bench/standin/fleet_host.py), started with the instance's own llama-server argv, without
pinning (the plan comes from a captured topology this host does not have). Every instance
reports that process's PID, which owns its port (the daemon's port-owner check holds).
Instances named in --own-process (or $NUMA_INFER_BENCH_OWN_PROCESS, for benches that start
this through bench/fleet.py's Fleet; `all`: every one) run alone in a host process of their
own, whose PID they report: a restart gives them a new PID, and a `kill -9` of it is that
one instance's crash. In the shared process a restart keeps the PID, and the daemon, which
takes a new PID for a restart's end, holds the instance in `restarting` until
monitor.startup_grace_s has passed: roll-outs need their own processes.

    .venv/bin/python -m bench.standin.fleet_daemon --config FILE --fsroot ROOT --state-file FILE \\
        [--calibration bench/standin/calibration.json] [--jitter 0.1] [--own-process NAME,...]

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
from collections.abc import Iterable
from pathlib import Path

from numad_infer.backends.base import Observation
from numad_infer.backends.childlog import InstanceLogs
from numad_infer.backends.process import ProcessBackend
from numad_infer.engines.launch import launch_of
from numad_infer.plan.model import Instance

log = logging.getLogger("bench.fleet")
OWN_PROCESS_ENV = "NUMA_INFER_BENCH_OWN_PROCESS"
ROOT = Path(__file__).resolve().parents[2]


SHARED = ""  # the key of the host process every instance shares, but those given one of their own
ALL = "all"  # as own_process: every instance in a process of its own


class FleetBackend(ProcessBackend):
    name = "process"  # what status shows; the front door and specs are the process backend's

    def __init__(self, log_dir: Path, calibration: str | None, jitter: float = 0.0,
                 own_process: Iterable[str] = ()) -> None:
        """`own_process`: instances that run in a stand-in host process of their own (one
        instance in it), whose PID they report; ALL: every instance. Then a restart gives
        the instance a new PID, as on a real host (the daemon takes a restart's new PID for
        its end: in the shared process it waits out monitor.startup_grace_s instead), and a
        `kill -9` of that PID is one instance's crash (bench/day2_fleet.py)."""
        super().__init__(log_dir, InstanceLogs.FILE, None)
        self.calibration, self.jitter = calibration, jitter
        self.own = frozenset(own_process)
        self.hosts: dict[str, subprocess.Popen[str]] = {}  # by key: SHARED, or an instance's name
        self.served: dict[str, str] = {}  # instance -> the key of the host process that serves it
        self._lock = threading.Lock()

    @property
    def host(self) -> subprocess.Popen[str] | None:
        """The shared host process (None before the first start)."""
        return self.hosts.get(SHARED)

    # -- the stand-in host processes ---------------------------------------------------------
    def _host(self, key: str) -> subprocess.Popen[str]:
        host = self.hosts.get(key)
        if host is None or host.poll() is not None:
            for name in [n for n, k in self.served.items() if k == key]:
                del self.served[name]  # died with the process before
            self.log_dir.mkdir(parents=True, exist_ok=True)
            argv = [sys.executable, "-m", "bench.standin.fleet_host", "--jitter", str(self.jitter)]
            if self.calibration:
                argv += ["--calibration", self.calibration]
            with open(self.log_dir / "standins.log", "a") as errors:  # the child keeps its own descriptor
                host = self.hosts[key] = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True, cwd=ROOT,
                    env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
            log.info("bench: stand-in host pid %d%s", host.pid, f" (for {key} alone)" if key else "")
        return host

    def _ask(self, key: str, command: dict[str, object]) -> dict[str, object]:
        with self._lock:
            host = self._host(key)
            assert host.stdin is not None and host.stdout is not None
            host.stdin.write(json.dumps(command) + "\n")
            host.stdin.flush()
            line = host.stdout.readline()
        if not line:
            raise OSError(f"the stand-in host exited ({host.poll()})")
        answer: dict[str, object] = json.loads(line)
        return answer

    def _run(self, instance: Instance, argv: list[str]) -> None:
        key = instance.name if instance.name in self.own or ALL in self.own else SHARED
        answer = self._ask(key, {"op": "start", "name": instance.name, "argv": argv})
        if not answer.get("ok"):
            log.error("%s: the stand-in did not start: %s", instance.name, answer.get("error"))
            return
        self.served[instance.name] = key
        log.info("%s: stand-in on port %d in pid %d (not pinned: planned CPUs %s)", instance.name, instance.port,
                 self.hosts[key].pid, instance.cpus)

    @staticmethod
    def _end(host: subprocess.Popen[str]) -> None:
        """A host process asked to exit (stdin closed: it stops its instances first)."""
        if host.poll() is not None:
            return
        assert host.stdin is not None
        with contextlib.suppress(OSError):
            host.stdin.close()
        try:
            host.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(host.pid, signal.SIGKILL)
            host.wait()

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
        key = self.served.pop(name, None)
        if key is None:
            return
        if key != SHARED:  # its own process: it goes with its instance, as a llama-server does
            with self._lock:
                host = self.hosts.pop(key, None)
            if host is not None:
                self._end(host)
            return
        with contextlib.suppress(OSError):
            self._ask(key, {"op": "stop", "name": name})

    def restart(self, instance: Instance) -> None:
        self.stop(instance.name)
        self.start(instance)

    def main_pid(self, name: str) -> int | None:
        host = self.hosts.get(self.served.get(name, SHARED)) if name in self.served else None
        if host is None or host.poll() is not None:
            return None
        return host.pid

    def describe(self, name: str) -> str:
        host = self.hosts.get(self.served[name]) if name in self.served else None
        if host is None:
            return "inactive"
        code = host.poll()
        return "active (running)" if code is None else f"failed (exit {code})"

    def observe(self, names: list[str]) -> dict[str, Observation]:
        return {n: Observation(self.main_pid(n), False, self.describe(n)) for n in names}

    def close(self) -> None:
        for host in list(self.hosts.values()):
            self._end(host)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--fsroot", required=True)
    parser.add_argument("--state-file", required=True)
    parser.add_argument("--calibration", default=str(Path(__file__).with_name("calibration.json")))
    parser.add_argument("--jitter", type=float, default=0.0)
    # bench/fleet.py's Fleet starts this with its own argv: the bench names these in the environment
    parser.add_argument("--own-process", default=os.environ.get(OWN_PROCESS_ENV, ""),
                        help="instances (comma-separated) that run in a stand-in process of their own; all: every one")
    args = parser.parse_args()
    from numad_infer.cli.commands import log_handler
    from numad_infer.daemon.loop import Daemon
    from numad_infer.systemd.notify import Notifier

    logging.basicConfig(level=logging.INFO, handlers=[log_handler("%(asctime)s %(levelname)s: %(message)s")])
    state_file = Path(args.state_file)
    notifier = Notifier()
    backend = FleetBackend(state_file.parent / "logs", args.calibration, args.jitter,
                           [n for n in args.own_process.split(",") if n])
    daemon = Daemon(args.config, args.fsroot, backend, state_file, notifier)
    try:
        code = daemon.run()
    finally:
        backend.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
