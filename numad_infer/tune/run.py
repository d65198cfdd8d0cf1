"""`numa-infer tune`, the measuring part: real servers of the configured engine on the
real topology with the configured model, one candidate at a time, pinned and bound the
way the daemon would run them (the process backend's start), and the bandwidth matrix.

A running fleet is not taken down: each node's instance is held (`holds.py`) while that
node is measured, so the daemon drains it out of the front door, stops it, and brings it
back when the hold goes away (at the end, on Ctrl-C, or when tune dies: a hold names its
holder's PID). Without a front door a hold would cut that node's clients off, so tune
refuses unless told `--stop-instances`.
"""

from __future__ import annotations

import http.client
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from numad_infer.backends.process import ProcessBackend
from numad_infer.config.apikey import read_api_key
from numad_infer.config.schema import Config
from numad_infer.engines import engine_of
from numad_infer.errors import NumaInferError
from numad_infer.host import pinning
from numad_infer.host.identity import BackendKind
from numad_infer.host.portowner import Holder
from numad_infer.host.procfs import ProcReader
from numad_infer.model.gguf import stop_token_ids
from numad_infer.plan.placement import Instance, make_plan, reserved_cores, unreserved_cores
from numad_infer.supervision.health import probe
from numad_infer.topology.cgroup_limits import within
from numad_infer.topology.model import Topology
from numad_infer.tune import bandwidth
from numad_infer.tune import bandwidth_file as bandwidthfile
from numad_infer.tune.choice import Candidate, Figure, Layout, LayoutResult, Report, Result, percentile
from numad_infer.util.addresses import connect_host

if TYPE_CHECKING:
    from numad_infer.tune.config_edit import Edit

log = logging.getLogger(__name__)

# Prompt processing is measured on this many words (~1.3 tokens each with the generated
# models' vocabulary); decoding on --tokens generated tokens minus one.
PROMPT_WORDS = 200


class TuneError(NumaInferError):
    """A measurement that could not be made; `cli.cmd_tune` says so as `numa-infer tune: ...`."""


@dataclass(frozen=True)
class Settings:
    samples: int  # repeats of every figure
    tokens: int  # generated per decode sample
    startup_timeout_s: float


def candidate_config(config: Config, node: int, threads: int, port: int, smt: bool) -> Config:
    """The configuration of one measuring server: the node's instance as the daemon would
    plan it, with `threads` for both thread counts, on a port of tune's own. `smt`: with
    the SMT siblings among its CPUs (needed for more threads than physical cores)."""
    placement = config.placement.model_copy(update={"nodes": [node], "mode": "per-node", "instances_per_node": 1,
                                                      "threads": threads, "threads_batch": threads, "smt": smt})
    server = config.server.model_copy(update={"base_port": port})
    frontend = config.frontend.model_copy(update={"listen": ""})
    return config.model_copy(update={"placement": placement, "server": server, "frontend": frontend})


