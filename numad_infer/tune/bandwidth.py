"""Memory read bandwidth, read by the CPUs of one node from the memory of another (or the
same) node: the ceiling that decoding runs into (every weight is read once per token).

How: one process per CPU, pinned to it (sched_setaffinity) and with its memory bound to
the target node (set_mempolicy MPOL_BIND), fills an anonymous buffer (so its pages really
are on that node, not the shared zero page) and then scans it with memchr for a byte
that is not there (`mmap.find`): a sequential read at the full speed of one core's load
units, with no Python loop per byte. All readers start together at a barrier; the figure
is the bytes every reader read divided by the time the slowest one took. One reader per
CPU of the node is what saturates its memory channels; standard library only, so it runs
wherever the daemon does. Checked against numpy and sysbench in `bench/tune.py`.
What tune keeps of the figures for the daemon: `bandwidthfile`.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from numad_infer.host import pinning
from numad_infer.plan.model import Policy

# Per reader: well past its share of any L3 cache, so the scan reads DRAM.
BYTES_PER_READER = 64 << 20
PASSES = 4  # scans per sample, after one warm-up scan


@dataclass(frozen=True)
class Bandwidth:
    cpus_node: int | None
    memory_node: int
    samples_gbs: tuple[float, ...]

    @property
    def gbs(self) -> float:
        ordered = sorted(self.samples_gbs)
        return ordered[len(ordered) // 2]


def _reader(cpu: int, node: int, size: int, passes: int, samples: int, start: multiprocessing.synchronize.Barrier,
            results: multiprocessing.queues.Queue[tuple[int, float]]) -> None:
    os.sched_setaffinity(0, {cpu})
    pinning.set_mempolicy(Policy.BIND, (node,))
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    chunk = b"\x02" * (1 << 20)
    for offset in range(0, size, len(chunk)):  # fault every page in, on `node`
        buf[offset:offset + len(chunk)] = chunk[:size - offset]
    buf.find(b"\x01")  # warm-up: TLB, prefetchers
    for _ in range(samples + 1):  # the first, synchronised round is a warm-up too (dropped)
        start.wait()
        began = time.perf_counter()
        for _ in range(passes):
            if buf.find(b"\x01") != -1:
                raise AssertionError("the scanned buffer changed")
        results.put((cpu, time.perf_counter() - began))
    buf.close()


def measure(cpus: Sequence[int], memory_node: int, samples: int = 5, size: int = BYTES_PER_READER,
            passes: int = PASSES, cpus_node: int | None = None, timeout_s: float = 300.0) -> Bandwidth:
    """Aggregate read bandwidth of `cpus` reading memory of `memory_node` (GB/s per sample)."""
    context = multiprocessing.get_context("fork")
    start = context.Barrier(len(cpus))
    results = context.Queue()
    readers = [context.Process(target=_reader, args=(cpu, memory_node, size, passes, samples, start, results),
                               daemon=True) for cpu in cpus]
    for reader in readers:
        reader.start()
    gbs: list[float] = []
    try:
        for _ in range(samples + 1):
            slowest = max(results.get(timeout=timeout_s)[1] for _ in cpus)
            gbs.append(len(cpus) * size * passes / slowest / 1e9)
        gbs = gbs[1:]
    finally:
        for reader in readers:
            reader.join(5)
            if reader.is_alive():
                reader.kill()
    return Bandwidth(cpus_node, memory_node, tuple(gbs))


def matrix(node_cpus: Mapping[int, Sequence[int]], memory_nodes: Sequence[int], samples: int = 5,
           progress: Callable[[str], object] = lambda text: None) -> dict[tuple[int, int], Bandwidth]:
    """(CPU node, memory node) -> bandwidth, for every node with CPUs against every node
    with memory: the diagonal is local, the rest what a misplaced instance would get."""
    found = {}
    for cpu_node, cpus in node_cpus.items():
        for memory_node in memory_nodes:
            progress(f"bandwidth: CPUs of node {cpu_node} reading node {memory_node}'s memory")
            found[cpu_node, memory_node] = measure(cpus, memory_node, samples, cpus_node=cpu_node)
    return found
