"""Read what `doctor` judges from a filesystem root (/ or a tree under --fsroot):
sysctls, transparent huge pages, cpufreq, node memory, IRQs, swap, processes. Thin edge:
missing files become None (an older kernel, a VM without cpufreq); the verdicts are
verdicts.py's. It only reads.

Every read goes through `FsRoot`: a tree under --fsroot is someone else's, so a link out of
it, a FIFO or a device is not read but told (a warning on stderr) and taken as missing.
Process names and command lines are escaped as they are read: doctor prints them.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from numad_infer.doctor.verdicts import NUMA_MANAGERS, CpuFreq, Irq, Neighbour, NodeMemory
from numad_infer.host.cpufeatures import cpuinfo_flags
from numad_infer.util.atomicfile import NotRegularFile
from numad_infer.util.cpuset import CpuListError, parse_list
from numad_infer.util.fsroot import LARGE, SMALL, FsRoot
from numad_infer.util.printable import printable

# (pid, comm, tid) -> (CPU ticks used so far, the CPU it last ran on)
TickTable = dict[tuple[int, str, int], tuple[int, int]]
Sampler = Callable[[float], tuple[Neighbour, ...]]

_CLK_TCK = os.sysconf("SC_CLK_TCK")

log = logging.getLogger(__name__)


class HostReader:
    def __init__(self, fsroot: str | os.PathLike[str] = "/") -> None:
        self.root = Path(fsroot)
        self.tree = FsRoot(self.root)
        self.told: set[str] = set()  # what was refused and said so: once each, not once per read
        self.proc = self.root / "proc"
        self.sys = self.root / "sys"

    def _bytes(self, path: Path, limit: int = SMALL, whole: bool = True) -> bytes | None:
        try:
            return self.tree.read(path, limit, whole)
        except OSError:
            return None  # absent on this kernel, or a process that exited meanwhile
        except NotRegularFile as exc:
            self._refused(exc)
            return None

    def _text(self, path: Path, limit: int = SMALL) -> str | None:
        data = self._bytes(path, limit)
        return None if data is None else data.decode("utf-8", errors="replace").strip()

    def _listdir(self, path: Path) -> list[str] | None:
        try:
            return self.tree.listdir(path)
        except OSError:
            return None
        except NotRegularFile as exc:
            self._refused(exc)
            return None

    def _subdirs(self, path: Path) -> tuple[str, ...]:
        """The names of the directories in `path` (links to directories inside the tree count)."""
        found = []
        for name in self._listdir(path) or ():
            try:
                if self.tree.is_dir(path / name):
                    found.append(name)
            except NotRegularFile as exc:
                self._refused(exc)
        return tuple(sorted(found))

    def _refused(self, exc: NotRegularFile) -> None:
        if str(exc) not in self.told:
            self.told.add(str(exc))
            log.warning("doctor: not read: %s", exc)

    def _int(self, path: Path) -> int | None:
        text = self._text(path)
        return int(text) if text is not None and text.lstrip("-").isdigit() else None

    def sysctl(self, name: str) -> int | None:
        return self._int(self.proc / "sys" / name.replace(".", "/"))

    def thp(self, name: str) -> str | None:
        """The bracketed choice of /sys/kernel/mm/transparent_hugepage/NAME ("always [madvise] never")."""
        text = self._text(self.sys / "kernel/mm/transparent_hugepage" / name)
        match = re.search(r"\[([^\]]+)\]", text or "")
        return match.group(1) if match else None

    def cpufreq(self, cpus: frozenset[int]) -> dict[int, CpuFreq]:
        base = self.sys / "devices/system/cpu"
        return {c: CpuFreq(self._text(base / f"cpu{c}/cpufreq/scaling_governor"),
                           self._text(base / f"cpu{c}/cpufreq/energy_performance_preference")) for c in sorted(cpus)}

    def meminfo_kb(self, text: str | None, key: str) -> int | None:
        match = re.search(rf"\b{re.escape(key)}:\s*(\d+)\s*kB", text or "")
        return int(match.group(1)) if match else None

    def swap_total_bytes(self) -> int:
        return (self.meminfo_kb(self._text(self.proc / "meminfo"), "SwapTotal") or 0) * 1024

    def node_memory(self, node: int, instance_bytes: int, holders: tuple[str, ...] = ()) -> NodeMemory | None:
        text = self._text(self.sys / f"devices/system/node/node{node}/meminfo")
        free = self.meminfo_kb(text, "MemFree")
        if free is None:
            return None
        return NodeMemory(free * 1024, (self.meminfo_kb(text, "FilePages") or 0) * 1024, instance_bytes, holders)

    def irqs(self) -> tuple[Irq, ...]:
        counts: dict[int, int] = {}
        for line in (self._text(self.proc / "interrupts", LARGE) or "").splitlines():
            label, _, rest = line.partition(":")
            if label.strip().isdigit():
                counts[int(label)] = sum(int(v) for v in rest.split() if v.isdigit())
        found = []
        listed = self._listdir(self.proc / "irq")
        if listed is None:
            return ()
        for number in sorted(int(name) for name in listed if name.isdigit()):
            d = self.proc / "irq" / str(number)
            # The CPU the interrupt really goes to; kernels before 4.15 show only the allowed set.
            text = self._text(d / "effective_affinity_list") or self._text(d / "smp_affinity_list")
            try:
                cpus = parse_list(text) if text else frozenset()
            except CpuListError:
                continue
            names = tuple(printable(name) for name in self._subdirs(d))  # driver names: doctor prints them
            found.append(Irq(number, cpus, names, counts.get(number, 0)))
        return tuple(found)

    def processes(self) -> list[tuple[int, str, list[str]]]:
        """(pid, comm, argv) of every process, escaped: anyone names their own process (and
        its threads), ESC and newline included, and doctor prints the names."""
        found: list[tuple[int, str, list[str]]] = []
        pids = [int(e) for e in self._listdir(self.proc) or () if e.isdigit()]
        for pid in pids:
            comm = self._text(self.proc / str(pid) / "comm")
            if comm is None:
                continue
            # Only the program's name and whether there is an argv matter: the start is enough.
            argv = (self._bytes(self.proc / str(pid) / "cmdline", SMALL, whole=False) or b"").split(b"\0")
            found.append((pid, printable(comm), [printable(a.decode(errors="replace")) for a in argv if a]))
        return found

    def running(self, names: tuple[str, ...]) -> list[tuple[str, int]]:
        """(name, pid) of processes whose comm or program name is one of `names` (comm is cut at 15 characters)."""
        hits = []
        for pid, comm, argv in self.processes():
            program = Path(argv[0]).name if argv else ""
            for name in names:
                if comm == name or program == name:
                    hits.append((name, pid))
                    break
        return sorted(hits, key=lambda hit: (hit[0], hit[1]))

    def managers(self) -> tuple[str, ...]:
        return tuple(f"{name} (pid {pid})" for name, pid in self.running(NUMA_MANAGERS))

    def cpu_flags(self) -> frozenset[str]:
        return cpuinfo_flags(self._text(self.proc / "cpuinfo", LARGE) or "")

    def nodes_per_package(self, node_cpus: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
        """Package (socket) id -> its nodes that have CPUs; empty when the kernel does not say."""
        found: dict[int, set[int]] = {}
        for node, cpus in node_cpus.items():
            for cpu in cpus:
                package = self._int(self.sys / f"devices/system/cpu/cpu{cpu}/topology/physical_package_id")
                if package is not None:
                    found.setdefault(package, set()).add(node)
        return {p: tuple(sorted(nodes)) for p, nodes in sorted(found.items())}

    # -- noisy neighbours -------------------------------------------------------------
    def ticks(self, skip: frozenset[int]) -> TickTable:
        """CPU ticks of every user-space thread and the CPU it last ran on; kernel threads and `skip` left out."""
        table: TickTable = {}
        for pid, comm, argv in self.processes():
            # A kernel thread has no argv: its work (kworkers, ksoftirqd) follows the CPU, not a choice to undo.
            if pid in skip or not argv:
                continue
            for tid in [int(t) for t in self._listdir(self.proc / str(pid) / "task") or () if t.isdigit()]:
                stat = self._text(self.proc / str(pid) / "task" / str(tid) / "stat")
                if stat is None:
                    continue
                fields = stat[stat.rfind(")") + 2:].split()
                # After the comm: utime and stime are fields 12 and 13 (index 11, 12), processor 37 (index 36).
                if len(fields) > 36 and fields[11].isdigit() and fields[12].isdigit() and fields[36].isdigit():
                    table[(pid, comm, tid)] = (int(fields[11]) + int(fields[12]), int(fields[36]))
        return table

    def sampler(self, skip: frozenset[int]) -> Sampler:
        """Two readings `seconds` apart: each process's use of each CPU its threads ran on."""

        def sample(seconds: float) -> tuple[Neighbour, ...]:
            before = self.ticks(skip)
            start = time.monotonic()
            time.sleep(seconds)
            after = self.ticks(skip)
            return neighbours(before, after, time.monotonic() - start)

        return sample


def neighbours(before: TickTable, after: TickTable, seconds: float) -> tuple[Neighbour, ...]:
    """Per (process, CPU): the share of that CPU its threads used between two readings.
    A thread that moved is counted on the CPU it ran on last: a sample of ~1 s is short."""
    used: dict[tuple[int, str, int], float] = {}
    for (pid, comm, tid), (ticks, cpu) in after.items():
        start = before.get((pid, comm, tid))
        if start is None:
            continue  # started during the sample: too young to judge
        key = (pid, comm, cpu)
        used[key] = used.get(key, 0.0) + (ticks - start[0]) / _CLK_TCK
    return tuple(Neighbour(pid, comm, cpu, 100.0 * s / seconds)
                 for (pid, comm, cpu), s in sorted(used.items()) if s > 0 and seconds > 0)

