"""ProcReader.memory_room: what a surge's copy may take (supervision/surge.py), over fake
sysfs/procfs/cgroupfs trees laid out as the kernel lays them out."""

from __future__ import annotations

import os
from pathlib import Path

from numad_infer.host.procfs import ProcReader

MIB = 1024 * 1024


def tree(tmp_path: Path, free_mib: dict[int, tuple[int, int]], cgroup_lines: str = "0::/\n") -> Path:
    """Node meminfo (MemFree, Inactive(file) in MiB per node) and this process's /proc/PID/cgroup."""
    for node, (free, inactive) in free_mib.items():
        directory = tmp_path / f"sys/devices/system/node/node{node}"
        directory.mkdir(parents=True)
        (directory / "meminfo").write_text(
            f"Node {node} MemTotal:       32000000 kB\n"
            f"Node {node} MemFree:        {free * 1024} kB\n"
            f"Node {node} Active(file):   {7 * 1024} kB\n"
            f"Node {node} Inactive(file): {inactive * 1024} kB\n")
    proc = tmp_path / "proc" / str(os.getpid())
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup_lines)
    return tmp_path


def limit(root: Path, directory: str, files: tuple[str, str], max_mib: int | str, used_mib: int) -> None:
    where = root / directory
    where.mkdir(parents=True, exist_ok=True)
    (where / files[0]).write_text(f"{max_mib * MIB if isinstance(max_mib, int) else max_mib}\n")
    (where / files[1]).write_text(f"{used_mib * MIB}\n")


V2 = ("memory.max", "memory.current")
V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")


def test_the_nodes_free_and_inactive_file_pages_without_any_limit(tmp_path: Path) -> None:
    root = tree(tmp_path, {0: (1000, 200), 1: (500, 0)})
    assert ProcReader(root).memory_room((0,)) == 1200 * MIB
    assert ProcReader(root).memory_room((0, 1)) == 1700 * MIB


def test_a_node_without_meminfo_says_nothing(tmp_path: Path) -> None:
    root = tree(tmp_path, {0: (1000, 200)})
    assert ProcReader(root).memory_room((0, 3)) is None


def test_a_parent_cgroups_limit_binds_the_daemons_own(tmp_path: Path) -> None:
    # A Kubernetes pod: the container's cgroup has no limit, the pod's has 2 GiB of which 1.5 are used.
    root = tree(tmp_path, {0: (8000, 0)}, "0::/kubepods/pod1/ctr\n")
    limit(root, "sys/fs/cgroup/kubepods/pod1/ctr", V2, "max", 1400)
    limit(root, "sys/fs/cgroup/kubepods/pod1", V2, 2048, 1536)
    assert ProcReader(root).memory_room((0,)) == 512 * MIB


def test_the_tightest_of_the_cgroup_and_its_parents_counts(tmp_path: Path) -> None:
    root = tree(tmp_path, {0: (8000, 0)}, "0::/a/b\n")
    limit(root, "sys/fs/cgroup/a/b", V2, 1000, 900)  # 100 MiB left here
    limit(root, "sys/fs/cgroup/a", V2, 4000, 1000)   # 3000 left above
    assert ProcReader(root).memory_room((0,)) == 100 * MIB


def test_a_used_up_limit_leaves_no_room_not_a_negative_one(tmp_path: Path) -> None:
    root = tree(tmp_path, {0: (8000, 0)}, "0::/a\n")
    limit(root, "sys/fs/cgroup/a", V2, 1000, 1200)
    assert ProcReader(root).memory_room((0,)) == 0


def test_inside_a_container_the_top_cgroup_is_the_containers(tmp_path: Path) -> None:
    # Docker/containerd on v2 with a cgroup namespace: /proc/self/cgroup says 0::/ and the
    # container's limit is at the top of its cgroupfs.
    root = tree(tmp_path, {0: (8000, 0)}, "0::/\n")
    limit(root, "sys/fs/cgroup", V2, 1000, 900)
    assert ProcReader(root).memory_room((0,)) == 100 * MIB
    # On v1 the path names the host's cgroup, which the container does not see: its own is
    # mounted at the hierarchy's top.
    root = tree(tmp_path / "v1", {0: (8000, 0)}, "7:memory:/docker/abc\n")
    limit(root, "sys/fs/cgroup/memory", V1, 1000, 900)
    assert ProcReader(root).memory_room((0,)) == 100 * MIB


def test_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    # A hybrid host (this project's CI machines): the memory controller in its own v1 hierarchy.
    root = tree(tmp_path, {0: (8000, 0)}, "12:cpu,cpuacct:/docker/x\n7:memory:/docker/x\n0::/docker/x\n")
    limit(root, "sys/fs/cgroup/memory/docker/x", V1, 3000, 1000)
    assert ProcReader(root).memory_room((0,)) == 2000 * MIB


def test_an_unlimited_v1_cgroup_is_the_nodes_free_memory(tmp_path: Path) -> None:
    root = tree(tmp_path, {0: (8000, 0)}, "7:memory:/user.slice\n")
    limit(root, "sys/fs/cgroup/memory/user.slice", V1, "9223372036854771712", 1000)
    assert ProcReader(root).memory_room((0,)) == 8000 * MIB


def test_the_systemd_backends_slice_not_the_daemons_cgroup(tmp_path: Path) -> None:
    # The copy's unit starts in system.slice: its limit counts, the daemon's own does not.
    root = tree(tmp_path, {0: (8000, 0)}, "0::/system.slice/numa-infer.service\n")
    limit(root, "sys/fs/cgroup/system.slice/numa-infer.service", V2, 100, 90)
    limit(root, "sys/fs/cgroup/system.slice", V2, 6000, 2000)
    assert ProcReader(root).memory_room((0,), "system.slice") == 4000 * MIB
    assert ProcReader(root).memory_room((0,)) == 10 * MIB


def test_inactive_file_pages_under_a_limit_count_as_room(tmp_path: Path) -> None:
    # A model file read into the page cache counts in the cgroup's usage; the kernel reclaims
    # its inactive pages before the limit, so they are room (the kubelet's working set).
    root = tree(tmp_path, {0: (8000, 0)}, "7:memory:/bench\n0::/bench\n")
    limit(root, "sys/fs/cgroup/memory/bench", V1, 3000, 2000)
    (root / "sys/fs/cgroup/memory/bench/memory.stat").write_text(
        f"cache {1000 * MIB}\ninactive_file {50 * MIB}\ntotal_cache {1000 * MIB}\ntotal_inactive_file {900 * MIB}\n")
    assert ProcReader(root).memory_room((0,)) == 1900 * MIB  # v1: the hierarchy's total, not the cgroup's own
    root = tree(tmp_path / "v2", {0: (8000, 0)}, "0::/bench\n")
    limit(root, "sys/fs/cgroup/bench", V2, 3000, 2000)
    (root / "sys/fs/cgroup/bench/memory.stat").write_text(f"anon {1000 * MIB}\nfile {1000 * MIB}\n"
                                                           f"inactive_file {900 * MIB}\nactive_file {100 * MIB}\n")
    assert ProcReader(root).memory_room((0,)) == 1900 * MIB
