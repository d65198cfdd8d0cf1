"""Run the real daemon (process backend) with real llama-cpp-python servers on a tiny model."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from tests import fakesys

ROOT = Path(__file__).resolve().parents[1]


# -- what the servers run as ------------------------------------------------------------------
# Run as root (CI), the daemon drops its servers to server.user (numa-infer, or nobody where
# that user does not exist): the interpreter,
# llama-cpp-python and the model must then be readable by it, as on a real host. pytest's
# temporary directories are private (0700) and this venv's interpreter may live under /root,
# so the servers get a world-readable directory of their own with the model and, where
# needed, a bridge venv: the system interpreter of the same Python version (same ABI) with
# a .pth file naming this venv's site-packages.

_shared: Path | None = None


def shared_dir() -> Path:
    """One world-readable (0755) scratch directory per test session."""
    global _shared
    if _shared is None:
        import atexit
        import shutil
        import tempfile
        _shared = Path(tempfile.mkdtemp(prefix="numa-infer-shared-"))
        _shared.chmod(0o755)
        atexit.register(shutil.rmtree, _shared, True)
    return _shared


def run_dir(tmp: Path) -> Path:
    """The daemon's state directory. Run as root, the daemon starts HAProxy as its own
    user (numa-infer-frontdoor, or nobody), which must read haproxy.cfg there, as it does
    in /run/numa-infer: so not under pytest's private (0700) directories."""
    if os.geteuid() != 0:
        return tmp / "run"
    import tempfile
    path = Path(tempfile.mkdtemp(prefix="run-", dir=shared_dir()))
    path.chmod(0o755)
    return path


def _runnable_by_others(path: Path) -> bool:
    path = path.resolve()
    return all(os.stat(d).st_mode & 0o001 for d in path.parents) and bool(os.stat(path).st_mode & 0o001)


def server_python() -> str:
    """An interpreter with llama_cpp that the servers' user can run."""
    if os.geteuid() != 0 or _runnable_by_others(Path(sys.executable)):
        return sys.executable
    bridge = shared_dir() / "server-venv"
    if not (bridge / "bin" / "python").exists():
        version = "%d.%d" % sys.version_info[:2]
        system = Path(f"/usr/bin/python{version}")
        if not system.exists():
            raise RuntimeError(f"running as root, the servers run as nobody and need an interpreter nobody can "
                               f"run: {sys.executable} is not, and there is no {system} to bridge to")
        subprocess.run([str(system), "-m", "venv", "--without-pip", str(bridge)], check=True)
        import site
        (bridge / "lib" / f"python{version}" / "site-packages" / "numa-infer-tests.pth").write_text(
            "\n".join(site.getsitepackages()) + "\n")
        subprocess.run(["chmod", "-R", "a+rX", str(bridge)], check=True)
    return str(bridge / "bin" / "python")


_llama_server: Path | None = None


def llama_server_binary() -> Path:
    """llama.cpp's llama-server, built from the pinned sdist's vendored tree (cached by
    scripts/build-llama-server), copied where the servers' user can run it: the whole build
    directory, since the binary loads libllama/libggml and one libggml-cpu-<variant>.so
    from beside itself."""
    global _llama_server
    if _llama_server is None:
        built = Path(subprocess.run([str(ROOT / "scripts/build-llama-server")], check=True, capture_output=True,
                                    text=True, cwd=ROOT).stdout.strip().splitlines()[-1])
        import shutil
        engine_dir = shared_dir() / "llama-engine"
        shutil.copytree(built.parent, engine_dir, dirs_exist_ok=True)
        subprocess.run(["chmod", "-R", "a+rX", str(engine_dir)], check=True)
        _llama_server = engine_dir / "llama-server"
    return _llama_server


def llama_tool(name: str) -> Path:
    """llama-bench or llama-quantize from the same build as llama_server_binary()."""
    return llama_server_binary().parent / name


ENGINES = ("llama-cpp-python", "llama-server")


