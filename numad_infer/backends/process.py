"""The process backend (no systemd): instances as the daemon's own children, pinned between
fork and exec, each given an environment of its own; HAProxy as a child in master-worker
mode, behind a listening socket the daemon holds."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

from numad_infer.backends.base import Observation
from numad_infer.backends.childlog import ChildOutput, InstanceLogs
from numad_infer.config.apikey import fingerprint
from numad_infer.config.defaults import FRONTDOOR_STOP_S, INSTANCE_STOP_S
from numad_infer.config.schema import Config
from numad_infer.engines import Engine
from numad_infer.engines.launch import Launch, launch_of
from numad_infer.engines.slot_cache import make_slot_directory
from numad_infer.engines.slot_names import gives_slot_path
from numad_infer.frontdoor.control import FrontdoorRunner
from numad_infer.frontdoor.haproxy import HaproxyError
from numad_infer.frontdoor.listener import HeldListener
from numad_infer.host import pinning
from numad_infer.host.identity import BackendKind, RunAs, frontdoor_runs_as, unreadable_reason
from numad_infer.host.privdrop import switch_user
from numad_infer.plan.model import Instance
from numad_infer.util.cpuset import format_list
from numad_infer.validate.loaded import Loaded

log = logging.getLogger(__name__)

SOCKET_DIR_NAME = "frontdoor"  # process backend: HAProxy's own directory in the run directory


# All a server gets of the daemon's environment. The rest (a cloud credential, a
# PYTHONPATH, the notify socket) stays out: /proc/PID/environ is readable by every process
# of the server's user, and `nobody` is shared by many daemons.
INHERITED_VARIABLES = ("PATH", "LANG", "LC_ALL")
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def server_environment(engine: Engine, launch: Launch, key: str | None, runs_as: RunAs | None,
                       daemon_environment: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of one server under the process backend: PATH, HOME, the
    locale, the plan's OpenMP variables and the engine's key variable, nothing else."""
    env = {name: daemon_environment[name] for name in INHERITED_VARIABLES if name in daemon_environment}
    env.setdefault("PATH", _DEFAULT_PATH)
    if runs_as is not None:
        env.update(HOME=runs_as.home, USER=runs_as.name, LOGNAME=runs_as.name)
    else:
        env["HOME"] = daemon_environment.get("HOME", "/")
    env.update(launch.environment)
    if key is not None:
        env.update(engine.key_environment(key))  # readable by the child's user only, not argv
    return env


def frontdoor_environment(runs_as: RunAs | None, daemon_environment: Mapping[str, str],
                         listener_fds: Mapping[str, int] | None = None) -> dict[str, str]:
    """HAProxy's whole environment under the process backend: PATH, the locale, HOME and
    the held sockets' numbers (the variables its config names). /proc/PID/environ is
    readable by its user (`nobody`, where the packaged user is missing, is shared)."""
    env = {name: daemon_environment[name] for name in INHERITED_VARIABLES if name in daemon_environment}
    env.setdefault("PATH", _DEFAULT_PATH)
    env["HOME"] = runs_as.home if runs_as is not None else daemon_environment.get("HOME", "/")
    env.update({name: str(fd) for name, fd in (listener_fds or {}).items()})
    return env


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


