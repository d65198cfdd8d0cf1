"""Topology from synthetic sysfs trees: machines these CI hosts are not (see tests/fakesys.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from numad_infer.errors import TopologyError
from numad_infer.topology.model import RawCpu, RawNode, SysfsSnapshot, build_topology
from numad_infer.topology.sysfs import read_topology
from tests import fakesys

CASES = {
    "dual_socket_smt": (
        fakesys.dual_socket_smt(),
        {0: list(range(0, 32)) + list(range(64, 96)), 1: list(range(32, 64)) + list(range(96, 128))},
        {0: [[c, c + 64] for c in range(32)], 1: [[c, c + 64] for c in range(32, 64)]},
    ),
    "epyc_nps4": (
        fakesys.epyc_nps4(),
        {n: list(range(16 * n, 16 * n + 16)) + list(range(64 + 16 * n, 64 + 16 * n + 16)) for n in range(4)},
        {n: [[c, c + 64] for c in range(16 * n, 16 * n + 16)] for n in range(4)},
    ),
    "round_robin_sockets": (
        fakesys.round_robin_sockets(),
        {0: list(range(0, 16, 2)), 1: list(range(1, 16, 2))},
        {0: [[c] for c in range(0, 16, 2)], 1: [[c] for c in range(1, 16, 2)]},
    ),
    "cxl_memory_node": (
        fakesys.cxl_memory_node(),
        {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: []},
        {0: [[0], [1], [2], [3]], 1: [[4], [5], [6], [7]], 2: []},
    ),
    "offline_cpus": (
        fakesys.offline_cpus(),
        {0: [0, 1, 2, 8, 10], 1: [4, 5, 6, 7, 12, 13, 14, 15]},
        {0: [[0, 8], [1], [2, 10]], 1: [[4, 12], [5, 13], [6, 14], [7, 15]]},
    ),
    "memoryless_cpu_node": (
        fakesys.memoryless_cpu_node(),
        {0: [0, 1], 1: [2, 3], 2: [4, 5]},
        {0: [[0], [1]], 1: [[2], [3]], 2: [[4], [5]]},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_synthetic_machine_reads_exactly(tmp_path: Path, name: str) -> None:
    machine, cpus, cores = CASES[name]
    topo = read_topology(fakesys.write_tree(tmp_path, machine))
    assert {n.id: list(n.cpus) for n in topo.nodes} == cpus
    assert {n.id: [list(c) for c in n.cores] for n in topo.nodes} == cores
    for node in topo.nodes:
        raw = machine.nodes[node.id]
        assert node.memory_total_bytes == raw.memory_kb * 1024
        assert list(node.distances.values()) == list(raw.distances)


def test_json_shape_matches_the_documented_one(tmp_path: Path) -> None:
    topo = read_topology(fakesys.write_tree(tmp_path, fakesys.dual_socket_smt()))
    node0 = topo.to_dict()["nodes"][0]
    assert set(node0) >= {"id", "cpus", "cores", "memory_total_bytes", "distances"}
    assert node0["cores"][0] == [0, 64] and node0["distances"] == {"0": 10, "1": 21}


def test_no_node_directories_means_one_node_with_every_online_cpu(tmp_path: Path) -> None:
    snap = SysfsSnapshot(online_cpus=frozenset({0, 1, 2, 3}), cpus={c: RawCpu() for c in range(4)},
                         nodes=None, meminfo_total_bytes=8 << 30)
    topo = build_topology(snap)
    assert [(n.id, n.cpus, n.memory_total_bytes) for n in topo.nodes] == [(0, (0, 1, 2, 3), 8 << 30)]
    assert [list(c) for c in topo.nodes[0].cores] == [[0], [1], [2], [3]]


def test_overlapping_nodes_lowest_keeps_cpus_others_become_memory_only() -> None:
    snap = SysfsSnapshot(
        online_cpus=frozenset(range(4)), cpus={c: RawCpu() for c in range(4)},
        nodes={0: RawNode(frozenset({0, 1}), 1 << 30, (10, 20)), 1: RawNode(frozenset({1, 2, 3}), 1 << 30, (20, 10))},
    )
    topo = build_topology(snap)
    assert topo.node(0).cpus == (0, 1) and topo.node(1).cpus == ()
    assert any("node 1 claims CPUs 1" in w and "memory-only" in w for w in topo.warnings)
    assert any("2-3 belong to no online NUMA node" in w for w in topo.warnings)


def test_old_kernel_masks_only(tmp_path: Path) -> None:
    # 2.6-era sysfs: cpumap and thread_siblings masks, no lists, no cpu/online.
    cpu = tmp_path / "sys/devices/system/cpu"
    for c, mask in ((0, "00000003"), (1, "00000003"), (2, "0000000c"), (3, "0000000c")):
        (cpu / f"cpu{c}/topology").mkdir(parents=True)
        (cpu / f"cpu{c}/topology/thread_siblings").write_text(mask + "\n")
    node = tmp_path / "sys/devices/system/node/node0"
    node.mkdir(parents=True)
    (node / "cpumap").write_text("0000000f\n")
    topo = read_topology(tmp_path)
    assert [list(c) for c in topo.nodes[0].cores] == [[0, 1], [2, 3]]
    assert topo.node(0).memory_total_bytes == 0


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda root: None, "is not a Linux filesystem root"),
        (lambda root: (root / "sys/devices/system/cpu").mkdir(parents=True), "no online CPU"),
        (lambda root: ((root / "sys/devices/system/cpu/cpu0").mkdir(parents=True),
                       (root / "sys/devices/system/cpu/online").write_text("zero\n")), "cannot parse 'zero'"),
    ],
)
def test_tree_that_cannot_be_understood_is_a_clear_error(tmp_path: Path, setup, message: str) -> None:
    setup(tmp_path)
    with pytest.raises(TopologyError, match=message):
        read_topology(tmp_path)
