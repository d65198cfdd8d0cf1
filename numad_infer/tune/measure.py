"""The measurer of `numa-infer tune`: real servers of the configured engine on the real
topology with the configured model, one candidate at a time, pinned and bound the way the
daemon would run them (the process backend's start), and the bandwidth matrix.

Each candidate (a layout's placement, threads, tune's port, no front door) is a
configuration of its own and goes through the one validation door, pipeline.validate, as
any configuration the daemon loads does: its plan, launches and engine are the ones that
door works out, and what it refuses is refused here with its ConfigError.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from numad_infer.backends.process import ProcessBackend
from numad_infer.config.schema import Config, ModelView, PlacementSection
from numad_infer.host import pinning
from numad_infer.host.identity import BackendKind
from numad_infer.host.portowner import Holder
from numad_infer.host.procfs import ProcReader
from numad_infer.model.gguf import stop_token_ids
from numad_infer.plan.model import Instance
from numad_infer.supervision.health import probe
from numad_infer.topology.cgroup_limits import Allowed
from numad_infer.tune import bandwidth
from numad_infer.tune.choice import Candidate, Figure, Layout, LayoutResult, Result, percentile
from numad_infer.tune.client import Client
from numad_infer.tune.errors import TuneError
from numad_infer.validate.loaded import Loaded
from numad_infer.validate.pipeline import validate

# Prompt processing is measured on this many words (~1.3 tokens each with the generated
# models' vocabulary); decoding on --tokens generated tokens minus one.
PROMPT_WORDS = 200


@dataclass(frozen=True)
class Settings:
    samples: int  # repeats of every figure
    tokens: int  # generated per decode sample
    startup_timeout_s: float


def candidate_config(config: ModelView, node: int, threads: int, port: int, smt: bool) -> ModelView:
    """The configuration of one measuring server: the node's instance as the daemon would
    plan it, with `threads` for both thread counts, on a port of tune's own. `smt`: with
    the SMT siblings among its CPUs (needed for more threads than physical cores)."""
    placement = config.placement.model_copy(update={"nodes": [node], "mode": "per-node", "instances_per_node": 1,
                                                      "threads": threads, "threads_batch": threads, "smt": smt})
    return _measuring(config, placement, port)


def layout_config(config: ModelView, layout: Layout, port: int) -> ModelView:
    """The configuration of one layout's measuring servers: `layout`'s mode and instances per
    node, the rest as configured, on ports of tune's own from `port`."""
    placement = config.placement.model_copy(update={"mode": layout.mode,
                                                      "instances_per_node": layout.instances_per_node})
    return _measuring(config, placement, port)


def _measuring(config: ModelView, placement: PlacementSection, port: int) -> ModelView:
    # No front door: tune's servers are reached directly, and the fleet's front door (if
    # any) is not checked, written or touched for them.
    server = config.server.model_copy(update={"base_port": port})
    frontend = config.frontend.model_copy(update={"listen": ""})
    return config.model_copy(update={"placement": placement, "server": server, "frontend": frontend})