class ProcessBackend:
    """Instances as the daemon's own children, pinned between fork and exec."""

    name = "process"
    kind = BackendKind.PROCESS
    instance_cgroups = False  # children share the daemon's cgroup
    surge_refusal: str | None = None  # starts copies for a surge (start_copy)
    copy_cgroup: str | None = None  # a copy is the daemon's child, in the daemon's cgroup

    def __init__(self, log_dir: Path, logs: InstanceLogs = InstanceLogs.FILE, slots_dir: Path | None = None) -> None:
        self.log_dir = log_dir
        self.slots_dir = slots_dir  # STATE_DIR/slots: prompt caches kept across restarts (supervision/slot_keeper)
        self.output = ChildOutput(logs, log_dir)  # instances' and HAProxy's output: files or stdout
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        # What the next starts use: the daemon's one value as it was last synced (a reference,
        # never a copy or a part of it), as the systemd backend's units on disk are its own.
        self.loaded: Loaded | None = None

    def specs(self, loaded: Loaded) -> dict[str, str]:
        key, user = fingerprint(loaded.api_key), loaded.runs_as
        return {i.name: json.dumps({"argv": list(loaded.launches[i.name].argv),
                                    "env": loaded.launches[i.name].env, "key": key,
                                    "artifacts": loaded.artifacts_of(i.name), "cpus": i.cpus, "mems": i.mems,
                                    "policy": i.policy.value, "user": None if user is None else user.name},
                                   sort_keys=True)
                for i in loaded.plan.instances}

    def current_specs(self, loaded: Loaded) -> dict[str, str]:
        return {}  # children never outlive the daemon (PDEATHSIG): nothing to adopt

    def sync(self, loaded: Loaded) -> bool:
        # What the next starts use: the validated value, never the files read again. Its
        # user must have been worked out for this backend (a systemd DynamicUser is not one).
        if loaded.kind != BackendKind.PROCESS:
            raise ValueError(f"the process backend was given a configuration validated for {loaded.kind.value}")
        self.loaded = loaded
        return False

    def start(self, instance: Instance) -> None:
        if self.main_pid(instance.name) is not None:
            return
        loaded = self._synced(instance.name)
        launch = loaded.launches[instance.name]
        self._spawn(loaded, instance, launch, self._slot_save(loaded.engine, instance.name, launch.argv,
                                                              loaded.runs_as))

    def start_copy(self, copy: Instance) -> None:
        """A copy of one of the plan's instances under another name and port, for a surge
        (supervision/surge.py): its launch is the instance's (the same pinning, model file
        and engine arguments) but for the port; no saved prompt cache (it lives for one restart)."""
        loaded = self._synced(copy.name)
        self._spawn(loaded, copy, launch_of(loaded.engine, loaded.model(copy.model).served, copy), [])

    def _synced(self, name: str) -> Loaded:
        if self.loaded is None:
            raise ValueError(f"{name}: the process backend was given no configuration (sync) to start it")
        return self.loaded

    def _spawn(self, loaded: Loaded, instance: Instance, launch: Launch, extra: list[str]) -> None:
        runs_as = loaded.runs_as
        argv = list(launch.argv) + extra
        env = server_environment(loaded.engine, launch, loaded.api_key, runs_as, os.environ)
        switch = runs_as.popen_kwargs() if runs_as is not None else {}
        cpus, mems, policy = frozenset(instance.cpus), instance.mems, instance.policy
        # Where a seccomp profile refuses set_mempolicy (Kubernetes' RuntimeDefault without
        # CAP_SYS_NICE), trying it in the child would fail every start: the server starts
        # pinned but unbound, its memory placed by first touch from its pinned threads, and
        # `check`/status say so (host_check.memory_call_warnings). Probed once, in the daemon.
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
        log.info("%s: started pid %d as %s on CPUs %s, memory node(s) %s, port %d", instance.name,
                 self.children[instance.name].pid, "the daemon's user" if runs_as is None else runs_as.name,
                 format_list(instance.cpus), format_list(instance.mems), instance.port)

    def _slot_save(self, engine: Engine, name: str, argv: tuple[str, ...], runs_as: RunAs | None) -> list[str]:
        """The engine's --slot-save-path: the instance's own directory, mode 700, its user's;
        none where the operator named one (server.extra_args) or the engine has none."""
        option = engine.slot_save_option
        if self.slots_dir is None or option is None or not gives_slot_path(option, argv):
            return []
        owner = (-1, -1)  # a daemon that is not root: its servers are itself
        if runs_as is not None and runs_as.uid is not None and runs_as.gid is not None and os.geteuid() == 0:
            owner = (runs_as.uid, runs_as.gid)
        try:
            where = make_slot_directory(self.slots_dir, name, *owner)
        except OSError as exc:
            log.warning("%s: no directory for its saved prompt cache (%s): restarts start it cold", name, exc)
            return []
        return [option, f"{where}/"]

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
        uid = os.geteuid() if runs_as is None or runs_as.uid is None else runs_as.uid
        self.haproxy_uids = frozenset({0, uid})
        self.haproxy_gid = None if runs_as is None else runs_as.gid
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
        listener_fds = self.listener.fds
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
                env=frontdoor_environment(self.runs_as, os.environ, listener_fds),
                stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True, cwd="/",
                pass_fds=tuple(listener_fds.values()),
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

    def hand_back(self) -> None:
        pass  # no systemd here to keep the port once the daemon is gone

