#!/usr/bin/env python3
"""What one monitoring pass costs, on real processes standing in for instances.

Spawns synthetic "instances" (a process with T threads and R bytes of touched
anonymous memory, each in its own memory cgroup where the host allows it), then times
what the daemon does per pass: every thread's affinity and last CPU (procfs +
sched_getaffinity), the drift verdict, and the memory-locality reading, from the
cgroup's memory.numa_stat and from /proc/PID/numa_maps side by side.

    .venv/bin/python bench/monitor_cost.py [--quick] [--instances 16,64 --threads 8,64 --no-memory]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numad_infer.host.procfs import ProcReader  # noqa: E402
from numad_infer.lifecycle.drift import check_affinity  # noqa: E402

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")


def instance_body(threads: int, resident: int, ready: mp.Event, done: mp.Event) -> None:
    import mmap
    block = mmap.mmap(-1, max(resident, 4096))
    chunk = b"\1" * (64 << 20)
    for offset in range(0, resident, len(chunk)):
        block.write(chunk[: min(len(chunk), resident - offset)])
    stop = threading.Event()
    workers = [threading.Thread(target=stop.wait, daemon=True) for _ in range(threads - 1)]
    for w in workers:
        w.start()
    ready.set()
    done.wait()


def own_cgroup(pid: int, name: str) -> Path | None:
    """A memory cgroup of its own, as systemd gives each infer@ unit."""
    for root, stat in ((CGROUP_V2, "memory.numa_stat"), (CGROUP_V1, "memory.numa_stat")):
        if (root / "cgroup.procs").exists() and (root / stat).exists() or (root / "memory.numa_stat").exists():
            try:
                path = root / f"numa-infer-bench-{name}"
                path.mkdir(exist_ok=True)
                (path / "cgroup.procs").write_text(str(pid))
                if (path / "memory.numa_stat").exists():
                    return path
            except OSError:
                continue
    return None


class Fleet:
    def __init__(self, count: int, threads: int, resident: int) -> None:
        self.done = mp.Event()
        self.procs = []
        self.cgroups: list[Path | None] = []
        for i in range(count):
            ready = mp.Event()
            proc = mp.Process(target=instance_body, args=(threads, resident, ready, self.done), daemon=True)
            proc.start()
            ready.wait(600)
            self.procs.append(proc)
            self.cgroups.append(own_cgroup(proc.pid, f"{os.getpid()}-{i}"))

    def close(self) -> None:
        self.done.set()
        for proc in self.procs:
            proc.join(10)
        for cg in self.cgroups:
            if cg is not None:
                try:
                    cg.rmdir()
                except OSError:
                    pass


def one_pass(reader: ProcReader, pids: list[int], good: dict[int, dict]) -> None:
    for pid in pids:
        threads = reader.threads(pid)
        cpus = frozenset().union(*(t.allowed for t in threads))
        good[pid] = check_affinity(cpus, threads, good.get(pid, {})).good_masks


def measure_passes(count: int, threads: int, interval: float, repeats: int) -> tuple[float, float]:
    fleet = Fleet(count, threads, 4 << 20)
    try:
        reader, good = ProcReader(), {}
        pids = [p.pid for p in fleet.procs]
        one_pass(reader, pids, good)
        walls, cpus = [], []
        for _ in range(repeats):
            w, c = time.perf_counter(), time.process_time()
            one_pass(reader, pids, good)
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
        return statistics.median(walls), statistics.median(cpus)
    finally:
        fleet.close()


def timed(call, repeats: int) -> float:
    best = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best.append(time.perf_counter() - start)
    return statistics.median(best)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer sizes (CI smoke run)")
    parser.add_argument("--interval", type=float, default=5.0, help="monitor.interval_s to express CPU cost against")
    parser.add_argument("--instances", help="comma-separated instance counts (default 1,2,4,8; e.g. 16,64: a fleet)")
    parser.add_argument("--threads", help="comma-separated threads per instance (default 8,32,64,128)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory-locality reading")
    args = parser.parse_args()
    mp.set_start_method("fork")
    counts, thread_counts = ([1, 8], [8, 64]) if args.quick else ([1, 2, 4, 8], [8, 32, 64, 128])
    if args.instances:
        counts = [int(n) for n in args.instances.split(",")]
    if args.threads:
        thread_counts = [int(n) for n in args.threads.split(",")]
    print(f"# host: {os.cpu_count()} CPUs, {os.uname().release}; interval {args.interval:g}s")
    print("\n## affinity pass (all threads of all instances: stat + sched_getaffinity + verdict)")
    print(f"{'instances':>9} {'threads':>7} {'wall ms':>8} {'cpu ms':>7} {'% of a core':>12}")
    for count in counts:
        for threads in thread_counts:
            wall, cpu = measure_passes(count, threads, args.interval, 20)
            print(f"{count:>9} {threads:>7} {wall * 1000:>8.2f} {cpu * 1000:>7.2f} {cpu / args.interval * 100:>11.3f}%", flush=True)

    if args.no_memory:
        return
    sizes = [0.1, 1] if args.quick else [0.1, 1, 4, 8]
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    print("\n## memory-locality reading of one instance, side by side")
    print(f"{'resident GiB':>12} {'numa_stat ms':>12} {'numa_maps ms':>12} {'ratio':>8}  (numa_maps holds the process's mmap lock while it walks)")
    reader = ProcReader()
    for gib in sizes:
        if gib > free * 0.8:
            print(f"{gib:>12g} {'-':>12} {'-':>12} {'-':>8}  skipped: only {free:.1f} GiB free")
            continue
        fleet = Fleet(1, 4, int(gib * 2**30))
        try:
            pid, cg = fleet.procs[0].pid, fleet.cgroups[0]
            maps = timed(lambda: reader.numa_maps(pid), 5)
            stat = timed(lambda: (cg / "memory.numa_stat").read_text(), 20) if cg else float("nan")
            print(f"{gib:>12g} {stat * 1000:>12.3f} {maps * 1000:>12.2f} {maps / stat:>8.0f}x", flush=True)
        finally:
            fleet.close()
    print("\nnuma_stat: the kernel sums per-node counters of the cgroup (cost independent of size);"
          " numa_maps: walks every page table entry (cost grows with resident memory).")


if __name__ == "__main__":
    main()
