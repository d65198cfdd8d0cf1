"""Read what the kernel says about running processes: threads, their CPUs, memory by node.

Thin edge rooted at a directory (like `sysfs.SysfsReader`), so tests can point it at a
fake tree. A process or thread that vanishes mid-read is normal, never an error.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil

from numad_infer.host.portowner import Listeners, PortOwner, listeners, open_connections, port_owner
from numad_infer.host.proc_types import NodeUsage, ThreadInfo
from numad_infer.topology.cgroups import CgroupReader
from numad_infer.util.cpuset import CpuListError, parse_list
from numad_infer.util.printable import printable

_NODE_FIELD = re.compile(r"\bN(\d+)=(\d+)")
_NODE_MEMINFO = re.compile(r"^Node \d+ (MemFree|Inactive\(file\)):\s+(\d+) kB", re.MULTILINE)
_PAGESIZE = re.compile(r"\bkernelpagesize_kB=(\d+)")


def parse_numa_maps(text: str) -> NodeUsage:
    """Sum /proc/PID/numa_maps by node; private copies of file pages (anon= all pages) count as anon."""
    usage = NodeUsage(source="numa_maps")
    for line in text.splitlines():
        nodes = [(int(n), int(p)) for n, p in _NODE_FIELD.findall(line)]
        if not nodes:
            continue
        size_match = _PAGESIZE.search(line)
        page = int(size_match.group(1)) * 1024 if size_match else 4096
        anon_match = re.search(r"\banon=(\d+)", line)
        total = sum(p for _, p in nodes)
        is_anon = " file=" not in line or (anon_match is not None and int(anon_match.group(1)) >= total)
        for node, pages in nodes:
            usage.add("anon" if is_anon else "file", node, pages * page)
    return usage


def parse_numa_stat(text: str) -> NodeUsage:
    """cgroup v2 memory.numa_stat: "anon N0=123 N1=0" and "file N0=..." lines, in bytes."""
    usage = NodeUsage(source="memory.numa_stat")
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind in ("anon", "file"):
            for node, nbytes in _NODE_FIELD.findall(rest):
                usage.add(kind, int(node), int(nbytes))
    return usage


class ProcReader:
    def __init__(self, fsroot: str | os.PathLike[str] = "/") -> None:
        self.root = Path(fsroot)
        self.proc = self.root / "proc"

    def _read(self, path: Path) -> str | None:
        try:
            return path.read_text(errors="replace")
        except OSError:
            # Gone (ENOENT, or ESRCH from a thread that exited between listdir and open)
            # or not ours to read: both mean "nothing to say about it".
            return None

    def thread_ids(self, pid: int) -> list[int]:
        try:
            return sorted(int(t) for t in os.listdir(self.proc / str(pid) / "task"))
        except OSError:
            return []

    def thread(self, pid: int, tid: int) -> ThreadInfo | None:
        stat = self._read(self.proc / str(pid) / "task" / str(tid) / "stat")
        if stat is None:
            return None
        if self.root == Path("/"):
            # One syscall instead of reading and parsing `status`: this runs for every
            # thread of every instance on every pass.
            try:
                allowed: frozenset[int] | None = frozenset(os.sched_getaffinity(tid))
            except OSError:
                return None
        else:
            status = self._read(self.proc / str(pid) / "task" / str(tid) / "status") or ""
            match = re.search(r"^Cpus_allowed_list:\s*(\S*)", status, re.M)
            try:
                allowed = parse_list(match.group(1)) if match else None
            except CpuListError:
                allowed = None
        if allowed is None:
            return None
        fields = _stat_fields(stat)
        # Field 39 of stat ("processor") is index 36 after the "(comm)" split.
        last_cpu = int(fields[36]) if len(fields) > 36 and fields[36].lstrip("-").isdigit() else None
        # Any thread may name itself (PR_SET_NAME), ESC and newline included: the name is
        # escaped here, where it enters, before drift details and logs carry it.
        name = printable(stat[stat.find("(") + 1:stat.rfind(")")])
        return ThreadInfo(tid, name, allowed, last_cpu)

    def threads(self, pid: int) -> list[ThreadInfo]:
        return [t for tid in self.thread_ids(pid) if (t := self.thread(pid, tid)) is not None]

    def numa_maps(self, pid: int) -> NodeUsage | None:
        text = self._read(self.proc / str(pid) / "numa_maps")
        return None if text is None else parse_numa_maps(text)

    def cgroup_path(self, pid: int) -> str | None:
        text = self._read(self.proc / str(pid) / "cgroup")
        if text is None:
            return None
        for line in text.splitlines():
            if line.startswith("0::"):
                return line[3:].strip()
        return None

    def cgroup_numa_stat(self, pid: int) -> NodeUsage | None:
        """The instance's cgroup v2 memory.numa_stat: cost independent of the process size."""
        path = self.cgroup_path(pid)
        if not path or path == "/":
            return None
        text = self._read(self.root / "sys/fs/cgroup" / path.lstrip("/") / "memory.numa_stat")
        return None if text is None else parse_numa_stat(text)

    def memory_room(self, nodes: tuple[int, ...], cgroup: str | None = None) -> int | None:
        """Bytes a new process could take on `nodes` now without swapping: each node's free
        memory and the page cache the kernel drops first (Inactive(file)), within what the
        cgroup it would start in may still use. `cgroup`: that cgroup's path (the systemd
        backend's slice); None: the daemon's own (the process backend starts its children
        there). None back: a node without meminfo (nothing to go by)."""
        room = 0
        for node in nodes:
            text = self._read(self.root / f"sys/devices/system/node/node{node}/meminfo")
            found = dict(_NODE_MEMINFO.findall(text or ""))
            if len(found) < 2:
                return None
            room += sum(int(kb) for kb in found.values()) * 1024
        cgroup_room = CgroupReader(str(self.root)).memory_room(cgroup, str(os.getpid()))
        return room if cgroup_room is None else min(room, cgroup_room)

    def numa_balancing(self) -> int | None:
        text = self._read(self.proc / "sys/kernel/numa_balancing")
        return int(text.strip()) if text and text.strip().isdigit() else None

    def cpu_seconds(self, pid: int) -> float | None:
        """User + system CPU time of the whole process (every thread): it grows while a server generates."""
        try:
            times = psutil.Process(pid).cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None
        total: float = times.user + times.system
        return total

    def port_owner(self, host: str, port: int, pid: int, table: Listeners | None = None) -> PortOwner:
        """Is the socket listening on the instance's port the one of its process `pid`?
        `table`: the host's listening sockets, as `listeners` read them (None: read now)."""
        return port_owner(self.proc, host, port, pid, table)

    def listeners(self) -> Listeners:
        """The host's listening TCP sockets: one reading for a pass's every instance."""
        return listeners(self.proc)

    def open_connections(self, port: int, pid: int) -> int:
        """Client connections open to the instance of process `pid` on its `port` (its
        requests in flight): only those its own listening socket accepted."""
        return open_connections(self.proc, port, pid)

    def running_commands(self, name: str) -> list[int]:
        pids = []
        for entry in os.listdir(self.proc):
            if entry.isdigit() and (self._read(self.proc / entry / "comm") or "").strip() == name:
                pids.append(int(entry))
        return pids


def _stat_fields(stat: str) -> list[str]:
    # comm may contain spaces and parentheses: split after the last ")".
    return stat[stat.rfind(")") + 2:].split()
