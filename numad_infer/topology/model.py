"""The machine's NUMA topology as data, built purely from what a sysfs reader collected.

No I/O here: `numad_infer.topology.sysfs` reads a tree into a `SysfsSnapshot`; `build_topology`
turns it into a `Topology` the planner can trust (online CPUs only, every CPU in at
most one node, cores as the kernel groups thread siblings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from numad_infer.errors import TopologyError
from numad_infer.util.cpuset import format_list


@dataclass(frozen=True)
class RawCpu:
    """What sysfs says about one cpuN directory; None where the file is missing."""

    online: bool | None = None
    siblings: frozenset[int] | None = None
    l3: frozenset[int] | None = None


@dataclass(frozen=True)
class RawNode:
    """What sysfs says about one nodeN directory; None where the file is missing."""

    cpus: frozenset[int] | None = None
    memory_total_bytes: int | None = None
    distances: tuple[int, ...] | None = None


@dataclass(frozen=True)
class SysfsSnapshot:
    online_cpus: frozenset[int] | None
    cpus: dict[int, RawCpu]
    nodes: dict[int, RawNode] | None  # None: the kernel exposes no node directories
    meminfo_total_bytes: int | None = None


@dataclass(frozen=True)
class Node:
    id: int
    cpus: tuple[int, ...]
    cores: tuple[tuple[int, ...], ...]
    memory_total_bytes: int
    distances: dict[int, int]
    # Cores grouped by the L3 they share, in core order; one group when unknown.
    l3_groups: tuple[tuple[tuple[int, ...], ...], ...] = ()
    # False when the instances' cgroup may not allocate here (allowed.within).
    memory_allowed: bool = True

    @property
    def has_cpus(self) -> bool:
        return bool(self.cpus)

    @property
    def has_memory(self) -> bool:
        """Memory the instances can allocate: present, and allowed to them."""
        return self.memory_total_bytes > 0 and self.memory_allowed


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]
    warnings: tuple[str, ...] = field(default=())

    def node(self, node_id: int) -> Node:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(node_id)

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(n.id for n in self.nodes)

    @property
    def online_cpus(self) -> frozenset[int]:
        return frozenset(c for n in self.nodes for c in n.cpus)

    def sibling_core(self, cpu: int) -> tuple[int, ...] | None:
        for node in self.nodes:
            for core in node.cores:
                if cpu in core:
                    return core
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [
                {
                    "id": n.id,
                    "cpus": list(n.cpus),
                    "cores": [list(c) for c in n.cores],
                    "memory_total_bytes": n.memory_total_bytes,
                    "distances": {str(k): v for k, v in sorted(n.distances.items())},
                }
                for n in self.nodes
            ],
            "warnings": list(self.warnings),
        }


def _online_cpus(snap: SysfsSnapshot) -> frozenset[int]:
    # cpu/online is authoritative where present; old kernels only have per-CPU files,
    # and cpu0 often has no `online` file because it cannot be taken offline.
    candidates = snap.online_cpus if snap.online_cpus is not None else frozenset(snap.cpus)
    return frozenset(c for c in candidates if not (c in snap.cpus and snap.cpus[c].online is False))


def _group_cores(online: frozenset[int], cpus: dict[int, RawCpu]) -> list[tuple[int, ...]]:
    """Thread-sibling groups, as hwloc forms them: the lowest unassigned CPU claims its siblings."""
    assigned: set[int] = set()
    cores: list[tuple[int, ...]] = []
    for cpu in sorted(online):
        if cpu in assigned:
            continue
        raw = cpus.get(cpu)
        siblings = raw.siblings if raw is not None and raw.siblings is not None else frozenset()
        core = (set(siblings) & online) - assigned | {cpu}
        assigned |= core
        cores.append(tuple(sorted(core)))
    return cores


def _l3_groups(cores: list[tuple[int, ...]], cpus: dict[int, RawCpu]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    groups: dict[frozenset[int], list[tuple[int, ...]]] = {}
    for core in cores:
        raw = cpus.get(core[0])
        key = raw.l3 if raw is not None and raw.l3 else frozenset()
        groups.setdefault(key, []).append(core)
    if frozenset() in groups and len(groups) > 1:
        # Partial cache information says nothing reliable about boundaries.
        return (tuple(cores),) if cores else ()
    return tuple(tuple(g) for g in sorted(groups.values(), key=lambda g: g[0][0]))


def _assign_cpus(raw_nodes: dict[int, RawNode], online: frozenset[int],
                 warnings: list[str]) -> tuple[dict[int, int], dict[int, set[int]]]:
    """CPU -> its node, and node -> its CPUs.

    Firmware sometimes makes several nodes claim one CPU. The lowest node keeps its
    CPUs; a later node that claims any of them is not trusted with CPUs at all and
    becomes memory-only (hwloc drops such nodes' CPU sets the same way).
    """
    owner: dict[int, int] = {}
    node_cpus: dict[int, set[int]] = {}
    for node_id in sorted(raw_nodes):
        claimed = (raw_nodes[node_id].cpus or frozenset()) & online
        clash = {c for c in claimed if c in owner}
        if clash:
            warnings.append(
                f"node {node_id} claims CPUs {format_list(clash)} that node {min(owner[c] for c in clash)} "
                f"already has (overlapping nodes from firmware): node {node_id} is treated as memory-only"
            )
            claimed = frozenset()
        for c in claimed:
            owner[c] = node_id
        node_cpus[node_id] = set(claimed)
    return owner, node_cpus


def _distances(node_id: int, raw: RawNode, sorted_ids: list[int], warnings: list[str]) -> dict[int, int]:
    if raw.distances is not None:
        if len(raw.distances) == len(sorted_ids):
            return dict(zip(sorted_ids, raw.distances, strict=False))
        warnings.append(f"node {node_id}: distance row has {len(raw.distances)} entries for "
                        f"{len(sorted_ids)} nodes; distances ignored")
    # Without a distance table, the kernel's defaults: 10 local, 20 remote.
    return {other: 10 if other == node_id else 20 for other in sorted_ids}


def build_topology(snap: SysfsSnapshot) -> Topology:
    warnings: list[str] = []
    online = _online_cpus(snap)
    if not online:
        raise TopologyError("no online CPU found (cpu/online and the cpuN directories are empty or unreadable)")

    raw_nodes = snap.nodes
    if not raw_nodes:
        # A kernel built without NUMA (or a non-NUMA machine) is one node holding everything.
        raw_nodes = {0: RawNode(cpus=online, memory_total_bytes=snap.meminfo_total_bytes or 0, distances=(10,))}

    owner, node_cpus = _assign_cpus(raw_nodes, online, warnings)
    orphans = online - owner.keys()
    if orphans:
        warnings.append(
            f"online CPUs {format_list(orphans)} belong to no online NUMA node; numa-infer will not use them"
        )

    cores = _group_cores(online, snap.cpus)
    sorted_ids = sorted(raw_nodes)
    nodes: list[Node] = []
    for node_id in sorted_ids:
        raw = raw_nodes[node_id]
        mine = node_cpus[node_id]
        node_cores = [tuple(c for c in core if c in mine) for core in cores]
        node_cores = [c for c in node_cores if c]
        distances = _distances(node_id, raw, sorted_ids, warnings)
        nodes.append(
            Node(
                id=node_id,
                cpus=tuple(sorted(mine)),
                cores=tuple(node_cores),
                memory_total_bytes=raw.memory_total_bytes or 0,
                distances=distances,
                l3_groups=_l3_groups(node_cores, snap.cpus),
            )
        )
    return Topology(nodes=tuple(nodes), warnings=tuple(warnings))
