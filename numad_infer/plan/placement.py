"""Config + topology -> the placement plan: which instances, on which CPUs and memory.

Pure. Every refusal is a `ConfigError` naming the key an operator must change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from numad_infer.config.models import ServedModel
from numad_infer.config.schema import Config, ModelView
from numad_infer.errors import ConfigError
from numad_infer.plan.memory_fit import InstanceMemory, bounded, check_fit, growth_warnings, prompt_cache_bounds
from numad_infer.plan.model import Instance, Placed, Plan, Policy
from numad_infer.plan.multi import Core, Want, each_models_threads, instance_ident, split_node
from numad_infer.plan.ports import assign_ports, check_ports, exposure_warnings
from numad_infer.systemd import unitnames
from numad_infer.topology.cgroup_limits import UNRESTRICTED, Allowed, within
from numad_infer.topology.model import Node, Topology
from numad_infer.util.cpuset import format_list


def _memory_nodes(node: Node, topo: Topology, warnings: list[str]) -> tuple[int, ...]:
    if node.has_memory:
        return (node.id,)
    with_memory = [n for n in topo.nodes if n.has_memory]
    if not with_memory:
        return (node.id,)
    nearest = min(node.distances.get(n.id, 255) for n in with_memory)
    chosen = tuple(sorted(n.id for n in with_memory if node.distances.get(n.id, 255) == nearest))
    if node.memory_total_bytes > 0:  # it has memory, but the instances' cgroup may not use it
        warnings.append(f"node {node.id}'s memory is not allowed to the instances (cpuset.mems): its instance "
                        f"allocates on node(s) {format_list(chosen)}, the nearest allowed (distance {nearest})")
    else:
        warnings.append(f"node {node.id} has CPUs but no memory: its instance allocates on node(s) "
                        f"{format_list(chosen)}, the nearest with memory (distance {nearest})")
    return chosen


def _threads_of(cores: list[tuple[int, ...]], smt: bool) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(cpus, places): smt=false keeps the lowest sibling of each core."""
    if smt:
        cpus = tuple(sorted(c for core in cores for c in core))
        return cpus, tuple(core for core in cores)
    firsts = tuple(sorted(core[0] for core in cores))
    return firsts, tuple((c,) for c in firsts)


MemoryOf = InstanceMemory | Mapping[str, InstanceMemory]  # one for all, or per model key (Instance.model)


def make_plan(config: Config, topo: Topology, memory: MemoryOf | None = None, source: str = "config",
              allowed: Allowed = UNRESTRICTED, running: Sequence[Placed] = (), *,
              served: Sequence[ServedModel]) -> Plan:
    """The plan, in the order the kubelet's CPU allocator reads: within what the cgroup
    allows, which nodes, which of their cores, how the cores become instances, whether
    they fit in their nodes' memory (`memory`: what one instance holds; None: not
    checked), then ports and threads. `running`: the plan running now, whose instances keep
    their cores and ports where they can. `served`: the models `config` serves, as the one
    load worked them out (config/models.served_models, in validate/pipeline.py). Each step
    refuses what it cannot do. The single `[model]` is planned as the one-entry list of itself."""
    return _plan(config, topo, tuple(served), memory, source, allowed, running)


def _plan(config: Config, topo: Topology, models: tuple[ServedModel, ...], memory: MemoryOf | None, source: str,
          allowed: Allowed, running: Sequence[Placed]) -> Plan:
    warnings: list[str] = list(topo.warnings)
    view = within(topo, allowed)  # step 0: only the CPUs and memory the instances may use
    reserved = _reserved_cores(config, topo, warnings, source)
    if config.placement.mode == "interleave":  # the single form only (config/models.check_models)
        (model,) = models
        selected = _select_nodes(model, topo, view, allowed, warnings, source)
        usable = _usable_cores(model, view, selected, reserved, warnings, source)
        instances = _interleaved_instance(config, selected, usable)
    else:
        instances = _per_node_instances(config, models, topo, view, allowed, reserved, warnings, source, running)
    if memory is not None:  # step 4c: every node's instances fit in its memory
        def need(i: Instance) -> InstanceMemory:
            return memory if isinstance(memory, InstanceMemory) else memory[i.model]
        needs = [(i, need(i)) for i in instances]
        check_fit(needs, topo, source)
        # step 4d: the prompt caches the engine keeps unbounded by the operator, sized to what is left
        caches = prompt_cache_bounds(needs, topo, _kept_caches(instances, running))
        instances = [replace(i, prompt_cache_mib=caches.get(i.name)) for i in instances]
        warnings += growth_warnings([(i, bounded(i, need(i))) for i in instances], topo)
    instances = assign_ports(config, instances, source, _machine_ports(config, topo, models, source, allowed),
                             {i.name: i.port for i in running})
    instances = each_models_threads(models, instances, source, _thread_counts)
    instances = _quota_cap(config, instances, allowed, warnings)
    check_ports(config, instances, source)
    warnings += exposure_warnings(config)
    return Plan(instances=tuple(instances), warnings=tuple(dict.fromkeys(warnings)))