def with_server_keys(toml: str, keys: str) -> str:
    """`toml` with `keys` in its [server] table (added at the end when it has none)."""
    return toml.replace("[server]\n", "[server]\n" + keys, 1) if "[server]\n" in toml else f"{toml}\n[server]\n{keys}"


def engine_keys(engine: str, python: str | None = None) -> str:
    """The [server] keys that choose an engine, for a test config (`python`: the
    interpreter llama-cpp-python's server runs in; server_python() by default)."""
    if engine == "llama-server":
        return f'engine = "llama-server"\nllama_server = "{llama_server_binary()}"\n'
    return f'engine = "llama-cpp-python"\npython = "{python or server_python()}"\n'


_models: dict[str, Path] = {}


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_handed_out: set[int] = set()


def free_port_block(count: int, also: tuple[int, ...] = ()) -> int:
    """A base port such that base..base+count-1 and base+k for k in `also` are free now (and
    not handed to another run of this session): instances take base_port + k."""
    import random
    # Below the kernel's ephemeral range: there a client socket (HAProxy's connection to an
    # instance, a test's own request, a guest's traffic) may take the port between this
    # check and the server's bind, and the server then fails or a stranger answers on it.
    top = min(_ephemeral_low(), 60000)
    for _ in range(200):
        base = random.randrange(10000, top - max((count, *also)))
        ports = [*range(base, base + count), *(base + k for k in also)]
        if not _handed_out.intersection(ports) and all(_port_free(p) for p in ports):
            _handed_out.update(ports)
            return base
    raise RuntimeError("no free block of ports on 127.0.0.1")


def free_port() -> int:
    """One free port below the ephemeral range (free_port_block says why), for one listener."""
    return free_port_block(1)


def door_settled(state: dict[str, Any], required: bool = False) -> bool:
    """The front door (when there is one, or `required`) answers, and routes by the plan the
    status shows: no reload still pending (a removed model would still be served)."""
    front = state.get("frontdoor")
    if front is None:
        return not required
    return bool(front["up"]) and not front.get("reloading")


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = 20.0,
             detail: Callable[[], str] = lambda: "", interval_s: float = 0.05) -> None:
    """Poll `condition` until it is true; AssertionError naming `what` after `timeout_s`.
    An OSError or HaproxyError from it counts as not yet (a server not listening yet, an
    admin socket not there yet). `detail` is called only on the timeout: logs as they are
    then, not when the wait began."""
    from numad_infer.frontdoor.haproxy import HaproxyError
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        try:
            if condition():
                return
        except (OSError, HaproxyError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last error: {last!r})\n{detail()}")
        time.sleep(interval_s)


def generated_model(size: str, quant: str | None = None) -> Path:
    """tools/make_model.py's model of that size (quantized to `quant`: Q4_0, Q8_0, Q4_K_M),
    once per session, readable by the servers."""
    name = size if quant is None else f"{size}-{quant}"
    if name not in _models:
        path = _model_cache(name) or shared_dir() / f"{name}.gguf"
        if not path.exists():
            quant_args = [] if quant is None else ["--quant", quant]
            subprocess.run([sys.executable, str(ROOT / "tools/make_model.py"), str(path), "--size", size,
                            *quant_args], check=True, capture_output=True)
            path.chmod(0o644)
        _models[name] = path
    return _models[name]


def _model_cache(name: str) -> Path | None:
    """Where NUMA_INFER_MODEL_CACHE keeps models between sessions (the benches' 1b and 8b
    take minutes to make), named by what makes them: a changed tools/make_model.py makes a
    new file. None without it (tests make theirs per session)."""
    where = os.environ.get("NUMA_INFER_MODEL_CACHE")
    if not where:
        return None
    import hashlib
    digest = hashlib.sha256((ROOT / "tools/make_model.py").read_bytes()).hexdigest()[:12]
    Path(where).mkdir(parents=True, exist_ok=True)
    return Path(where) / f"{name}-{digest}.gguf"


