"""hwloc's reading of a sysfs root: the independent oracle for numad_infer.topology.model.

Runs `lstopo-no-graphics --disallowed --of xml` with HWLOC_FSROOT pointed at the root
and reduces its answer to what numa-infer also computes: node -> online CPUs and the
groups of thread siblings (one per Core object; a PU hwloc left without a Core is its
own group).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass

LSTOPO = shutil.which("lstopo-no-graphics")


@dataclass(frozen=True)
class HwlocView:
    node_cpus: dict[int, frozenset[int]]
    cores: frozenset[frozenset[int]]


def _mask(obj: ET.Element) -> frozenset[int]:
    # hwloc writes 32-bit words, most significant first, and shortens zero words:
    # "0xffffffff,,0x0" is bits 64-95. (Its "0xf...f" infinite sets never name a node.)
    value = 0
    for word in obj.get("cpuset", "0x0").split(","):
        word = word.strip().removeprefix("0x")
        value = value << 32 | (int(word, 16) if word else 0)
    return frozenset(i for i in range(value.bit_length()) if value >> i & 1)


def read(fsroot: str) -> HwlocView:
    assert LSTOPO, "hwloc-nox is not installed"
    env = dict(os.environ, HWLOC_FSROOT=fsroot, HWLOC_COMPONENTS="linux,no_os,-x86,-pci,-opencl,-cuda,-nvml,-rsmi,-levelzero,-gl")
    xml_text = subprocess.run(
        [LSTOPO, "--disallowed", "--no-io", "--of", "xml", "-"],
        env=env, check=True, capture_output=True, text=True,
    ).stdout
    root = ET.fromstring(xml_text)
    node_cpus: dict[int, frozenset[int]] = {}
    cores: set[frozenset[int]] = set()
    for obj in root.iter("object"):
        kind = obj.get("type")
        if kind == "NUMANode":
            node_cpus[int(obj.get("os_index", "0"))] = _mask(obj)
        elif kind == "Core":
            cores.add(_mask(obj))
    covered = frozenset().union(*cores) if cores else frozenset()
    for obj in root.iter("object"):
        if obj.get("type") == "PU":
            cpu = int(obj.get("os_index", "0"))
            if cpu not in covered:
                cores.add(frozenset({cpu}))
    return HwlocView(node_cpus=node_cpus, cores=frozenset(cores))


def owned_cpus(view: HwlocView) -> dict[int, frozenset[int]]:
    """Node -> CPUs it owns in the kernel's sense.

    hwloc gives a CPU-less node (CXL, HBM, GPU memory) the CPU set of its locality,
    so a CPU may appear under several nodes; it belongs to the node with the
    smallest such set (ties: the lowest id), which is the node whose `cpulist` has it.
    """
    owned: dict[int, set[int]] = {node: set() for node in view.node_cpus}
    for cpu in frozenset().union(*view.node_cpus.values()) if view.node_cpus else ():
        holders = [n for n, cpus in view.node_cpus.items() if cpu in cpus]
        owner = min(holders, key=lambda n: (len(view.node_cpus[n]), n))
        owned[owner].add(cpu)
    return {n: frozenset(c) for n, c in owned.items()}
