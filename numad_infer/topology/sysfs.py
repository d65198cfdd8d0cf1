"""Read the kernel's CPU and NUMA description from a filesystem root (like HWLOC_FSROOT).

Thin edge: collect files into a `SysfsSnapshot` and let `topology.build_topology`
decide. Missing files become None (old kernels lack many); files that exist but
cannot be parsed are errors naming the file.

Every read goes through `FsRoot`: a tree under --fsroot is someone else's capture, whose
own links (node0/cpu0 -> ../../cpu/cpu0) are followed, but a link out of it, a FIFO or a
device is an error naming the file, never read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from numad_infer.errors import TopologyError
from numad_infer.topology.model import RawCpu, RawNode, SysfsSnapshot, Topology, build_topology
from numad_infer.util.atomicfile import NotRegularFile
from numad_infer.util.cpuset import CpuListError, parse_list, parse_mask
from numad_infer.util.fsroot import FsRoot

_NUMBERED = re.compile(r"^(cpu|node)(\d+)$")


class SysfsReader:
    def __init__(self, fsroot: str | os.PathLike[str] = "/") -> None:
        self.root = Path(fsroot)
        self.tree = FsRoot(self.root)
        self.cpu_dir = self.root / "sys/devices/system/cpu"
        self.node_dirs = [self.root / "sys/devices/system/node", self.root / "sys/bus/node/devices"]

    # -- small helpers -------------------------------------------------------------
    def _text(self, path: Path) -> str | None:
        try:
            return self.tree.text(path).replace("\x00", "").strip()
        except (FileNotFoundError, NotADirectoryError, PermissionError, IsADirectoryError):
            return None
        except OSError as exc:
            raise TopologyError(f"cannot read {path}: {exc.strerror}") from exc
        except NotRegularFile as exc:
            raise TopologyError(f"not read: {exc}") from None

    def _cpus(self, path: Path, mask: bool = False) -> frozenset[int] | None:
        text = self._text(path)
        if text is None:
            return None
        try:
            return parse_mask(text) if mask else parse_list(text)
        except CpuListError as exc:
            raise TopologyError(
                f"{path}: cannot parse {text[:80]!r} as a CPU {'mask' if mask else 'list'}: {exc}") from exc

    def _first_cpus(self, base: Path, names: tuple[str, ...]) -> frozenset[int] | None:
        # Each pair is (file, is_mask): lists are preferred, masks are the old fallback.
        for name in names:
            result = self._cpus(base / name, mask=not name.endswith("list"))
            if result is not None:
                return result
        return None

    def _names(self, directory: Path) -> list[str]:
        try:
            return self.tree.listdir(directory)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return []
        except NotRegularFile as exc:
            raise TopologyError(f"not read: {exc}") from None

    def _is_dir(self, path: Path) -> bool:
        try:
            return self.tree.is_dir(path)
        except NotRegularFile as exc:
            raise TopologyError(f"not read: {exc}") from None

    def _numbered(self, directory: Path, prefix: str) -> dict[int, Path]:
        found: dict[int, Path] = {}
        for name in self._names(directory):
            match = _NUMBERED.match(name)
            if match and match.group(1) == prefix and self._is_dir(directory / name):  # dangling: offline nodes
                found[int(match.group(2))] = directory / name
        return found

    # -- the tree ----------------------------------------------------------------------
    def _read_cpu(self, path: Path) -> RawCpu:
        online_text = self._text(path / "online")
        online = None if online_text in (None, "") else online_text != "0"
        siblings = self._first_cpus(
            path / "topology",
            ("core_cpus_list", "thread_siblings_list", "core_cpus", "thread_siblings"),
        )
        l3: frozenset[int] | None = None
        for index in sorted(path / "cache" / name for name in self._names(path / "cache") if name.startswith("index")):
            if self._text(index / "level") == "3":
                l3 = self._first_cpus(index, ("shared_cpu_list", "shared_cpu_map"))
                break
        return RawCpu(online=online, siblings=siblings, l3=l3)

    def _read_node(self, path: Path, node_id: int) -> RawNode:
        cpus = self._first_cpus(path, ("cpulist", "cpumap"))
        memory: int | None = None
        meminfo = self._text(path / "meminfo")
        if meminfo is not None:
            match = re.search(r"MemTotal:\s*(\d+)\s*kB", meminfo)
            if match:
                memory = int(match.group(1)) * 1024
        distances: tuple[int, ...] | None = None
        distance_text = self._text(path / "distance")
        if distance_text:
            try:
                distances = tuple(int(v) for v in distance_text.split())
            except ValueError as exc:
                raise TopologyError(f"{path / 'distance'}: {distance_text[:80]!r} is not a list of numbers") from exc
        return RawNode(cpus=cpus, memory_total_bytes=memory, distances=distances)

    def snapshot(self) -> SysfsSnapshot:
        if not self._is_dir(self.cpu_dir):
            raise TopologyError(
                f"{self.cpu_dir} does not exist: {self.root} is not a Linux filesystem root with /sys mounted"
            )
        cpus = {num: self._read_cpu(path) for num, path in self._numbered(self.cpu_dir, "cpu").items()}
        node_paths: dict[int, Path] = {}
        for directory in self.node_dirs:
            for num, path in self._numbered(directory, "node").items():
                node_paths.setdefault(num, path)
        nodes = {num: self._read_node(path, num) for num, path in sorted(node_paths.items())} or None
        meminfo_total: int | None = None
        meminfo = self._text(self.root / "proc/meminfo")
        if meminfo is not None and (match := re.search(r"MemTotal:\s*(\d+)\s*kB", meminfo)):
            meminfo_total = int(match.group(1)) * 1024
        return SysfsSnapshot(
            online_cpus=self._cpus(self.cpu_dir / "online"),
            cpus=cpus,
            nodes=nodes,
            meminfo_total_bytes=meminfo_total,
        )

    def topology(self) -> Topology:
        return build_topology(self.snapshot())

    def online_cpus(self) -> frozenset[int] | None:
        """Cheap re-read for the daemon's machine-drift check."""
        return self._cpus(self.cpu_dir / "online")


def read_topology(fsroot: str | os.PathLike[str] = "/") -> Topology:
    return SysfsReader(fsroot).topology()