def two_single_cpu_nodes() -> fakesys.FakeMachine:
    """Stands in for a 2-node machine on a 2-CPU host: node 0 = CPU 0, node 1 = CPU 1.

    Node 1 has no memory of its own, so its instance binds to node 0, which exists on
    every host; the pinning in the child (affinity + set_mempolicy) is therefore real.
    """
    return fakesys.FakeMachine(
        nodes={0: fakesys.FakeNode((0,), 4 * fakesys.GiB_KB, (10, 20)), 1: fakesys.FakeNode((1,), 0, (20, 10))},
        siblings=((0,), (1,)), l3=((0,), (1,)), offline=(),
    )


class NotifyListener:
    """A real AF_UNIX datagram socket standing where systemd's would be."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._read = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.messages.append((time.monotonic(), data.decode()))
                self._read += 1

    def _settle(self, timeout_s: float = 5.0) -> None:
        """Wait until every datagram sent so far is read: a daemon that notified and exited
        has put its last message in the socket's buffer, which the reader thread, on a
        loaded machine, may not have taken yet (a test that asserted at once failed so)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.sock.fileno() >= 0:  # closed: all read (close joins the reader)
            with self._lock:
                read = self._read
            if not select.select([self.sock], [], [], 0)[0]:
                time.sleep(0.02)  # one being appended now is counted once it is
                with self._lock:
                    if self._read == read and not select.select([self.sock], [], [], 0)[0]:
                        return
            time.sleep(0.01)

    def fields(self) -> list[str]:
        self._settle()
        with self._lock:
            return [f for _, m in self.messages for f in m.split("\n")]

    def close(self) -> None:
        self._settle(2.0)  # what the daemon sent before it exited (STOPPING=1) is kept
        self._stop = True
        self._thread.join(1)
        self.sock.close()