class Measurer:
    def __init__(self, config: Config, topology: Topology, model_size: int, log_dir: Path, settings: Settings,
                 progress: Callable[[str], None]) -> None:
        self.config, self.topology, self.model_size = config, topology, model_size
        self.log_dir, self.settings, self.progress = log_dir, settings, progress
        self.key = read_api_key(config, "server.api_key_file")
        self.proc = ProcReader()
        self.no_stop = engine_of(config).no_stop_fields(stop_token_ids(config.model.path))

    def instance_for(self, node: int, threads: int, port: int) -> tuple[Config, Instance]:
        physical = len(self._plan(candidate_config(self.config, node, 1, port, smt=False)).cpus)
        cfg = candidate_config(self.config, node, threads, port, smt=self.config.placement.smt or threads > physical)
        return cfg, self._plan(cfg)

    def _plan(self, cfg: Config) -> Instance:
        (instance,) = make_plan(cfg, self.topology, self.model_size, source="tune").instances
        return instance

    def measure(self, node: int, candidate: Candidate, port: int) -> Result:
        cfg, instance = self.instance_for(node, candidate.threads, port)
        backend = ProcessBackend(self.log_dir)
        backend.sync(cfg, make_plan(cfg, self.topology, self.model_size, source="tune"))
        self.progress(f"node {node}, {candidate.threads} threads ({candidate.label}): starting the server")
        backend.start(instance)
        try:
            self._wait_ready(backend, cfg, instance)
            client = Client(cfg.server.host, instance.port, self.key, self.no_stop)
            _, probe_tokens, _ = client.complete(client.fresh(20), 4)  # warm up, and the tokens per word
            # The prompt fills at most ~70 % of the context (the generated models tokenise "wordN" into several).
            words = max(8, min(PROMPT_WORDS, int(0.7 * cfg.model.context_size * 21 / max(probe_tokens, 1))))
            decode, prompt = [], []
            for sample in range(self.settings.samples):
                self.progress(f"node {node}, {candidate.threads} threads: sample {sample + 1}/{self.settings.samples}")
                decode.append(client.decode_rate(self.settings.tokens))
                prompt.append(client.prompt_rate(words))
            return Result(candidate, Figure(tuple(decode)), Figure(tuple(prompt)))
        finally:
            backend.stop(instance.name)

    def _wait_ready(self, backend: ProcessBackend, cfg: Config, instance: Instance) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        path = engine_of(cfg).liveness_path
        while time.monotonic() < deadline:
            pid = backend.main_pid(instance.name)
            if pid is None:
                raise TuneError(f"the server for {instance.threads} threads exited "
                                f"({backend.describe(instance.name)}); "
                                f"see {self.log_dir / (instance.name + '.log')}")
            owner = self.proc.port_owner(cfg.server.host, instance.port, pid)
            if owner.holder == Holder.OTHER:
                # Another process took tune's port: it must get neither the key nor the prompts.
                raise TuneError(f"the server for {instance.threads} threads: {owner.detail}")
            if owner.ours and probe(cfg.server.host, instance.port, 2.0, path).ok:
                return
            time.sleep(0.2)
        raise TuneError(f"the server for {instance.threads} threads did not answer within "
                        f"{self.settings.startup_timeout_s:g}s")

    def measure_layout(self, layout: Layout, clients: int, rounds: int, port: int) -> LayoutResult:
        """Every instance of `layout` at once, `clients` concurrent clients spread over them
        (client k on instance k mod n), each sending `rounds` completions, `samples` times."""
        placement = self.config.placement.model_copy(update={"mode": layout.mode,
                                                              "instances_per_node": layout.instances_per_node})
        cfg = self.config.model_copy(update={
            "placement": placement, "server": self.config.server.model_copy(update={"base_port": port}),
            "frontend": self.config.frontend.model_copy(update={"listen": ""})})
        plan = make_plan(cfg, self.topology, self.model_size, source="tune")
        backend = ProcessBackend(self.log_dir)
        backend.sync(cfg, plan)
        self.progress(f"layout {layout.name}: starting {len(plan.instances)} instance(s)")
        try:
            for instance in plan.instances:
                backend.start(instance)
            for instance in plan.instances:
                self._wait_ready(backend, cfg, instance)
            ports = [i.port for i in plan.instances]
            for port_ in ports:
                Client(cfg.server.host, port_, self.key, self.no_stop).complete("warm up", 2)
            rates: list[float] = []
            latencies: list[float] = []
            for sample in range(self.settings.samples):
                self.progress(f"layout {layout.name}: {clients} clients, sample {sample + 1}/{self.settings.samples}")
                rate, seconds = self._concurrent(cfg.server.host, ports, clients, rounds)
                rates.append(rate)
                latencies += seconds
            return LayoutResult(layout, len(plan.instances), clients, Figure(tuple(rates)),
                                percentile(latencies, 0.5), percentile(latencies, 0.99))
        finally:
            for instance in plan.instances:
                backend.stop(instance.name)

    def _concurrent(self, host: str, ports: list[int], clients: int, rounds: int) -> tuple[float, list[float]]:
        import threading

        tokens: list[int] = []
        seconds: list[float] = []
        errors: list[str] = []
        lock = threading.Lock()

        def client(port: int) -> None:
            session = Client(host, port, self.key, self.no_stop)
            for _ in range(rounds):
                try:
                    took, _, got = session.complete(session.fresh(8), self.settings.tokens)
                except (OSError, TuneError) as exc:
                    with lock:
                        errors.append(str(exc))
                    return
                with lock:
                    tokens.append(got)
                    seconds.append(took)

        threads = [threading.Thread(target=client, args=(ports[k % len(ports)],), daemon=True) for k in range(clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise TuneError(f"{len(errors)} request(s) failed: {errors[0]}")
        return sum(tokens) / (time.monotonic() - started), seconds

    def bandwidth(self, nodes: list[int], samples: int) -> dict[tuple[int, int], Figure]:
        """(CPU node, memory node) -> GB/s, read by the CPUs the node's instance would get."""
        refused = pinning.memory_calls().bind_refused
        if refused is not None:
            # Each reader binds its buffer to one node: without set_mempolicy every reader
            # would die and the measurement would wait out its timeout.
            raise TuneError(f"cannot measure bandwidth per memory node: set_mempolicy is refused here ({refused}: "
                            f"a seccomp profile); allow it ({pinning.SECCOMP_DOC}) "
                            "or run tune where it is allowed")
        cpus = {}
        for node in nodes:
            _, instance = self.instance_for(node, 1, self.config.server.base_port)
            cpus[node] = instance.cpus
        memory_nodes = [n.id for n in self.topology.nodes if n.memory_total_bytes > 0]
        found = bandwidth.matrix(cpus, memory_nodes, samples, progress=self.progress)
        return {k: Figure(v.samples_gbs) for k, v in found.items()}


class Client:
    """Completions against one server, timed from the client: the same for both engines."""

    def __init__(self, host: str, port: int, key: str | None, no_stop: dict[str, object] | None = None) -> None:
        self.host = connect_host(host)
        self.port, self.key = port, key
        # Engine.no_stop_fields: a measurement must not end where the model draws EOS.
        self.no_stop = no_stop or {}

    def complete(self, prompt: str, max_tokens: int) -> tuple[float, int, int]:
        """(seconds, prompt tokens, completion tokens)."""
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **self.no_stop}).encode()
        headers = {"Content-Type": "application/json"}
        if self.key is not None:
            headers["Authorization"] = f"Bearer {self.key}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        started = time.monotonic()
        try:
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        elapsed = time.monotonic() - started
        if response.status != 200:
            raise TuneError(f"completion failed: HTTP {response.status}: {data[:200]!r}")
        usage = json.loads(data)["usage"]
        return elapsed, usage["prompt_tokens"], usage["completion_tokens"]

    @staticmethod
    def fresh(words: int) -> str:
        # A new first word every time: neither engine may reuse a cached prompt prefix.
        return secrets.token_hex(4) + " " + " ".join(f"word{i % 97}" for i in range(words))

    def decode_rate(self, tokens: int) -> float:
        """Generated tokens/s, from the arrival times of a streamed completion's tokens: the
        first token (which carries the prompt's time) starts the clock, the last stops it."""
        body = json.dumps({"prompt": self.fresh(8), "max_tokens": tokens, "temperature": 0, "stream": True,
                           **self.no_stop}).encode()
        headers = {"Content-Type": "application/json"}
        if self.key is not None:
            headers["Authorization"] = f"Bearer {self.key}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        arrivals: list[float] = []
        try:
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            response = conn.getresponse()
            if response.status != 200:
                raise TuneError(f"completion failed: HTTP {response.status}: {response.read()[:200]!r}")
            for raw in response:
                line = raw.strip()
                if line.startswith(b"data: {") and b'"text":""' not in line.replace(b" ", b""):
                    arrivals.append(time.monotonic())
        finally:
            conn.close()
        if len(arrivals) < 3:
            raise TuneError(f"asked for {tokens} streamed tokens, got {len(arrivals)}")
        return (len(arrivals) - 1) / max(arrivals[-1] - arrivals[0], 1e-6)

    def prompt_rate(self, words: int) -> float:
        """Prompt tokens/s: a long prompt against a short one, one token generated each."""
        short, short_tokens, _ = self.complete(self.fresh(4), 1)
        long, long_tokens, _ = self.complete(self.fresh(words), 1)
        return (long_tokens - short_tokens) / max(long - short, 1e-6)


