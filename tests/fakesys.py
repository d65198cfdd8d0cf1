"""Write synthetic sysfs trees (the same files a kernel writes) for machines we do not have.

Fakes stand in for hardware that cannot run here (a 128-core, 8-node server); the
reader under test is the real one, pointed at the tree with --fsroot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from numad_infer.util.cpuset import format_list


@dataclass(frozen=True)
class FakeNode:
    cpus: tuple[int, ...]
    memory_kb: int
    distances: tuple[int, ...]


@dataclass(frozen=True)
class FakeMachine:
    """Every field required: a table row says exactly what the kernel would say."""

    nodes: dict[int, FakeNode]
    siblings: tuple[tuple[int, ...], ...]  # thread-sibling groups covering every CPU
    l3: tuple[tuple[int, ...], ...]  # CPUs sharing an L3
    offline: tuple[int, ...]

    @property
    def all_cpus(self) -> list[int]:
        return sorted(c for group in self.siblings for c in group)


def write_tree(root: Path, machine: FakeMachine) -> Path:
    cpu_root = root / "sys/devices/system/cpu"
    cpu_root.mkdir(parents=True)
    cpus = machine.all_cpus
    online = [c for c in cpus if c not in machine.offline]
    (cpu_root / "online").write_text(format_list(online) + "\n")
    (cpu_root / "possible").write_text(format_list(cpus) + "\n")
    for group in machine.siblings:
        for cpu in group:
            d = cpu_root / f"cpu{cpu}"
            (d / "topology").mkdir(parents=True)
            if cpu != 0:
                (d / "online").write_text("0\n" if cpu in machine.offline else "1\n")
            if cpu in machine.offline:
                continue  # the kernel removes topology/ and cache/ of an offline CPU's contents
            (d / "topology/thread_siblings_list").write_text(format_list(c for c in group if c not in machine.offline) + "\n")
            l3 = next(g for g in machine.l3 if cpu in g)
            cache = d / "cache/index3"
            cache.mkdir(parents=True)
            (cache / "level").write_text("3\n")
            (cache / "shared_cpu_list").write_text(format_list(l3) + "\n")
    node_root = root / "sys/devices/system/node"
    node_root.mkdir(parents=True)
    for node_id, node in machine.nodes.items():
        d = node_root / f"node{node_id}"
        d.mkdir()
        (d / "cpulist").write_text(format_list(node.cpus) + "\n")
        (d / "meminfo").write_text(f"Node {node_id} MemTotal:       {node.memory_kb} kB\nNode {node_id} MemFree: 1 kB\n")
        (d / "distance").write_text(" ".join(map(str, node.distances)) + "\n")
    (root / "proc").mkdir()
    total = sum(n.memory_kb for n in machine.nodes.values())
    (root / "proc/meminfo").write_text(f"MemTotal:       {total} kB\n")
    return root


GiB_KB = 1024 * 1024


def dual_socket_smt() -> FakeMachine:
    """2 sockets x 32 cores x 2 threads, siblings at +64 (Intel/AMD default numbering)."""
    return FakeMachine(
        nodes={
            0: FakeNode(tuple(range(0, 32)) + tuple(range(64, 96)), 256 * GiB_KB, (10, 21)),
            1: FakeNode(tuple(range(32, 64)) + tuple(range(96, 128)), 256 * GiB_KB, (21, 10)),
        },
        siblings=tuple((c, c + 64) for c in range(64)),
        l3=(tuple(range(0, 32)) + tuple(range(64, 96)), tuple(range(32, 64)) + tuple(range(96, 128))),
        offline=(),
    )


def epyc_nps4() -> FakeMachine:
    """EPYC 64 cores, NPS4: 4 nodes x 16 cores x 2 threads, 4 cores per CCX L3, siblings at +64."""
    nodes = {}
    for n in range(4):
        cores = tuple(range(16 * n, 16 * n + 16))
        nodes[n] = FakeNode(cores + tuple(c + 64 for c in cores), 64 * GiB_KB,
                            tuple(10 if m == n else 12 for m in range(4)))
    l3 = tuple(tuple(range(4 * i, 4 * i + 4)) + tuple(range(64 + 4 * i, 64 + 4 * i + 4)) for i in range(16))
    return FakeMachine(nodes=nodes, siblings=tuple((c, c + 64) for c in range(64)), l3=l3, offline=())


def round_robin_sockets() -> FakeMachine:
    """Firmware numbering CPUs round-robin across 2 sockets: even CPUs on node 0, odd on 1, no SMT."""
    return FakeMachine(
        nodes={0: FakeNode(tuple(range(0, 16, 2)), 32 * GiB_KB, (10, 20)),
               1: FakeNode(tuple(range(1, 16, 2)), 32 * GiB_KB, (20, 10))},
        siblings=tuple((c,) for c in range(16)),
        l3=(tuple(range(0, 16, 2)), tuple(range(1, 16, 2))),
        offline=(),
    )


def cxl_memory_node() -> FakeMachine:
    """2 CPU nodes plus node 2: CXL memory without CPUs."""
    return FakeMachine(
        nodes={0: FakeNode((0, 1, 2, 3), 16 * GiB_KB, (10, 20, 30)),
               1: FakeNode((4, 5, 6, 7), 16 * GiB_KB, (20, 10, 30)),
               2: FakeNode((), 128 * GiB_KB, (30, 30, 10))},
        siblings=tuple((c,) for c in range(8)),
        l3=((0, 1, 2, 3), (4, 5, 6, 7)),
        offline=(),
    )


def offline_cpus() -> FakeMachine:
    """2 nodes x 4 cores x 2 threads with CPU 9 (a sibling) and core 3+11 offline; node lists still name them."""
    return FakeMachine(
        nodes={0: FakeNode((0, 1, 2, 3, 8, 9, 10, 11), 8 * GiB_KB, (10, 20)),
               1: FakeNode((4, 5, 6, 7, 12, 13, 14, 15), 8 * GiB_KB, (20, 10))},
        siblings=tuple((c, c + 8) for c in range(8)),
        l3=((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)),
        offline=(3, 9, 11),
    )


def memoryless_cpu_node() -> FakeMachine:
    """Node 1 has CPUs but no memory; node 2 is nearer to it than node 0."""
    return FakeMachine(
        nodes={0: FakeNode((0, 1), 8 * GiB_KB, (10, 20, 30)),
               1: FakeNode((2, 3), 0, (20, 10, 15)),
               2: FakeNode((4, 5), 8 * GiB_KB, (30, 15, 10))},
        siblings=tuple((c,) for c in range(6)),
        l3=((0, 1), (2, 3), (4, 5)),
        offline=(),
    )