class DaemonRun:
    def __init__(self, tmp: Path, model: Path, placement: str = "", monitor: str = "", env: dict[str, str] | None = None,
                 machine: fakesys.FakeMachine | None = None, extra_config: str = "", interval_s: float = 0.5,
                 backoff_s: float = 0.2, frontend: str | None = None, context_size: int = 256,
                 engine: str = "llama-cpp-python", cgroup: Path | None = None, run_args: tuple[str, ...] = (),
                 seccomp_refuse: tuple[str, ...] = (), models: str = "", python: str | None = None,
                 tuning: str = "") -> None:
        """`cgroup`: a cgroup v1 directory (a cpuset) the daemon, and so its servers, start in.
        `python`: the interpreter llama-cpp-python's servers run in (server_python()).
        `run_args`: more options for `numa-infer run`.
        `tuning`: more [tuning] keys (the harness sets the monitor's there).
        `seccomp_refuse`: system calls a real seccomp filter refuses (EPERM) to the daemon and
        everything it starts, as a container runtime's profile does (tests/seccomp.py)."""
        self.tmp = tmp
        self.model = model
        self.fsroot = fakesys.write_tree(tmp / "fs", machine or two_single_cpu_nodes())
        self.state_file = run_dir(tmp) / "state.json"
        self.config = tmp / "numa-infer.toml"
        self.base_port = free_port_block(8, also=(500,))
        self.extra_config = extra_config
        self.tuning = tuning
        self.context_size = context_size
        self.server_extra = ""  # more [server] keys
        self.engine, self.python = engine, python
        self.models = models  # [[models]] tables instead of [model] ("{model}" stands for the model's path)
        # The front door on a port of its own per run (tests may run while another daemon does).
        self.frontend_port = self.base_port + 500
        # `frontend`: the [frontend] keys; "{port}" stands for that port.
        self.frontend = (frontend if frontend is not None else 'listen = "127.0.0.1:{port}"\n').replace(
            "{port}", str(self.frontend_port))
        self.interval_s, self.backoff_s = interval_s, backoff_s
        self.write_config(placement, monitor)
        self.notify = NotifyListener(tmp / "notify.sock")
        self.env = dict(os.environ, NOTIFY_SOCKET=str(self.notify.path), **(env or {}))
        self.log = open(tmp / "daemon.log", "w")
        self.cgroup = cgroup
        self.run_args = run_args
        self.seccomp_refuse = seccomp_refuse
        self.proc = self.spawn()

    def spawn(self) -> subprocess.Popen:
        """Start the daemon (again: what a supervisor does after it died)."""
        cgroup, refuse = self.cgroup, self.seccomp_refuse

        def confine() -> None:
            if cgroup is not None:
                (cgroup / "tasks").write_text(str(os.getpid()))
            if refuse:
                from tests import seccomp
                seccomp.refuse(refuse)

        return subprocess.Popen(
            [sys.executable, "-m", "numad_infer", "--config", str(self.config), "--fsroot", str(self.fsroot),
             "--state-file", str(self.state_file), "run", "--backend", "process", *self.run_args],
            stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
            preexec_fn=confine if cgroup is not None or refuse else None,
        )

    def write_config(self, placement: str = "", monitor: str = "", extra: str = "") -> None:
        model = (self.models.replace("{model}", str(self.model)) if self.models
                 else f'[model]\npath = "{self.model}"\ncontext_size = {self.context_size}\n')
        self.config.write_text(
            f"{model}[placement]\n{placement}\n"
            f'[server]\nbase_port = {self.base_port}\n{engine_keys(self.engine, self.python)}{self.server_extra}\n'
            f"[monitor]\ninterval_s = {self.interval_s}\nstartup_grace_s = 60\n{monitor}\n"
            f"[tuning]\nprobe_timeout_s = 1.0\nunhealthy_after = 2\nrestart_backoff_s = {self.backoff_s}\n"
            f"numa_maps_interval_s = 1\n{self.tuning}\n"
            f"[frontend]\n{self.frontend}\n{extra or self.extra_config}"
        )

    def state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None

    def wait(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 60, what: str = "") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.state()
            if state is not None and predicate(state):
                return state
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited ({self.proc.returncode}):\n{self.logs()}")
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; last state: {json.dumps(state, indent=1)}\n{self.logs()}")

    def all_healthy(self, count: int, timeout: float = 90) -> dict[str, Any]:
        """`count` healthy instances, and the front door up when there is one (llama-server
        loads the tiny model before haproxy has started)."""
        return self.wait(lambda s: len(s["instances"]) == count and all(i["state"] == "healthy" for i in s["instances"])
                         and door_settled(s), timeout, f"{count} healthy instances")

    def instance(self, state: dict[str, Any], name: str) -> dict[str, Any]:
        return next(i for i in state["instances"] if i["name"] == name)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "numad_infer", "--config", str(self.config), "--fsroot", str(self.fsroot),
                               "--state-file", str(self.state_file), *args], capture_output=True, text=True, cwd=ROOT)

    def logs(self) -> str:
        self.log.flush()
        return (self.tmp / "daemon.log").read_text()[-6000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.notify.close()
        self.log.close()
        return self.proc.returncode


@contextmanager
def daemons(tmp_path: Path, model: Path) -> Iterator[Callable[..., DaemonRun]]:
    """A factory of DaemonRuns for one test; every daemon and server is gone afterwards."""
    runs: list[DaemonRun] = []

    def start(**kwargs) -> DaemonRun:
        (tmp_path / f"d{len(runs)}").mkdir()
        run = DaemonRun(tmp_path / f"d{len(runs)}", model, **kwargs)
        runs.append(run)
        return run

    try:
        yield start
    finally:
        for run in runs:
            pids = [i["pid"] for i in (run.state() or {"instances": []})["instances"] if i.get("pid")]
            for pid in pids:  # a SIGSTOPped server ignores SIGTERM until continued
                _signal(pid, signal.SIGCONT)
            run.stop()
            for pid in pids:  # never leave a server behind, even when a test failed
                _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
