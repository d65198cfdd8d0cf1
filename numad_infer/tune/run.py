"""The flow of `numa-infer tune`: load and check the configuration, hold the fleet
(`fleet.py`) one node at a time while the measurer (`measure.py`) runs the candidates and
the bandwidth matrix, then the edits that won; and `--apply` writing them (`write_tuned`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from numad_infer.config.models import ServedModel
from numad_infer.config.schema import ModelView
from numad_infer.host.identity import BackendKind
from numad_infer.plan.model import Instance
from numad_infer.plan.placement import reserved_cores, unreserved_cores
from numad_infer.topology.cgroup_limits import Allowed, within
from numad_infer.topology.model import Topology
from numad_infer.tune import bandwidth_file
from numad_infer.tune.choice import Candidate, Layout, Report
from numad_infer.tune.errors import TuneError
from numad_infer.tune.fleet import Fleet
from numad_infer.tune.measure import Measurer, Settings

if TYPE_CHECKING:
    from numad_infer.tune.config_edit import Edit
    from numad_infer.validate.loaded import Loaded, LoadedModel

log = logging.getLogger(__name__)


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
    model: str | None = None  # --model: which [[models]] model to measure (required when there are several)


def run(request: TuneRequest, progress: Callable[[str], None]) -> tuple[Report, list[Edit]]:
    import tempfile

    from numad_infer.tune.choice import thread_grid
    from numad_infer.validate.pipeline import load

    loaded = load(request.config_path, request.kind, request.fsroot)
    chosen = model_to_tune(request, loaded)
    # [[models]]: tune writes the model's own table (models[k].threads), else [placement].
    several, ident = chosen.served.own_table, chosen.served.ident
    config, allowed, planned, nodes = _target(request, loaded, chosen, ident)
    topology = within(loaded.topology, allowed)  # what the measuring servers may use
    fleet = Fleet(request.state_file, progress)
    _refuse_cutting_clients_off(request, config, fleet)
    settings = Settings(samples=request.samples or (3 if request.quick else 5),
                        tokens=request.tokens or (16 if request.quick else 64),
                        startup_timeout_s=config.monitor.startup_grace_s or 300.0)
    log_dir = Path(tempfile.mkdtemp(prefix="numa-infer-tune-"))
    log_dir.chmod(0o700)
    measurer = Measurer(loaded, allowed, log_dir, settings, progress, model=ident, config=config)
    node = nodes[0]
    instance = planned[node]
    node_obj = next(n for n in topology.nodes if n.id == node)
    cores = unreserved_cores(node_obj, reserved_cores(topology, config.placement.reserved))
    # placement.smt is every model's: tune --model measures only what its own cores give without it.
    logical = len(cores) if several and not config.placement.smt else sum(len(c) for c in cores)
    grid = thread_grid(len(cores), logical, request.quick)
    prefix = f"{chosen.served.key}." if several else "placement."
    current = {f"{prefix}threads": instance.threads, f"{prefix}threads_batch": instance.threads_batch}
    for value in current.values():
        if value not in {c.threads for c in grid}:
            grid.append(Candidate(value, "current setting"))
    report = _report(loaded, chosen, config, node, instance)
    try:
        for measured in nodes:
            fleet.hold(measured, config.frontend.drain_timeout_s + 120)
            try:
                report.bandwidth.update(measurer.bandwidth([measured], settings.samples))
                if measured == node:
                    port = _free_port_block(1, _plan_ports(loaded))
                    for candidate in grid:
                        report.results.append(measurer.measure(node, candidate, port))
            finally:
                fleet.release(config.monitor.startup_grace_s + 60)
    finally:
        fleet.drop()
    if request.layouts:
        _measure_layouts(report, measurer, fleet, config, len(node_obj.l3_groups) or 1, len(cores), progress,
                         _plan_ports(loaded))
    # For the daemon: status then shows llama-server's decode as a share of this bandwidth.
    try:
        bandwidth_file.save(request.state_file.parent / bandwidth_file.RESULTS_NAME,
                        {k: f.median for k, f in report.bandwidth.items()})
    except OSError as exc:
        log.warning("cannot keep the bandwidth figures for the daemon: %s", exc)
    return report, _edits(report, config, current, len(cores), prefix)


def _report(loaded: Loaded, chosen: LoadedModel, config: ModelView, node: int, instance: Instance) -> Report:
    """The report before measuring: the chosen model's file, size and bytes a decoded token
    reads (its decode efficiency's numerator), never another model's."""
    return Report(model=config.model.path, weight_bytes=chosen.model_bytes, decode_bytes=chosen.decode_bytes,
                  engine=config.server.engine, node=node, cpus=instance.cpus,
                  engine_cpu=None if loaded.engine_cpu.cpu is None else loaded.engine_cpu.cpu.describe())


def model_to_tune(request: TuneRequest, loaded: Loaded) -> LoadedModel:
    """The model `--model` names (by name or alias); without it, the only one. Refused, with
    the names to choose from, when it is missing with several models or names none."""
    from numad_infer.errors import ConfigError

    names = [m.served.name for m in loaded.models if m.served.name]
    if request.model is None:
        if len(loaded.models) == 1:
            return loaded.models[0]
        raise ConfigError(request.config_path, "models", f"has {len(loaded.models)} models and tune measures one "
                          f"at a time: pass --model NAME, one of {', '.join(names)}")
    for found in loaded.models:
        if request.model in found.served.ids:
            return found
    choices = f"one of {', '.join(names)}" if names else "none (the [model] table has no name: leave out --model)"
    raise ConfigError(request.config_path, None, f"--model {request.model}: no such model in the file; the models "
                      f"are {choices}")


def _target(request: TuneRequest, loaded: Loaded, chosen: LoadedModel,
            ident: str) -> tuple[ModelView, Allowed, dict[int, Instance], list[int]]:
    """What tune measures: the model's view (a one-model configuration whose [model] and
    placement are its own), what its servers may use of the load's topology (what the
    cgroup allows), its planned instances by node, and the nodes to measure."""
    config = chosen.served.view
    allowed = loaded.allowed
    planned = {i.node: i for i in loaded.plan.instances if i.node is not None and i.model == ident}
    nodes = _nodes_to_measure(request, config, planned, chosen.served)
    if chosen.served.own_table:
        if request.layouts:
            raise TuneError("--layouts measures the single-[model] form's layouts; with [[models]] each model's "
                            "cores are its cores_per_instance: leave out --layouts to tune this model's threads")
        # The model's instances share their nodes with the other models: measured on the cores
        # the plan gives them (and those cores' SMT siblings), not on the whole node.
        allowed, config = _own_cores(loaded.topology, allowed, planned, nodes, config, chosen.served.key)
    return config, allowed, planned, nodes


def _own_cores(topology: Topology, allowed: Allowed, planned: dict[int, Instance], nodes: list[int],
               config: ModelView, key: str) -> tuple[Allowed, ModelView]:
    """`allowed` narrowed to the measured nodes' instances' cores (with their SMT siblings),
    and the view planning within it: nothing of it is reserved any more (the plan kept the
    reserved cores out already). Its memory nodes and CPU quota stay the cgroup's. `key`:
    the model's table, as a message about the narrowed set names it."""
    own = {cpu for node in within(topology, allowed).nodes if node.id in nodes for core in node.cores
           if set(core) & set(planned[node.id].cpus) for cpu in core}
    narrowed = Allowed(frozenset(own), allowed.mems, allowed.quota_cpus,
                       f"the cores the plan gives {key}" + (f", within {allowed.source}" if allowed.source else ""))
    return narrowed, config.model_copy(update={"placement": config.placement.model_copy(update={"reserve_cpus": ""})})


