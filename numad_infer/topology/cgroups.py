"""Reads what a cgroup lets its processes use: its cpuset, its CPU quota and the memory its
limits leave (an edge).

- The process backend's instances are the daemon's children, in its cgroup: what the
  kernel allows the daemon (`Cpus_allowed_list`/`Mems_allowed_list` of /proc/self/status,
  which already are the cpuset's effective sets), and the tightest `cpu.max` (v2) or
  `cpu.cfs_quota_us` (v1) on the way from its cgroup up to the root.
- The systemd backend's instances run in system.slice: that slice's
  `cpuset.{cpus,mems}.effective` and `cpu.max` (cgroup v2; an operator narrows them with
  `systemctl set-property system.slice AllowedCPUs=...`, as tuned's cpu-partitioning does).

Rooted at a directory (`fsroot`) so tests point it at a fake tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

from numad_infer.topology.cgroup_limits import Allowed
from numad_infer.util.cpuset import CpuListError, parse_list

INSTANCE_SLICE = "system.slice"  # where systemd starts infer@N.service
_T = TypeVar("_T")


class CgroupReader:
    def __init__(self, fsroot: str = "/") -> None:
        self.root = Path(fsroot)

    def _text(self, *parts: str) -> str | None:
        try:
            return self.root.joinpath(*parts).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None

    def _list(self, text: str | None) -> frozenset[int] | None:
        if not text:
            return None
        try:
            return frozenset(parse_list(text))
        except CpuListError:
            return None

    # -- the process backend: the daemon's own cgroup ------------------------------------------
    def for_process(self, pid: str = "self") -> Allowed:
        status = self._text("proc", pid, "status") or ""
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        cpus = self._list(fields.get("Cpus_allowed_list", "").strip())
        mems = self._list(fields.get("Mems_allowed_list", "").strip())
        return self._restricting(Allowed(cpus, mems, self._quota_of(pid), "the daemon's cgroup"))

    def _restricting(self, allowed: Allowed) -> Allowed:
        """A set that holds everything the host has restricts nothing: None, so that the
        plan of another machine (--fsroot) is not cut to this one's CPU numbers."""
        online = self._list(self._text("sys/devices/system/cpu/online"))
        nodes = self._list(self._text("sys/devices/system/node/online"))
        cpus = None if allowed.cpus is not None and online is not None and online <= allowed.cpus else allowed.cpus
        mems = None if allowed.mems is not None and nodes is not None and nodes <= allowed.mems else allowed.mems
        return Allowed(cpus, mems, allowed.quota_cpus, allowed.source)

    def _cgroups(self, pid: str) -> Iterator[tuple[str, list[str], str]]:
        """/proc/PID/cgroup: (hierarchy ID, its controllers, the process's cgroup path) per
        line; hierarchy "0" with no controllers is the unified (v2) one."""
        for line in (self._text("proc", pid, "cgroup") or "").splitlines():
            if line.count(":") >= 2:
                hierarchy, controllers, path = line.split(":", 2)
                yield hierarchy, [c for c in controllers.split(",") if c], path.strip()

    def _quota_of(self, pid: str) -> float | None:
        """The tightest quota from the process's cgroup up to the root (a parent's applies too)."""
        found: list[float] = []
        for hierarchy, controllers, path in self._cgroups(pid):
            if hierarchy == "0":  # the unified (v2) hierarchy
                found += self._walk(Path("sys/fs/cgroup"), path, self._v2_quota)
            elif "cpu" in controllers:
                base = Path("sys/fs/cgroup") / ",".join(controllers)
                if not self.root.joinpath(base).is_dir():
                    base = Path("sys/fs/cgroup/cpu")  # mounted as cpu, linked as cpu,cpuacct
                found += self._walk(base, path, self._v1_quota)
        return min(found) if found else None

    def _walk(self, base: Path, path: str, read: Callable[[Path], _T | None]) -> list[_T]:
        """`read` of the cgroup at `path` and of every parent, up to the hierarchy's top: inside
        a container (its own cgroup namespace, or v1's controller mounted at its own cgroup)
        the top is the container's cgroup, whose limits bind it too."""
        parts = [p for p in path.split("/") if p]
        found = []
        for depth in range(len(parts), -1, -1):
            value = read(base.joinpath(*parts[:depth]))
            if value is not None:
                found.append(value)
        return found

    # -- memory: what a new process may still take under every limit above it --------------------
    def memory_room(self, cgroup: str | None = None, pid: str = "self") -> int | None:
        """Bytes a process started in `cgroup` may still take before a memory limit: the least
        of limit less usage over that cgroup and every parent (a pod's or a slice's limit
        binds the cgroups below it), cgroup v2 (`memory.max`, `memory.current`) or v1
        (`memory.limit_in_bytes`, `memory.usage_in_bytes`). `cgroup`: its path, alike in
        both hierarchies (systemd names a slice so); None: `pid`'s own. None back: no limit.

        Usage less the inactive file pages (memory.stat's `inactive_file`, v1's
        `total_inactive_file`), the kubelet's working set: the kernel reclaims them before
        the limit is reached, and a model file read once into the page cache is mostly
        there (bench/real_rollout.py: 906 MiB of a 1B model's 1,954 MiB of usage in its
        cgroup), which would refuse a surge that fits. The nodes' room counts them free
        alike (ProcReader.memory_room)."""
        v2 = (Path("sys/fs/cgroup"), "memory.max", "memory.current", "inactive_file")
        v1 = (Path("sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        if cgroup is not None:
            where = [(cgroup, v2), (cgroup, v1)]
        else:
            where = [(path, v2 if hierarchy == "0" else v1) for hierarchy, controllers, path in self._cgroups(pid)
                     if hierarchy == "0" or "memory" in controllers]
        rooms: list[int] = []
        for path, (base, limit, used, inactive) in where:
            rooms += self._walk(base, path, partial(self._left, limit_file=limit, used_file=used, inactive=inactive))
        return min(rooms) if rooms else None

    def _left(self, directory: Path, limit_file: str, used_file: str, inactive: str) -> int | None:
        limit, used = self._text(str(directory), limit_file), self._text(str(directory), used_file)
        if limit and used and limit.isdigit() and used.isdigit():  # v2's "max": no limit here
            stat = dict(line.split(" ", 1) for line in (self._text(str(directory), "memory.stat") or "").splitlines()
                        if " " in line)
            reclaimable = int(stat[inactive]) if stat.get(inactive, "").strip().isdigit() else 0
            return max(int(limit) - max(int(used) - reclaimable, 0), 0)
        return None

    def _v2_quota(self, directory: Path) -> float | None:
        text = self._text(str(directory), "cpu.max")
        if not text:
            return None
        quota, _, period = text.partition(" ")
        return None if quota == "max" else _ratio(quota, period or "100000")

    def _v1_quota(self, directory: Path) -> float | None:
        quota = self._text(str(directory), "cpu.cfs_quota_us")
        if quota is None or quota.startswith("-"):
            return None
        return _ratio(quota, self._text(str(directory), "cpu.cfs_period_us") or "100000")

    # -- one instance: what the kernel lets it run on now ---------------------------------------
    def cpuset_of(self, pid: int) -> frozenset[int] | None:
        """The effective cpuset of the process's cgroup (v1 `cpuset.effective_cpus`, v2
        `cpuset.cpus.effective`, the nearest cgroup up the tree that has one), None when
        unknown. Not its own affinity: a server narrows that itself, the cgroup bounds it."""
        path = (self._text("proc", str(pid), "cpuset") or "").strip()
        if path and self.root.joinpath("sys/fs/cgroup/cpuset").is_dir():
            found = self._list(self._text(f"sys/fs/cgroup/cpuset{path}", "cpuset.effective_cpus"))
            if found is not None:
                return found
        for line in (self._text("proc", str(pid), "cgroup") or "").splitlines():
            if line.startswith("0::"):
                parts = [p for p in line[3:].split("/") if p]
                for depth in range(len(parts), -1, -1):
                    found = self._list(self._text("sys/fs/cgroup", *parts[:depth], "cpuset.cpus.effective"))
                    if found is not None:
                        return found
        return None

    # -- the systemd backend: the slice the instances run in ----------------------------------
    def for_slice(self, slice_name: str = INSTANCE_SLICE) -> Allowed:
        base = Path("sys/fs/cgroup") / slice_name
        cpus = self._list(self._text(str(base), "cpuset.cpus.effective"))
        mems = self._list(self._text(str(base), "cpuset.mems.effective"))
        quotas = [q for q in (self._v2_quota(base), self._v2_quota(Path("sys/fs/cgroup"))) if q is not None]
        return self._restricting(Allowed(cpus, mems, min(quotas) if quotas else None, slice_name))


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