def _kept_caches(instances: Sequence[Instance], running: Sequence[Placed]) -> dict[str, int]:
    """The prompt cache bounds of the running instances that stay on the same cores: kept
    (memory_fit.prompt_cache_bounds), since a new bound alone would restart them."""
    cpus = {i.name: i.cpus for i in instances}
    return {r.name: r.prompt_cache_mib for r in running
            if r.prompt_cache_mib is not None and cpus.get(r.name) == r.cpus}


def _per_node_instances(config: Config, served: tuple[ServedModel, ...], topo: Topology, view: Topology,
                        allowed: Allowed, reserved: set[tuple[int, ...]], warnings: list[str], source: str,
                        running: Sequence[Placed]) -> list[Instance]:
    """Steps 1, 3 and 4b (mode = "per-node"), one allocator for both forms: each model's
    nodes and usable cores, then each node's cores split between the instances of the models
    there (plan/multi.py: along L3, the running plan's cores kept), each bound to the node's
    memory (or the nearest memory); instances in the file's order of models, then nodes."""
    usable: dict[str, dict[int, list[tuple[int, ...]]]] = {}
    for model in served:
        selected = _select_nodes(model, topo, view, allowed, warnings, source)
        usable[model.ident] = _usable_cores(model, view, selected, reserved, warnings, source)
    known = {n.id: n for n in view.nodes}
    cores_of: dict[tuple[str, int], list[list[tuple[int, ...]]]] = {}
    mems: dict[int, tuple[int, ...]] = {}
    for node_id in sorted({n for u in usable.values() for n in u}):
        here = [m for m in served if node_id in usable[m.ident]]
        wants = [Want(m, m.view.placement.instances_per_node, m.cores_per_instance, _had(m, node_id, view, running))
                 for m in here]
        cores = next(usable[m.ident][node_id] for m in here)  # the same for every model: reserve_cpus is global
        for model, groups in zip(here, split_node(known[node_id], cores, wants, source), strict=True):
            cores_of[(model.ident, node_id)] = groups
        mems[node_id] = _memory_nodes(known[node_id], view, warnings)
    instances = []
    for model in served:
        per_node = model.view.placement.instances_per_node
        for node_id in sorted(usable[model.ident]):
            for j, group in enumerate(cores_of[(model.ident, node_id)]):
                cpus, places = _threads_of(group, config.placement.smt)
                name = unitnames.instance_name(config.systemd.template, instance_ident(model.ident, node_id, j,
                                                                                       per_node))
                instances.append(Instance(name, node_id, cpus, places, mems[node_id], Policy.BIND, len(cpus), 0,
                                          model=model.ident))
    return instances


def _had(model: ServedModel, node: int, topo: Topology, running: Sequence[Placed]) -> tuple[tuple[Core, ...], ...]:
    """The cores each of the model's instances on the node has in the running plan (by k)."""
    per_node = model.view.placement.instances_per_node
    by_name = {i.name: i for i in running}
    had = []
    for k in range(per_node):
        old = by_name.get(unitnames.instance_name(model.view.systemd.template,
                                                  instance_ident(model.ident, node, k, per_node)))
        had.append(tuple(dict.fromkeys(c for c in map(topo.sibling_core, old.cpus) if c)) if old else ())
    return tuple(had)


