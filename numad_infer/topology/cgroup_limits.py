"""What the instances may use, beside what the machine has. Pure.

In a container, a Kubernetes pod or a slice with `AllowedCPUs=`, sysfs still shows every
CPU and node of the host, but the kernel lets the instances run only on their cgroup's
cpuset (`cpuset.cpus.effective`, `cpuset.mems.effective`) and gives them only its CPU
quota (`cpu.max`). `within(topology, allowed)` is the machine as the planner must see
it: the allowed CPUs only (a core keeps only its allowed siblings), memory only on
allowed nodes. The quota caps threads (planner, `_thread_counts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from numad_infer.topology.model import Node, Topology
from numad_infer.util.cpuset import format_list


@dataclass(frozen=True)
class Allowed:
    cpus: frozenset[int] | None  # None: not restricted (every online CPU)
    mems: frozenset[int] | None  # None: every node's memory
    quota_cpus: float | None = None  # CPU time per second (cpu.max quota/period), None: unlimited
    source: str = ""  # where it was read, for messages: "the daemon's cgroup", "system.slice"

    @property
    def thread_budget(self) -> int | None:
        """Threads that fit in the quota all at once (at least one)."""
        return None if self.quota_cpus is None else max(1, math.floor(self.quota_cpus + 1e-9))

    def describe(self) -> str:
        parts = [f"CPUs {'all' if self.cpus is None else format_list(self.cpus)}",
                 f"memory nodes {'all' if self.mems is None else format_list(self.mems)}"]
        if self.quota_cpus is not None:
            parts.append(f"CPU quota {self.quota_cpus:g}")
        return ", ".join(parts) + (f" ({self.source})" if self.source else "")

    def to_dict(self) -> dict[str, object]:
        return {"cpus": None if self.cpus is None else sorted(self.cpus),
                "mems": None if self.mems is None else sorted(self.mems),
                "quota_cpus": self.quota_cpus, "source": self.source}


UNRESTRICTED = Allowed(None, None)


def left_out(topology: Topology, allowed: Allowed) -> frozenset[int]:
    """Online CPUs the instances may not use."""
    return frozenset() if allowed.cpus is None else topology.online_cpus - allowed.cpus


def within(topology: Topology, allowed: Allowed) -> Topology:
    """The topology restricted to what `allowed` permits (nodes stay, so node ids and
    distances keep their meaning; a node may end up with no CPUs or no usable memory)."""
    if allowed.cpus is None and allowed.mems is None:
        return topology
    return replace(topology, nodes=tuple(_node_within(node, allowed) for node in topology.nodes))


def _node_within(node: Node, allowed: Allowed) -> Node:
    keep = allowed.cpus
    if keep is not None:
        cores = tuple(core for core in (tuple(c for c in core if c in keep) for core in node.cores) if core)
        l3 = tuple(g for g in (tuple(core for core in (tuple(c for c in co if c in keep) for co in group) if core)
                               for group in node.l3_groups) if g)
        node = replace(node, cpus=tuple(c for c in node.cpus if c in keep), cores=cores, l3_groups=l3)
    if allowed.mems is not None and node.id not in allowed.mems:
        node = replace(node, memory_allowed=False)
    return node