def _nodes_to_measure(request: TuneRequest, config: ModelView, planned: dict[int, Instance],
                      served: ServedModel) -> list[int]:
    from numad_infer.errors import ConfigError

    if config.placement.mode != "per-node":
        raise ConfigError(request.config_path, "placement.mode", "tune measures per-node instances; "
                          "set mode = \"per-node\" to tune threads (layouts are not measured yet)")
    nodes = request.nodes if request.nodes else [min(planned)]
    nodes_key = served.key_for("placement.nodes")
    for node in nodes:
        if node not in planned:
            raise ConfigError(request.config_path, nodes_key, f"node {node} hosts no instance in the plan "
                              f"(planned nodes: {', '.join(map(str, sorted(planned)))})")
    return nodes


def _refuse_cutting_clients_off(request: TuneRequest, config: ModelView, fleet: Fleet) -> None:
    if fleet.live and request.layouts and not request.stop_instances:
        raise TuneError("measuring layouts needs every CPU of the machine, so the whole service would be down: "
                        "pass --stop-instances to accept that, or stop numa-infer first")
    if fleet.live and not config.frontend.enabled and not request.stop_instances:
        raise TuneError("the daemon is running and there is no front door to route around a node under measurement: "
                        "its clients would be cut off. Pass --stop-instances to stop each node's instance while "
                        "it is measured, or stop numa-infer first")


