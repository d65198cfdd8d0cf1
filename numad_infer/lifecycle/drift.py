"""Expected vs observed -> drift verdicts. Pure: the monitor reads, this decides, repair acts."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from numad_infer.host.proc_types import NodeUsage, ThreadInfo


class EventKind(str, Enum):
    """What drift (or its repair) is about: counted per kind in status and metrics.

    A new kind is a member here, its verdict below and its check class in `supervision/drift_checks.py`
    (registered in `drift_checks.CHECKS`)."""

    AFFINITY = "affinity"  # threads allowed or running outside the instance's CPUs
    MEMORY = "memory"  # anonymous memory on other nodes than the instance's
    HEALTH = "health"  # failed probes (repair: a restart)
    ALLOWED = "allowed"  # the kernel lets the instance run on fewer CPUs than planned (its cgroup's cpuset)
    EXIT = "exit"  # the main process went away


@dataclass(frozen=True)
class ThreadDrift:
    tid: int
    name: str
    allowed: frozenset[int]
    last_cpu: int | None
    target: frozenset[int]  # mask to restore


@dataclass(frozen=True)
class AffinityVerdict:
    drifted: tuple[ThreadDrift, ...]
    good_masks: dict[int, frozenset[int]]  # tid -> last mask seen within the instance


def check_affinity(cpus: frozenset[int], threads: list[ThreadInfo],
                   previous_good: dict[int, frozenset[int]]) -> AffinityVerdict:
    """A thread drifted if it may run, or last ran, outside the instance's CPUs.

    A mask narrower than `cpus` is normal: OpenMP binds each worker (and the main
    thread) to one CPU of the instance. So a drifted thread gets back the mask it had
    while it was inside, not the whole set, which would undo OpenMP's binding.
    """
    good: dict[int, frozenset[int]] = {}
    drifted: list[ThreadDrift] = []
    for thread in threads:
        inside = thread.allowed <= cpus and (thread.last_cpu is None or thread.last_cpu in cpus)
        if inside:
            good[thread.tid] = thread.allowed
            continue
        target = previous_good.get(thread.tid, cpus)
        if thread.allowed <= cpus:
            # Allowed inside but last ran outside (a mask just narrowed): it moves at its
            # next schedule; setting its own mask again forces the move now.
            target = thread.allowed
        drifted.append(ThreadDrift(thread.tid, thread.name, thread.allowed, thread.last_cpu, target))
        if thread.tid in previous_good:
            good[thread.tid] = previous_good[thread.tid]
    return AffinityVerdict(tuple(drifted), good)


@dataclass(frozen=True)
class MemoryVerdict:
    anon_bytes: int
    local_fraction: float | None  # None: no anonymous memory yet
    remote_nodes: tuple[int, ...]
    remote_bytes: int
    file_bytes: int
    file_local_fraction: float | None  # shared page cache: reported, never repaired
    drifted: bool
    source: str


def check_memory(usage: NodeUsage, mems: frozenset[int], min_local_fraction: float) -> MemoryVerdict:
    anon = sum(usage.anon.values())
    local = sum(b for n, b in usage.anon.items() if n in mems)
    remote_nodes = tuple(sorted(n for n, b in usage.anon.items() if n not in mems and b > 0))
    files = sum(usage.file.values())
    file_local = sum(b for n, b in usage.file.items() if n in mems)
    fraction = local / anon if anon else None
    return MemoryVerdict(
        anon_bytes=anon,
        local_fraction=fraction,
        remote_nodes=remote_nodes,
        remote_bytes=anon - local,
        file_bytes=files,
        file_local_fraction=file_local / files if files else None,
        drifted=fraction is not None and fraction < min_local_fraction,
        source=usage.source,
    )