class Measurer:
    def __init__(self, loaded: Loaded, allowed: Allowed, log_dir: Path, settings: Settings,
                 progress: Callable[[str], None], model: str = "", config: ModelView | None = None, *,
                 backend: Callable[[Path], ProcessBackend] = ProcessBackend,
                 validation: Callable[..., Loaded] = validate) -> None:
        """`loaded`: the configuration as the pipeline checked it (its source, topology and
        measured model); `allowed`: what the measuring servers may use of its topology (the
        load's cgroup set, or within it the cores the plan gives the measured model);
        `model`: the model measured (`Instance.model`), `config` its view as tune plans it
        (default: the model's view). Nothing is validated yet: each candidate is, as it is
        measured (`candidate`). `backend`, `validation`: what runs the measuring servers and
        what validates each candidate (the process backend and the pipeline, unless a test
        stands in for them)."""
        self.loaded, self.allowed = loaded, allowed
        self.backend, self.validation = backend, validation
        self.config = config if config is not None else loaded.model(model).served.view
        self.log_dir, self.settings, self.progress = log_dir, settings, progress
        self.proc = ProcReader()
        self.no_stop = loaded.engine.no_stop_fields(stop_token_ids(self.config.model.path))
        self._physical: dict[int, int] = {}  # node -> physical cores of its measuring server

    def candidate(self, cfg: ModelView) -> Loaded:
        """`cfg` as the pipeline validates it (its ConfigError when refused): the plan, the
        launches, the engine, the key and the model as read now. On the load's topology
        and within `allowed`, like the daemon's own plan. Its servers are tune's own child
        processes whatever runs the fleet, so it is validated for the process backend:
        under systemd the fleet's user is a DynamicUser, which only systemd can create, and
        the pipeline works out the process backend's user instead. unit_dirs=(): nothing
        installs units for it. Its warnings (the plan's, the engine's, the host's) are not
        reported: they are the configuration's, which `check` says, not the measurement's."""
        return self.validation(cfg, self.loaded.source, self.loaded.topology, BackendKind.PROCESS, unit_dirs=(),
                        allowed=self.allowed)

    def instance_for(self, node: int, threads: int, port: int) -> Loaded:
        """The validated candidate of `threads` threads on `node`: one instance, with the SMT
        siblings among its CPUs when the configuration asks for them or `threads` needs them."""
        if node not in self._physical:
            # The node's physical cores as the plan gives them (one thread per core, no siblings).
            (one,) = self.candidate(candidate_config(self.config, node, 1, port, smt=False)).plan.instances
            self._physical[node] = len(one.cpus)
        smt = self.config.placement.smt or threads > self._physical[node]
        return self.candidate(candidate_config(self.config, node, threads, port, smt=smt))

    def measure(self, node: int, candidate: Candidate, port: int) -> Result:
        loaded = self.instance_for(node, candidate.threads, port)
        (instance,) = loaded.plan.instances
        cfg = loaded.model(instance.model).served.view  # the candidate's one model, as validated
        backend = self.backend(self.log_dir)
        backend.sync(loaded)
        self.progress(f"node {node}, {candidate.threads} threads ({candidate.label}): starting the server")
        backend.start(instance)
        try:
            self._wait_ready(backend, cfg, instance)
            client = Client(cfg.server.host, instance.port, loaded.api_key, self.no_stop)
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
        path = self.loaded.engine.liveness_path
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
        loaded = self.candidate(layout_config(self.config, layout, port))
        cfg, plan = loaded.config, loaded.plan
        backend = self.backend(self.log_dir)
        backend.sync(loaded)
        self.progress(f"layout {layout.name}: starting {len(plan.instances)} instance(s)")
        try:
            for instance in plan.instances:
                backend.start(instance)
            for instance in plan.instances:
                self._wait_ready(backend, cfg, instance)
            ports = [i.port for i in plan.instances]
            for port_ in ports:
                Client(cfg.server.host, port_, loaded.api_key, self.no_stop).complete("warm up", 2)
            rates: list[float] = []
            latencies: list[float] = []
            for sample in range(self.settings.samples):
                self.progress(f"layout {layout.name}: {clients} clients, sample {sample + 1}/{self.settings.samples}")
                rate, seconds = self._concurrent(cfg.server.host, ports, loaded.api_key, clients, rounds)
                rates.append(rate)
                latencies += seconds
            return LayoutResult(layout, len(plan.instances), clients, Figure(tuple(rates)),
                                percentile(latencies, 0.5), percentile(latencies, 0.99))
        finally:
            for instance in plan.instances:
                backend.stop(instance.name)

    def _concurrent(self, host: str, ports: list[int], key: str | None, clients: int,
                    rounds: int) -> tuple[float, list[float]]:
        import threading

        tokens: list[int] = []
        seconds: list[float] = []
        errors: list[str] = []
        lock = threading.Lock()

        def client(port: int) -> None:
            session = Client(host, port, key, self.no_stop)
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
            (instance,) = self.instance_for(node, 1, self.config.server.base_port).plan.instances
            cpus[node] = instance.cpus
        memory_nodes = [n.id for n in self.loaded.topology.nodes if n.memory_total_bytes > 0]
        found = bandwidth.matrix(cpus, memory_nodes, samples, progress=self.progress)
        return {k: Figure(v.samples_gbs) for k, v in found.items()}