# -- the command ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TuneRequest:
    config_path: str
    fsroot: str
    state_file: Path
    nodes: list[int] | None
    quick: bool
    apply: bool
    stop_instances: bool
    samples: int | None
    tokens: int | None
    layouts: bool = False
    kind: BackendKind = BackendKind.PROCESS  # the daemon's backend: decides who the instances run as


class Fleet:
    """The daemon's instances on the nodes being measured: held one node at a time."""

    def __init__(self, state_file: Path, progress: Callable[[str], None]) -> None:
        from numad_infer.status.statefile import read_status

        self.state_file, self.progress = state_file, progress
        self.status = read_status(state_file)
        self.taken: list[Path] = []

    @property
    def live(self) -> bool:
        return self.status is not None and self.status.daemon.state.live and self.status.daemon.pid is not None

    def instances_on(self, node: int) -> list[str]:
        if not self.live:
            return []
        assert self.status is not None
        return [i.name for i in self.status.instances if i.node == node or i.node is None]

    def hold_all(self, timeout_s: float) -> None:
        """Every instance (layouts need the whole machine): only with --stop-instances."""
        for node in sorted({i.node for i in self.status.instances if i.node is not None} if self.live and self.status
                           else set()):
            self.hold(node, timeout_s)

    def hold(self, node: int, timeout_s: float) -> None:
        from numad_infer.lifecycle.states import State
        from numad_infer.status.statefile import read_status
        from numad_infer.supervision import holds

        names = self.instances_on(node)
        if not names:
            return
        directory = holds.hold_dir(self.state_file)
        for name in names:
            self.taken.append(holds.acquire(directory, name, "numa-infer tune"))
        self.progress(f"node {node}: asking the daemon to drain and stop {', '.join(names)}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = read_status(self.state_file)
            states = {i.name: i.state for i in status.instances} if status else {}
            if all(states.get(n) == State.HELD for n in names):
                return
            time.sleep(0.5)
        raise TuneError(f"the daemon did not stop {', '.join(names)} within {timeout_s:g}s")

    def release(self, wait_s: float) -> None:
        """Give the held instances back and wait until they serve again (one node down at a time)."""
        from numad_infer.lifecycle.states import State
        from numad_infer.status.statefile import read_status
        from numad_infer.supervision import holds

        names = [p.name.removesuffix(holds.SUFFIX) for p in self.taken]
        for path in self.taken:
            holds.release(path)
        self.taken = []
        if not names:
            return
        self.progress(f"released {', '.join(names)}; waiting for them to be healthy again")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            status = read_status(self.state_file)
            if status and all(i.state == State.HEALTHY for i in status.instances if i.name in names):
                return
            time.sleep(0.5)
        log.warning("%s not healthy again within %gs after the release", ", ".join(names), wait_s)

    def drop(self) -> None:
        """On any exit: never leave a hold behind."""
        from numad_infer.supervision import holds

        for path in self.taken:
            holds.release(path)
        self.taken = []


def run(request: TuneRequest, progress: Callable[[str], None]) -> tuple[Report, list[Edit]]:
    import tempfile

    from numad_infer.tune.choice import thread_grid
    from numad_infer.validate.pipeline import load

    loaded = load(request.config_path, request.kind, request.fsroot)
    config, plan, size = loaded.config, loaded.plan, loaded.model_bytes
    # Measuring servers run where the instances may: only the CPUs and memory the cgroup allows.
    topology = within(loaded.topology, loaded.allowed)
    planned = {i.node: i for i in plan.instances if i.node is not None}
    nodes = _nodes_to_measure(request, config, planned)
    fleet = Fleet(request.state_file, progress)
    _refuse_cutting_clients_off(request, config, fleet)
    settings = Settings(samples=request.samples or (3 if request.quick else 5),
                        tokens=request.tokens or (16 if request.quick else 64),
                        startup_timeout_s=config.monitor.startup_grace_s or 300.0)
    log_dir = Path(tempfile.mkdtemp(prefix="numa-infer-tune-"))
    log_dir.chmod(0o700)
    measurer = Measurer(config, topology, size, log_dir, settings, progress)
    node = nodes[0]
    instance = planned[node]
    node_obj = next(n for n in topology.nodes if n.id == node)
    cores = unreserved_cores(node_obj, reserved_cores(topology, config.placement.reserved))
    grid = thread_grid(len(cores), sum(len(c) for c in cores), request.quick)
    current = {"placement.threads": instance.threads, "placement.threads_batch": instance.threads_batch}
    for value in current.values():
        if value not in {c.threads for c in grid}:
            grid.append(Candidate(value, "current setting"))
    report = Report(model=config.model.path, weight_bytes=size, decode_bytes=loaded.decode_bytes,
                    engine=config.server.engine, node=node, cpus=instance.cpus,
                    engine_cpu=None if loaded.engine_cpu.cpu is None else loaded.engine_cpu.cpu.describe())
    try:
        for measured in nodes:
            fleet.hold(measured, config.frontend.drain_timeout_s + 120)
            try:
                report.bandwidth.update(measurer.bandwidth([measured], settings.samples))
                if measured == node:
                    port = _free_port()
                    for candidate in grid:
                        report.results.append(measurer.measure(node, candidate, port))
            finally:
                fleet.release(config.monitor.startup_grace_s + 60)
    finally:
        fleet.drop()
    if request.layouts:
        _measure_layouts(report, measurer, fleet, config, topology, size, len(node_obj.l3_groups) or 1, len(cores),
                         progress)
    # For the daemon: status then shows llama-server's decode as a share of this bandwidth.
    try:
        bandwidthfile.save(request.state_file.parent / bandwidthfile.RESULTS_NAME,
                       {k: f.median for k, f in report.bandwidth.items()})
    except OSError as exc:
        log.warning("cannot keep the bandwidth figures for the daemon: %s", exc)
    return report, _edits(report, config, current, len(cores))


def _nodes_to_measure(request: TuneRequest, config: Config, planned: dict[int, Instance]) -> list[int]:
    from numad_infer.errors import ConfigError

    if config.placement.mode != "per-node":
        raise ConfigError(request.config_path, "placement.mode", "tune measures per-node instances; "
                          "set mode = \"per-node\" to tune threads (layouts are not measured yet)")
    nodes = request.nodes if request.nodes else [min(planned)]
    for node in nodes:
        if node not in planned:
            raise ConfigError(request.config_path, "placement.nodes", f"node {node} hosts no instance in the plan "
                              f"(planned nodes: {', '.join(map(str, sorted(planned)))})")
    return nodes


def _refuse_cutting_clients_off(request: TuneRequest, config: Config, fleet: Fleet) -> None:
    if fleet.live and request.layouts and not request.stop_instances:
        raise TuneError("measuring layouts needs every CPU of the machine, so the whole service would be down: "
                        "pass --stop-instances to accept that, or stop numa-infer first")
    if fleet.live and not config.frontend.enabled and not request.stop_instances:
        raise TuneError("the daemon is running and there is no front door to route around a node under measurement: "
                        "its clients would be cut off. Pass --stop-instances to stop each node's instance while "
                        "it is measured, or stop numa-infer first")


def _measure_layouts(report: Report, measurer: Measurer, fleet: Fleet, config: Config, topology: Topology, size: int,
                     l3_groups: int, cores: int, progress: Callable[[str], None]) -> None:
    from numad_infer.errors import ConfigError
    from numad_infer.tune.choice import layouts

    candidates = layouts(l3_groups, cores)
    current_layout = next((lay for lay in candidates if lay.mode == config.placement.mode
                           and lay.instances_per_node == config.placement.instances_per_node), None)
    if current_layout is None:
        current_layout = Layout(config.placement.mode, config.placement.instances_per_node, "current setting")
        candidates.insert(0, current_layout)
    most = 0
    for layout in list(candidates):
        placement = config.placement.model_copy(update={"mode": layout.mode,
                                                      "instances_per_node": layout.instances_per_node})
        try:
            most = max(most, len(make_plan(config.model_copy(update={"placement": placement}), topology, size,
                                           source="tune").instances))
        except ConfigError as exc:
            progress(f"layout {layout.name}: not possible here ({exc}); skipped")
            candidates = [c for c in candidates if c is not layout]
    clients = max(4, 2 * most)
    report.current_layout = current_layout
    try:
        fleet.hold_all(config.frontend.drain_timeout_s + 120)
        for layout in candidates:
            report.layout_results.append(measurer.measure_layout(layout, clients, 2, _free_port_block(most)))
    finally:
        fleet.release(config.monitor.startup_grace_s + 60)
        fleet.drop()


def _edits(report: Report, config: Config, current: dict[str, int], cores: int) -> list[Edit]:
    """What to write into the file: only what beat the current setting by more than the noise."""
    from numad_infer.tune.choice import Choice, Verdict, choose, choose_layout
    from numad_infer.tune.config_edit import Edit

    choices: list[Choice] = [choose(report.results, "placement.threads", "decode", current["placement.threads"]),
                             choose(report.results, "placement.threads_batch", "prompt",
                                    current["placement.threads_batch"])]
    report.choices = choices
    edits: list[Edit] = []
    if any(c.verdict == Verdict.CHANGE for c in choices):
        threads, batch = choices[0].value, choices[1].value
        if max(threads, batch) > cores and not config.placement.smt:
            edits.append(Edit("placement", "smt", True))
        edits += [Edit("placement", "threads", threads), Edit("placement", "threads_batch", batch)]
    if report.layout_results and report.current_layout is not None:
        best, _, _, verdict = choose_layout(report.layout_results, report.current_layout)
        if verdict == Verdict.CHANGE:
            edits += [Edit("placement", "mode", best.layout.mode),
                      Edit("placement", "instances_per_node", best.layout.instances_per_node)]
    return edits


def write_tuned(config_path: str, fsroot: str, kind: BackendKind, edits: list[Edit]) -> Path:
    """`tune --apply`: write `edits` into the file, refused exactly as `check` would refuse
    the edited file (the same pipeline, loading.validate), with nothing written then.
    Returns the backup's path."""
    from numad_infer.topology.sysfs import read_topology
    from numad_infer.tune.config_edit import apply_edits
    from numad_infer.validate import pipeline as loading

    topology = read_topology(fsroot)
    allowed = loading.read_allowed(kind)
    return apply_edits(Path(config_path), edits,
                       lambda cfg: loading.validate(cfg, config_path, topology, kind, allowed=allowed) and None)


def _free_port_block(count: int) -> int:
    """A base port with `count` free ports from it (the instances of one layout)."""
    import random
    import socket

    for _ in range(100):
        base = random.randrange(20000, 60000)
        try:
            sockets = []
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise TuneError("no block of free ports on 127.0.0.1")


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