def _measure_layouts(report: Report, measurer: Measurer, fleet: Fleet, config: ModelView, l3_groups: int, cores: int,
                     progress: Callable[[str], None], taken: frozenset[int] = frozenset()) -> None:
    from numad_infer.errors import ConfigError
    from numad_infer.tune.choice import layouts
    from numad_infer.tune.measure import layout_config

    candidates = layouts(l3_groups, cores)
    current_layout = next((lay for lay in candidates if lay.mode == config.placement.mode
                           and lay.instances_per_node == config.placement.instances_per_node), None)
    if current_layout is None:
        current_layout = Layout(config.placement.mode, config.placement.instances_per_node, "current setting")
        candidates.insert(0, current_layout)
    most = 0
    for layout in list(candidates):
        # Possible here is what the pipeline accepts (its plan's instances tell the ports and
        # clients needed); measure_layout validates it again on the ports it gets.
        try:
            most = max(most, len(measurer.candidate(layout_config(config, layout, config.server.base_port))
                                 .plan.instances))
        except ConfigError as exc:
            progress(f"layout {layout.name}: not possible here ({exc}); skipped")
            candidates = [c for c in candidates if c is not layout]
    clients = max(4, 2 * most)
    report.current_layout = current_layout
    try:
        fleet.hold_all(config.frontend.drain_timeout_s + 120)
        for layout in candidates:
            report.layout_results.append(measurer.measure_layout(layout, clients, 2, _free_port_block(most, taken)))
    finally:
        fleet.release(config.monitor.startup_grace_s + 60)
        fleet.drop()


def _edits(report: Report, config: ModelView, current: dict[str, int], cores: int,
           prefix: str = "placement.") -> list[Edit]:
    """What to write into the file: only what beat the current setting by more than the noise.
    `prefix`: where the threads go, `placement.` or one model's `models[k].`."""
    from numad_infer.tune.choice import Choice, Verdict, choose, choose_layout
    from numad_infer.tune.config_edit import Edit

    choices: list[Choice] = [choose(report.results, f"{prefix}threads", "decode", current[f"{prefix}threads"]),
                             choose(report.results, f"{prefix}threads_batch", "prompt",
                                    current[f"{prefix}threads_batch"])]
    report.choices = choices
    edits: list[Edit] = []
    if any(c.verdict == Verdict.CHANGE for c in choices):
        threads, batch = choices[0].value, choices[1].value
        if max(threads, batch) > cores and not config.placement.smt:
            edits.append(Edit("placement", "smt", True))
        edits += [Edit.at(f"{prefix}threads", threads), Edit.at(f"{prefix}threads_batch", batch)]
    if report.layout_results and report.current_layout is not None:
        best, _, _, verdict = choose_layout(report.layout_results, report.current_layout)
        if verdict == Verdict.CHANGE:
            edits += [Edit("placement", "mode", best.layout.mode),
                      Edit("placement", "instances_per_node", best.layout.instances_per_node)]
    return edits


def write_tuned(config_path: str, fsroot: str, kind: BackendKind, edits: list[Edit]) -> Path:
    """`tune --apply`: write `edits` into the file, refused exactly as `check` would refuse
    the edited file (the same pipeline, pipeline.validate), with nothing written then.
    Returns the backup's path."""
    from numad_infer.topology.sysfs import read_topology
    from numad_infer.tune.config_edit import apply_edits
    from numad_infer.validate import pipeline

    topology = read_topology(fsroot)
    allowed = pipeline.read_allowed(kind)
    return apply_edits(Path(config_path), edits,
                       lambda cfg: pipeline.validate(cfg, config_path, topology, kind, allowed=allowed) and None)


def _plan_ports(loaded: Loaded) -> frozenset[int]:
    """The plan's instance ports: a held instance comes back on its own."""
    return frozenset(i.port for i in loaded.plan.instances)


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The lowest port the kernel hands to client sockets (bind to port 0, connect)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _free_port_block(count: int, taken: frozenset[int] = frozenset(), low: int = 10000,
                     top: int | None = None) -> int:
    """A base port with `count` ports from it free now, none of them `taken` (the plan's,
    whose held instances come back on them) and all below the kernel's ephemeral range:
    there a client socket (a probe, HAProxy's connection) could take one between this
    check and the server's bind."""
    import random
    import socket

    top = min(_ephemeral_low(), 65536) if top is None else top  # exclusive
    for _ in range(200):
        if top - count < low:
            break
        base = random.randrange(low, top - count + 1)  # the last port is top - 1
        ports = range(base, base + count)
        if taken.intersection(ports):
            continue
        sockets = []
        try:
            for port in ports:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise TuneError(f"no block of {count} free ports on 127.0.0.1 between {low} and {top}, below the ephemeral range")