def _select_nodes(model: ServedModel, topo: Topology, view: Topology, allowed: Allowed, warnings: list[str],
                  source: str) -> list[Node]:
    """Step 1: the nodes `placement.nodes` names (memory-only nodes only to interleave over),
    as the instances may use them (`view`). A node none of whose CPUs is allowed hosts no
    instance: said with nodes = "all", refused when named."""
    placement = model.view.placement
    nodes_key = model.key_for("placement.nodes")  # `placement.nodes`, or the model's own `models[k].nodes`
    known = {n.id: n for n in view.nodes}
    shut_out = [n.id for n in topo.nodes if n.has_cpus and not known[n.id].has_cpus]
    if placement.nodes == "all":
        if shut_out:
            warnings.append(f"node {format_list(shut_out)}: none of its CPUs is allowed to the instances "
                            f"({allowed.describe()}): no instance there")
        return [n for n in view.nodes if n.has_cpus or placement.mode == "interleave"]
    missing = [n for n in placement.nodes if n not in known]
    if missing:
        raise ConfigError(
            source, nodes_key,
            f"node {format_list(missing)} does not exist on this machine (nodes: {format_list(known)})",
            placement.nodes, True,
        )
    selected = [known[n] for n in sorted(placement.nodes)]
    denied = [n.id for n in selected if n.id in shut_out]
    if denied and placement.mode == "per-node":
        raise ConfigError(
            source, nodes_key,
            f"node {format_list(denied)}: none of its CPUs is allowed to the instances ({allowed.describe()}); drop "
            f"it from {nodes_key}, or give the instances its CPUs (the container's --cpuset-cpus, the pod's "
            "CPUs, the slice's AllowedCPUs=)", placement.nodes, True,
        )
    cpuless = [n.id for n in selected if not n.has_cpus]
    if cpuless and placement.mode == "per-node":
        raise ConfigError(
            source, nodes_key,
            f"node {format_list(cpuless)} has no CPUs (memory-only) and cannot host an instance; "
            "remove it, or use mode = \"interleave\" to spread memory over it",
            placement.nodes, True,
        )
    return selected


def _reserved_cores(config: Config, topo: Topology, warnings: list[str], source: str) -> set[tuple[int, ...]]:
    """Step 2: `reserve_cpus`, widened to whole cores (a sibling would share its pipeline)."""
    reserved = config.placement.reserved
    online = topo.online_cpus
    absent = reserved - online
    if absent:
        raise ConfigError(
            source, "placement.reserve_cpus",
            f"CPU {format_list(absent)} is not an online CPU of this machine (online: {format_list(online)})",
            config.placement.reserve_cpus, True,
        )
    cores = reserved_cores(topo, reserved)
    expanded = {c for core in cores for c in core}
    if expanded - reserved:
        warnings.append(
            f"reserve_cpus {format_list(reserved)} covers whole cores: CPUs {format_list(expanded)} are reserved"
        )
    return cores


def reserved_cores(topo: Topology, reserved: Iterable[int]) -> set[tuple[int, ...]]:
    """The rule: reserving a CPU reserves its whole core (a sibling would share its pipeline)."""
    return {core for core in map(topo.sibling_core, reserved) if core}


