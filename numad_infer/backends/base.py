"""Where instances run: systemd units (production) or child processes (no systemd).

Both take the same plan and expose the same small surface to the reconcile loop:
`specs` (what would run, for diffs), `current_specs` (what a previous daemon left),
`sync` (definitions on disk), `start`, `stop`, `restart`, and `observe` (main PID and
state in words of every instance, in one read).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from numad_infer.backends.childlog import ChildOutput, InstanceLogs
from numad_infer.backends.units import (
    FRONTDOOR_HANDOUT,
    FRONTDOOR_RUN_DIR,
    FRONTDOOR_SOCKET,
    instance_environment,
    render_units,
)
from numad_infer.config.apikey import fingerprint, read_api_key
from numad_infer.config.defaults import FRONTDOOR_STOP_S, FRONTDOOR_USER, INSTANCE_STOP_S
from numad_infer.config.schema import Config
from numad_infer.engines import Engine, engine_of
from numad_infer.errors import NumaInferError
from numad_infer.frontdoor.control import FrontdoorRunner
from numad_infer.frontdoor.haproxy import HaproxyError
from numad_infer.frontdoor.listener import FD_VARIABLE, Handout, HeldListener, Store
from numad_infer.host import pinning
from numad_infer.host.identity import (
    CREATE_USERS,
    BackendKind,
    RunAs,
    frontdoor_runs_as,
    instances_run_as,
    systemd_frontdoor_user,
    unreadable_reason,
)
from numad_infer.host.privdrop import switch_user
from numad_infer.plan.model import Instance, Plan
from numad_infer.systemd.systemctl import Systemctl, SystemctlError
from numad_infer.systemd.unitdir import managed_files, write_units
from numad_infer.systemd.unitnames import (
    DAEMON_UNIT,
    DROPIN_NAME,
    FRONTDOOR_UNIT,
    dropin,
    name_of_dropin,
    template_of,
    template_unit,
    unit,
)
from numad_infer.util.cpuset import format_list

log = logging.getLogger(__name__)

SOCKET_DIR_NAME = "frontdoor"  # process backend: HAProxy's own directory in the run directory


@dataclass(frozen=True)
class Observation:
    pid: int | None  # main process, None when not running
    pending: bool  # the service manager is (re)starting it: not ours to restart now
    description: str  # unit state in words, for logs and status


class Backend(Protocol):
    name: str
    kind: BackendKind  # decides who the instances run as (identity.instances_run_as)
    # Each instance in a cgroup of its own, whose memory.numa_stat is that instance's
    # memory (systemd units); otherwise memory is read from /proc/PID/numa_maps.
    instance_cgroups: bool

    def specs(self, config: Config, plan: Plan) -> dict[str, str]: ...
    def current_specs(self, config: Config) -> dict[str, str]: ...
    def sync(self, config: Config, plan: Plan) -> bool: ...
    def start(self, instance: Instance) -> None: ...
    def stop(self, name: str) -> None: ...
    def restart(self, instance: Instance) -> None: ...
    def observe(self, names: list[str]) -> dict[str, Observation]: ...
    def stop_all_on_exit(self) -> bool: ...
    def forget(self, config: Config) -> None: ...
    def frontdoor_runner(self, run_dir: Path) -> FrontdoorRunner: ...


class SystemdBackend:
    name = "systemd"
    kind = BackendKind.SYSTEMD
    instance_cgroups = True

    def __init__(self, systemctl: Systemctl | None = None, daemon_unit: str = DAEMON_UNIT,
                 handout: FrontdoorHandout | None = None) -> None:
        self.systemctl = systemctl or Systemctl()
        self.daemon_unit = daemon_unit
        self.handout = handout  # None: no front door socket to hand out (a command, a test)

    def specs(self, config: Config, plan: Plan) -> dict[str, str]:
        files = render_units(config, plan)
        template = files[template_unit(config.systemd.template)]
        # A template change (mlock, hardening) changes every instance; so does a new API key,
        # which is not in the unit text (a credential is read at start).
        key = fingerprint(read_api_key(config, "server.api_key_file"))
        return {i.name: template + files[dropin(i.name)] + key for i in plan.instances}

    def current_specs(self, config: Config) -> dict[str, str]:
        """Specs of the units on disk: what a previous daemon left running (adoption)."""
        unit_dir = Path(config.systemd.unit_dir)
        specs: dict[str, str] = {}
        for rel in managed_files(unit_dir):
            if rel.endswith(DROPIN_NAME):
                name = name_of_dropin(rel)
                template_path = unit_dir / template_unit(template_of(name))
                try:
                    key = fingerprint(read_api_key(config, "server.api_key_file"))
                    specs[name] = template_path.read_text() + (unit_dir / rel).read_text() + key
                except (OSError, NumaInferError):
                    specs[name] = ""
        return specs

    def sync(self, config: Config, plan: Plan) -> bool:
        frontdoor_user = systemd_frontdoor_user()
        if config.frontend.enabled and frontdoor_user is None:
            log.warning("front door: user %s does not exist on this host: haproxy runs as root with no capability; %s",
                        FRONTDOOR_USER, CREATE_USERS)
        result = write_units(Path(config.systemd.unit_dir), render_units(config, plan, frontdoor_user))
        if result.changed:
            log.info("units: wrote %s, removed %s; systemctl daemon-reload",
                     ", ".join(result.written) or "nothing", ", ".join(result.removed) or "nothing")
            self.systemctl.daemon_reload()
        return result.changed

    def start(self, instance: Instance) -> None:
        self.systemctl.start(instance.unit)

    def stop(self, name: str) -> None:
        self.systemctl.stop(unit(name))

    def restart(self, instance: Instance) -> None:
        self.systemctl.restart(instance.unit)

    def observe(self, names: list[str]) -> dict[str, Observation]:
        shown = self.systemctl.show_many([unit(n) for n in names], "MainPID", "ActiveState", "SubState")
        result = {}
        for name in names:
            props = shown.get(unit(name), {})
            if "ActiveState" not in props or not props.get("MainPID", "").isdigit():
                raise SystemctlError(f"systemctl show gave no state for {unit(name)}")
            pid = int(props["MainPID"]) or None
            active, sub = props.get("ActiveState", "unknown"), props.get("SubState", "?")
            # "activating": a start job runs, or Restart= will bring it back after a crash.
            result[name] = Observation(pid, active == "activating", f"{active} ({sub})")
        return result

    def forget(self, config: Config) -> None:
        """After a real stop: remove the units we rendered, so a stop (or a package purge) leaves nothing."""
        result = write_units(Path(config.systemd.unit_dir), {})
        if result.removed:
            log.info("units: removed %s; systemctl daemon-reload", ", ".join(result.removed))
            self.systemctl.daemon_reload()

    def stop_all_on_exit(self, looks: int = 5, pause_s: float = 0.2) -> bool:
        # `systemctl restart numa-infer` (an upgrade, an operator) stops us too: only a
        # real stop takes the instances down, so a restarted daemon can adopt them.
        # systemd holds a running job for us while it delivers SIGTERM, but it sends SIGTERM
        # to every process in our cgroup and re-reads the cgroup until no new process shows
        # up: a systemctl forked in that window is killed too (seen in the VM suite as a
        # restart read as a stop). So a failed or empty answer is looked at again.
        seen, failed = "", False
        for look in range(looks):
            if look:
                log.info("%s: looking again for the job that stops the daemon", seen)
                time.sleep(pause_s)
            try:
                jobs = self.systemctl.jobs()
            except SystemctlError as exc:
                seen, failed = str(exc), True
                continue
            kind = next((kind for _, unit, kind, _ in jobs if unit == self.daemon_unit), None)
            if kind in RESTART_JOBS:
                log.info("daemon restart in progress (job %s): leaving instances running for the next daemon to adopt",
                         kind)
                return False
            if kind is not None:
                log.info("%s job %s: stopping the instances", self.daemon_unit, kind)
                return True
            seen, failed = f"no job for {self.daemon_unit} among {len(jobs)} job(s)", False
        if not failed:
            log.info("%s: a stop from outside systemd: stopping the instances", seen)
            return True
        raise SystemctlError(seen)


    def frontdoor_runner(self, run_dir: Path) -> FrontdoorRunner:
        # The unit (render.render_frontdoor_unit) fixes where its files are.
        return SystemdFrontdoorRunner(self.systemctl, self.handout)


@dataclass(frozen=True)
class FrontdoorHandout:
    """What the daemon under systemd needs to hold the front door's socket for HAProxy's
    unit: where to keep it (the unit's file descriptor store), the descriptor a previous
    daemon kept there, and who may take it (listener.Handout)."""

    store: Store
    kept_fd: int | None
    uids: frozenset[int]
    gid: int | None
    path: Path = Path(FRONTDOOR_HANDOUT)


class SystemdFrontdoorRunner:
    """HAProxy as numa-infer-frontdoor.service (rendered into the unit directory by `sync`).

    The daemon holds the listening socket (listener.py says why); the unit starts HAProxy
    through `frontdoor_exec`, which asks the daemon for it."""

    socket_path = Path(FRONTDOOR_SOCKET)
    run_dir = Path(FRONTDOOR_RUN_DIR)
    restarted_by_manager = True  # Restart=on-failure in its unit

    def __init__(self, systemctl: Systemctl, handout: FrontdoorHandout | None = None) -> None:
        self.systemctl = systemctl
        self.listener = HeldListener(None if handout is None else handout.store)
        if handout is not None:
            if handout.kept_fd is not None:
                self.listener.adopt(handout.kept_fd)
            Handout(self.listener, handout.path, handout.uids, handout.gid).start()

    def running(self) -> bool:
        props = self.systemctl.show_many([FRONTDOOR_UNIT], "ActiveState").get(FRONTDOOR_UNIT, {})
        return props.get("ActiveState") in ("active", "reloading", "activating")

    def start(self, binary: str, config_path: Path) -> None:
        self.systemctl.start(FRONTDOOR_UNIT)  # the unit holds the user; HAProxy asks for the socket

    def reload(self) -> None:
        self.systemctl.reload(FRONTDOOR_UNIT)

    def stop(self) -> None:
        self.systemctl.stop(FRONTDOOR_UNIT)


# All a server gets of the daemon's environment. The rest (a cloud credential, a
# PYTHONPATH, the notify socket) stays out: /proc/PID/environ is readable by every process
# of the server's user, and `nobody` is shared by many daemons.
INHERITED_VARIABLES = ("PATH", "LANG", "LC_ALL")
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def server_environment(engine: Engine, instance: Instance, key: str | None, runs_as: RunAs | None,
                       daemon_environment: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of one server under the process backend: PATH, HOME, the
    locale, the plan's OpenMP variables and the engine's key variable, nothing else."""
    env = {name: daemon_environment[name] for name in INHERITED_VARIABLES if name in daemon_environment}
    env.setdefault("PATH", _DEFAULT_PATH)
    if runs_as is not None:
        env.update(HOME=runs_as.home, USER=runs_as.name, LOGNAME=runs_as.name)
    else:
        env["HOME"] = daemon_environment.get("HOME", "/")
    env.update(instance_environment(instance))
    if key is not None:
        env.update(engine.key_environment(key))  # readable by the child's user only, not argv
    return env


def frontdoor_environment(runs_as: RunAs | None, daemon_environment: Mapping[str, str],
                         listener_fd: int | None = None) -> dict[str, str]:
    """HAProxy's whole environment under the process backend: PATH, the locale, HOME and
    the held socket's number (the one variable its config names). /proc/PID/environ is
    readable by its user (`nobody`, where the packaged user is missing, is shared)."""
    env = {name: daemon_environment[name] for name in INHERITED_VARIABLES if name in daemon_environment}
    env.setdefault("PATH", _DEFAULT_PATH)
    env["HOME"] = runs_as.home if runs_as is not None else daemon_environment.get("HOME", "/")
    if listener_fd is not None:
        env[FD_VARIABLE] = str(listener_fd)
    return env


# Job types that bring the daemon back (systemctl restart, try-restart, reload-or-restart).
RESTART_JOBS = ("restart", "try-restart", "reload-or-restart")

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


class ProcessBackend:
    """Instances as the daemon's own children, pinned between fork and exec."""

    name = "process"
    kind = BackendKind.PROCESS
    instance_cgroups = False  # children share the daemon's cgroup

    def __init__(self, log_dir: Path, logs: InstanceLogs = InstanceLogs.FILE) -> None:
        self.log_dir = log_dir
        self.output = ChildOutput(logs, log_dir)  # instances' and HAProxy's output: files or stdout
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.config: Config | None = None
        self.api_key: str | None = None
        self.runs_as: RunAs | None = None

    def specs(self, config: Config, plan: Plan) -> dict[str, str]:
        key = fingerprint(read_api_key(config, "server.api_key_file"))
        user = instances_run_as(config.server.user, "server.user", self.kind)
        return {i.name: json.dumps({"argv": engine_of(config).argv(config, i), "env": instance_environment(i),
                                    "key": key, "cpus": i.cpus, "mems": i.mems, "policy": i.policy.value,
                                    "user": None if user is None else user.name}, sort_keys=True)
                for i in plan.instances}

    def current_specs(self, config: Config) -> dict[str, str]:
        return {}  # children never outlive the daemon (PDEATHSIG): nothing to adopt

    def sync(self, config: Config, plan: Plan) -> bool:
        self.config = config
        self.api_key = read_api_key(config, "server.api_key_file")
        self.runs_as = instances_run_as(config.server.user, "server.user", self.kind)
        return False

    def start(self, instance: Instance) -> None:
        if self.main_pid(instance.name) is not None:
            return
        assert self.config is not None
        engine = engine_of(self.config)
        argv = engine.argv(self.config, instance)
        env = server_environment(engine, instance, self.api_key, self.runs_as, os.environ)
        switch = self.runs_as.popen_kwargs() if self.runs_as is not None else {}
        cpus, mems, policy = frozenset(instance.cpus), instance.mems, instance.policy
        # Where a seccomp profile refuses set_mempolicy (Kubernetes' RuntimeDefault without
        # CAP_SYS_NICE), trying it in the child would fail every start: the server starts
        # pinned but unbound, its memory placed by first touch from its pinned threads, and
        # `check`/status say so (hostcheck.memory_call_warnings). Probed once, in the daemon.
        bind = pinning.memory_calls().bind_refused is None

        def pin_in_child() -> None:
            # Runs after fork, after the switch to server.user, before exec: the server
            # starts already pinned, so its first allocation (the weights) lands on its
            # own node. (PDEATHSIG is set after the switch, which would clear it.)
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            os.sched_setaffinity(0, cpus)
            if bind:
                pinning.set_mempolicy(policy, mems)

        self.children[instance.name] = self.output.popen(
            instance.name, argv, env=env, stdin=subprocess.DEVNULL, cwd="/",
            preexec_fn=pin_in_child, start_new_session=True, close_fds=True, **switch,
        )
        log.info("%s: started pid %d as %s on CPUs %s, memory node(s) %s", instance.name,
                 self.children[instance.name].pid, "the daemon's user" if self.runs_as is None else self.runs_as.name,
                 format_list(instance.cpus), format_list(instance.mems))

    def stop(self, name: str, timeout_s: float = INSTANCE_STOP_S) -> None:
        child = self.children.pop(name, None)
        if child is None or child.poll() is not None:
            return
        # A SIGSTOPped server ignores SIGTERM until continued.
        for sig in (signal.SIGTERM, signal.SIGCONT):
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                return
        try:
            child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()

    def restart(self, instance: Instance) -> None:
        self.stop(instance.name)
        self.start(instance)

    def main_pid(self, name: str) -> int | None:
        child = self.children.get(name)
        return child.pid if child is not None and child.poll() is None else None

    def observe(self, names: list[str]) -> dict[str, Observation]:
        # start() is synchronous: a child runs or it does not, nothing is pending.
        return {n: Observation(self.main_pid(n), False, self.describe(n)) for n in names}

    def describe(self, name: str) -> str:
        child = self.children.get(name)
        if child is None:
            return "inactive"
        code = child.poll()
        return "active (running)" if code is None else f"failed (exit {code})"

    def stop_all_on_exit(self) -> bool:
        return True

    def forget(self, config: Config) -> None:
        pass  # nothing on disk

    def frontdoor_runner(self, run_dir: Path) -> FrontdoorRunner:
        runs_as = frontdoor_runs_as(self.kind)  # None: the daemon is not root, and haproxy runs as its user
        if runs_as is not None and runs_as.fallback:
            log.warning("front door: %s", runs_as.fallback)
        return ProcessFrontdoorRunner(run_dir, self.output, runs_as)


class ProcessFrontdoorRunner:
    """HAProxy as the daemon's child, in master-worker mode (-W): SIGUSR2 reloads seamlessly.

    A root daemon starts it as `runs_as` (identity.frontdoor_runs_as), master and workers
    alike: the master re-executes itself on every reload, so it must never be root. Its
    admin socket sits in `<run dir>/frontdoor/`, HAProxy's own directory (mode 0700): only
    HAProxy and the root daemon reach it. A daemon that is not root cannot switch: HAProxy
    runs as the daemon's user, in a directory of the daemon's.
    """

    restarted_by_manager = False  # the daemon starts it again (Frontdoor.observe)

    def __init__(self, run_dir: Path, output: ChildOutput, runs_as: RunAs | None) -> None:
        self.run_dir = run_dir
        self.socket_path = run_dir / SOCKET_DIR_NAME / "admin.sock"
        self.output = output
        self.runs_as = runs_as
        self.child: subprocess.Popen[bytes] | None = None
        # The daemon holds the port; HAProxy, killed or restarted, finds the same socket.
        self.listener = HeldListener()

    def running(self) -> bool:
        return self.child is not None and self.child.poll() is None

    def _socket_dir(self) -> None:
        """HAProxy's directory, made (or taken back) for it: never through a link."""
        directory = self.socket_path.parent
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise HaproxyError(f"{directory} (the front door's socket directory) is not a directory "
                               f"({exc.strerror}): remove it; the daemon makes it") from None
        try:
            if self.runs_as is not None:
                assert self.runs_as.uid is not None and self.runs_as.gid is not None
                os.fchown(fd, self.runs_as.uid, self.runs_as.gid)
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)

    def start(self, binary: str, config_path: Path) -> None:
        listener_fd = self.listener.fd
        if self.runs_as is not None:
            reason = unreadable_reason(str(config_path), self.runs_as)
            if reason is not None:
                raise HaproxyError(f"haproxy runs as {self.runs_as.name}, who cannot read {config_path}: {reason}; "
                                   "or choose a --state-file in a directory that user can reach")
        self._socket_dir()
        # -db: stay in the foreground; the master dies with the daemon (PDEATHSIG).
        try:
            self.child = self.output.popen(
                "frontdoor", [binary, "-W", "-db", "-f", str(config_path)],
                env=frontdoor_environment(self.runs_as, os.environ, listener_fd),
                stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True, cwd="/",
                pass_fds=() if listener_fd is None else (listener_fd,),
                preexec_fn=switch_user(self.runs_as),
            )
        except (OSError, subprocess.SubprocessError) as exc:  # the switch failed, or no binary
            raise HaproxyError(f"cannot start {binary}: {exc}") from None
        log.info("front door: haproxy master pid %d as %s", self.child.pid,
                 f"the daemon's user (uid {os.geteuid()}: not root, it cannot switch)" if self.runs_as is None
                 else self.runs_as.name)

    def reload(self) -> None:
        if self.running():
            assert self.child is not None
            os.kill(self.child.pid, signal.SIGUSR2)

    def stop(self, timeout_s: float = FRONTDOOR_STOP_S) -> None:
        if not self.running():
            return
        assert self.child is not None
        self.child.terminate()
        try:
            self.child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.child.pid, signal.SIGKILL)
            self.child.wait()

