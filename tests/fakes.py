"""The stand-ins the unit tests share, in one place: a backend that records calls, the
front door's runtime API, a /proc reader, a small machine, and the pipeline's value built
from a configuration and a plan without the machine checks (tests that need those run
`validate/pipeline.validate`). Each stands in only for what the unit under test does not
own; the end-to-end tests run the real thing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from numad_infer.backends.base import Observation
from numad_infer.config.load import parse_config
from numad_infer.config.schema import Config
from numad_infer.engines import Engine, engine_of
from numad_infer.frontdoor.haproxy import AdminState
from numad_infer.host.cpufeatures import EngineCpuReport
from numad_infer.host.identity import BackendKind, RunAs
from numad_infer.host.pinning import MemoryCalls
from numad_infer.host.portowner import Holder, Listeners, PortOwner
from numad_infer.model.memory import MemoryEstimate
from numad_infer.config.models import ServedModel, served_models
from numad_infer.plan.model import Plan
from numad_infer.topology.cgroup_limits import UNRESTRICTED
from numad_infer.topology.model import RawCpu, RawNode, SysfsSnapshot, Topology, build_topology
from numad_infer.engines.launch import launches
from numad_infer.supervision.health import ProbeResult
from numad_infer.units.render import render_units
from numad_infer.validate.loaded import Loaded, LoadedModel


def served_of(config: Config) -> tuple[ServedModel, ...]:
    """The models `config` serves, worked out as one load does (validate/pipeline.validate):
    what make_plan, render_units and render_haproxy take as `served`."""
    return served_models(config)


def load_of(config: Config) -> tuple[tuple[ServedModel, ...], Engine]:
    """(served, engine) of `config`, each worked out once, as one load does: what
    render_units, render_haproxy and sections take as `served` and `engine`."""
    return served_models(config), engine_of(config)


def loaded_for(config: Config, plan: Plan, *, api_key: str | None = None, kind: BackendKind = BackendKind.PROCESS,
               runs_as: RunAs | None = None, topology: Topology | None = None) -> Loaded:
    """What `validate` would return for `config` and `plan`, without reading the host: the
    key as given (not read from a file), units rendered as the systemd backend writes them."""
    served, engine = load_of(config)
    launched = launches(engine, served, plan)
    units = render_units(config, plan, served=served, launched=launched, engine=engine) \
        if kind == BackendKind.SYSTEMD else {}
    models = tuple(LoadedModel(model, 0, MemoryEstimate(0, 0, 0), 0) for model in served)
    return Loaded("/etc/numa-infer.toml", config, topology or three_nodes(), plan, kind, runs_as, engine,
                  models, UNRESTRICTED, EngineCpuReport(None, "test", ""), (), api_key, None, units, launched)


@dataclass
class RecordingBackend:
    """Records calls; stands in for systemd/processes to test the reconcile logic alone."""

    name: str = "recording"
    instance_cgroups: bool = False
    slots_dir: Path | None = None  # no kept prompt caches
    surge_refusal: str | None = "this backend starts no copies"  # a restart holds
    copy_cgroup: str | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)
    running: dict[str, int] = field(default_factory=dict)
    next_pid: int = 100

    def specs(self, loaded: Loaded) -> dict[str, str]:
        return {i.name: repr(i) for i in loaded.plan.instances}

    def current_specs(self, loaded: Loaded) -> dict[str, str]:
        return {}

    def sync(self, loaded: Loaded) -> bool:
        return False

    def start(self, instance) -> None:
        if instance.name not in self.running:
            self.calls.append(("start", instance.name))
            self.running[instance.name] = self.next_pid = self.next_pid + 1

    def stop(self, name: str) -> None:
        self.calls.append(("stop", name))
        self.running.pop(name, None)

    def restart(self, instance) -> None:
        self.calls.append(("restart", instance.name))
        self.running[instance.name] = self.next_pid = self.next_pid + 1

    def observe(self, names):
        return {n: Observation(self.running.get(n), False, "active" if n in self.running else "inactive") for n in names}

    def stop_all_on_exit(self) -> bool:
        return True

    def forget(self, config) -> None:
        self.calls.append(("forget", ""))


def three_nodes():
    return build_topology(SysfsSnapshot(
        online_cpus=frozenset(range(3)), cpus={c: RawCpu() for c in range(3)},
        nodes={n: RawNode(frozenset({n}), 1 << 30, tuple(10 if m == n else 20 for m in range(3))) for n in range(3)}))


def cfg(extra: str = ""):
    return parse_config(f'[model]\npath = "/m.gguf"\n{extra}', "/etc/numa-infer.toml")


class FakeFrontdoor:
    """Stands in for HAProxy's runtime API: requests in flight per instance, admin states set."""

    listen = "127.0.0.1:8000"

    def __init__(self) -> None:
        self.in_flight_by: dict[str, int] = {}
        self.states: list[tuple[str, AdminState]] = []
        self.model_stats: dict = {}  # nothing read: no surge or hold is chosen (supervision/surge.py)
        self.stats = None
        self.backends: dict[str, str] = {}

    def observe(self):
        return None

    def in_flight(self, instance) -> int | None:
        return self.in_flight_by.get(instance.name, 0)

    def set_state(self, instance, state: AdminState) -> None:
        self.states.append((instance.name, state))


class FakeProc:
    """CPU seconds per pid, advanced by the test (the real reader is psutil on /proc)."""

    def __init__(self) -> None:
        self.cpu: dict[int, float] = {}

    def cpu_seconds(self, pid: int) -> float | None:
        return self.cpu.get(pid)

    def threads(self, pid: int):
        return []

    def numa_maps(self, pid: int):
        return None

    def port_owner(self, host: str, port: int, pid: int, table: Listeners | None = None) -> PortOwner:
        return PortOwner(Holder.INSTANCE)  # no server listens in these tests: the probe stands in for one

    def listeners(self) -> Listeners:
        return Listeners(())

    def open_connections(self, port: int, pid: int) -> int:
        return getattr(self, "connections", {}).get(port, 0)


def answering_probe(host: str, port: int, timeout: float, path: str) -> ProbeResult:
    """Reconciler(probe=...) where no server listens: every instance answers its probe."""
    return ProbeResult(True, 0.001)


def private_key(directory: Path, key: str) -> Path:
    """An API key file as `server.api_key_file` must be: root's, mode 0600, in a 0700 directory."""
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / "api-key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


class StandInPinner:
    """Stands in for the calls a repair makes (host/pinning.py, drift_checks.Pinner): these
    hosts have one node, where nothing can drift. `migrate`: what migrate_pages does (none
    given: calling it fails the test); `calls`: what the seccomp probe says (all allowed)."""

    def __init__(self, migrate: Callable[[int, tuple[int, ...], tuple[int, ...]], int] | None = None,
                 calls: MemoryCalls | None = None) -> None:
        self.migrate, self.calls = migrate, calls or MemoryCalls(None, None)
        self.pinned: list[tuple[int, frozenset[int]]] = []

    def set_thread_affinity(self, tid: int, cpus: frozenset[int]) -> bool:
        self.pinned.append((tid, cpus))
        return True

    def migrate_pages(self, pid: int, from_nodes: tuple[int, ...], to_nodes: tuple[int, ...]) -> int:
        if self.migrate is None:
            raise AssertionError(f"migrate_pages called for pid {pid}")
        return self.migrate(pid, from_nodes, to_nodes)

    def memory_calls(self) -> MemoryCalls:
        return self.calls