def unreserved_cores(node: Node, reserved: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The node's cores an instance may use: all but the `reserved_cores` (a core that the
    cgroup allows only some siblings of is reserved if any of its CPUs is)."""
    taken = {c for core in reserved for c in core}
    return [core for core in node.cores if not taken.intersection(core)]


def _usable_cores(model: ServedModel, topo: Topology, selected: list[Node], reserved: set[tuple[int, ...]],
                  warnings: list[str], source: str) -> dict[int, list[tuple[int, ...]]]:
    """Step 3: per selected node, its cores minus the reserved ones. Rule 1: only nodes with
    cores left host an instance (with nodes = "all"; a node named by id must keep one)."""
    placement = model.view.placement
    nodes_key = model.key_for("placement.nodes")
    known = {n.id: n for n in topo.nodes}
    usable: dict[int, list[tuple[int, ...]]] = {}
    fully_reserved: list[int] = []
    for node in selected:
        if not node.has_cpus:
            continue
        cores = unreserved_cores(node, reserved)
        if cores:
            usable[node.id] = cores
        else:
            fully_reserved.append(node.id)
    if fully_reserved and placement.nodes != "all":
        # The operator asked for this node by id: silently dropping it would surprise.
        raise ConfigError(
            source, "placement.reserve_cpus",
            f"reserves every CPU of node {format_list(fully_reserved)} "
            f"({format_list(c for n in fully_reserved for c in known[n].cpus)}); leave it at least one core "
            f"or drop it from {nodes_key}",
            placement.reserve_cpus, True,
        )
    if fully_reserved:
        if not usable:
            raise ConfigError(
                source, "placement.reserve_cpus",
                "reserves every CPU of every node: no instance could run; leave at least one core",
                placement.reserve_cpus, True,
            )
        warnings.append(f"reserve_cpus takes every CPU of node {format_list(fully_reserved)}: no instance there")
    if not usable:
        raise ConfigError(source, nodes_key, "selects no node with CPUs", placement.nodes, True)
    return usable


def _interleaved_instance(config: Config, selected: list[Node],
                          usable: dict[int, list[tuple[int, ...]]]) -> list[Instance]:
    """Step 4a (mode = "interleave"): one instance over every usable core, memory over every selected node."""
    cores = [c for nid in sorted(usable) for c in usable[nid]]
    cpus, places = _threads_of(cores, config.placement.smt)
    mems = tuple(sorted(n.id for n in selected if n.has_memory)) or tuple(sorted(usable))
    return [Instance(unitnames.instance_name(config.systemd.template, "interleave"), None, cpus, places, mems,
                     Policy.INTERLEAVE, len(cpus), 0)]


def _machine_ports(config: Config, topo: Topology, served: tuple[ServedModel, ...], source: str,
                   allowed: Allowed) -> dict[str, int]:
    """The ports the instances have on the whole machine: when a cgroup takes some nodes
    away, the others keep their ports (and their processes: nothing of theirs changed)."""
    if allowed.cpus is None and allowed.mems is None:
        return {}
    try:
        return {i.name: i.port for i in _plan(config, topo, served, None, source, UNRESTRICTED, ()).instances}
    except ConfigError:
        return {}




def _thread_counts(config: ModelView, instances: list[Instance], source: str,
                   keys: tuple[str, str] = ("placement.threads", "placement.threads_batch")) -> list[Instance]:
    """Step 6: threads (generation) and threads_batch (prompt): one per CPU of the instance
    ("auto"), or the configured count, which no instance may have more of than CPUs. `keys`:
    where the counts are set, as a refusal names them."""
    placement = config.placement
    for key, wanted in zip(keys, (placement.threads, placement.threads_batch), strict=True):
        if wanted == "auto":
            continue
        short = min(instances, key=lambda i: len(i.cpus))
        if wanted > len(short.cpus):
            smt = ("with smt = true" if placement.smt else "one per physical core with smt = false; smt = true counts "
                   "SMT siblings too")
            raise ConfigError(source, key, f"{short.name} has only {len(short.cpus)} CPUs ({smt}); use at most "
                              f"{len(short.cpus)} or \"auto\"", wanted, True)
    result = []
    for i in instances:
        threads = len(i.cpus) if placement.threads == "auto" else placement.threads
        batch = threads if placement.threads_batch == "auto" else placement.threads_batch
        result.append(replace(i, threads=threads, threads_batch=batch))
    return result


def _quota_cap(config: Config, instances: list[Instance], allowed: Allowed, warnings: list[str]) -> list[Instance]:
    """Step 7: a CPU quota (cpu.max) is CPU time, not CPUs: more threads than it holds take
    turns, and llama.cpp's threads wait on each other at every step. With "auto", the
    instances' threads together fit in floor(quota); an explicit count above it is said."""
    budget = allowed.thread_budget
    placement = config.placement
    if budget is None:
        return instances
    total = sum(i.threads for i in instances)
    if total <= budget:
        return instances
    advice = ("a cpuset gives whole CPUs instead of a share of their time: a Guaranteed pod with integer CPUs, or "
              "`--cpuset-cpus` for a container")
    if placement.threads != "auto":
        warnings.append(f"placement.threads = {placement.threads} x {len(instances)} instance(s) is {total} threads, "
                        f"more than the CPU quota of {allowed.quota_cpus:g} ({allowed.source}): they will be "
                        f"throttled; use \"auto\", or {advice}")
        return instances
    kept = instances
    if budget < len(instances):
        # One thread each is the least an instance can run on: more instances than the
        # quota holds would take turns on it. Keep those with the most CPUs (then node order).
        ranked = sorted(range(len(instances)), key=lambda k: (-len(instances[k].cpus), k))[:budget]
        kept = [instances[k] for k in sorted(ranked)]
        dropped = [i for i in instances if i not in kept]
        warnings.append(f"the CPU quota of {allowed.quota_cpus:g} ({allowed.source}) holds {budget} thread(s): "
                        f"{len(kept)} instance(s) of {len(instances)} planned, "
                        f"{', '.join(f'{i.name} (CPUs {format_list(i.cpus)})' for i in dropped)} left out; {advice}")
    share, extra = divmod(budget, len(kept))
    capped = []
    for k, i in enumerate(kept):
        threads = max(1, min(len(i.cpus), share + (1 if k < extra else 0)))
        batch = threads if placement.threads_batch == "auto" else i.threads_batch
        capped.append(replace(i, threads=threads, threads_batch=batch))
    warnings.append(f"the CPU quota of {allowed.quota_cpus:g} ({allowed.source}) caps the threads at "
                    f"{sum(i.threads for i in capped)} in all (the CPUs would take {total}); {advice}")
    return capped
