"""Drift checks, one class per kind: observe, verdict (drift.py), repair, and the memory
each keeps about the current process.

A check object lives exactly as long as one process: `Runtime.new_process` builds a
fresh set from `CHECKS`, so what a check remembers (good masks, the last reading, a
migration to measure) never leaks onto the next process. Adding a drift kind is one
class here, appended to `CHECKS`, and its `EventKind` member.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from numad_infer.host import pinning
from numad_infer.host.procfs import ProcReader
from numad_infer.lifecycle import drift
from numad_infer.lifecycle.drift import EventKind
from numad_infer.plan.model import Instance, Policy
from numad_infer.topology.cgroups import CgroupReader
from numad_infer.util.cpuset import format_list
from numad_infer.util.printable import printable

if TYPE_CHECKING:
    from numad_infer.config.schema import MonitorSection

log = logging.getLogger(__name__)


class EventSink(Protocol):
    def record_drift(self, kind: EventKind, detail: str, at: float) -> None: ...
    def record_repair(self, kind: EventKind, detail: str, at: float, counted: bool = True) -> None: ...


class Pinner(Protocol):
    """What a repair changes on the host (host/pinning.py): a seam, so a test on a one-node
    host can stand in for the calls that move threads and pages between nodes."""

    def set_thread_affinity(self, tid: int, cpus: frozenset[int]) -> bool: ...
    def migrate_pages(self, pid: int, from_nodes: tuple[int, ...], to_nodes: tuple[int, ...]) -> int: ...
    def memory_calls(self) -> pinning.MemoryCalls: ...


class HostPinner:
    """The real calls."""

    def set_thread_affinity(self, tid: int, cpus: frozenset[int]) -> bool:
        return pinning.set_thread_affinity(tid, cpus)

    def migrate_pages(self, pid: int, from_nodes: tuple[int, ...], to_nodes: tuple[int, ...]) -> int:
        return pinning.migrate_pages(pid, from_nodes, to_nodes)

    def memory_calls(self) -> pinning.MemoryCalls:
        return pinning.memory_calls()


@dataclass(frozen=True)
class CheckContext:
    """One process of one instance, as a check sees it this pass."""

    instance: Instance
    pid: int
    now: float  # monotonic: intervals
    wall: Callable[[], float]  # for events
    monitor: MonitorSection
    proc: ProcReader
    instance_cgroups: bool  # the backend gives each instance a cgroup (memory.numa_stat)
    events: EventSink
    pinner: Pinner


class DriftCheck(ABC):
    kind: ClassVar[EventKind]

    @abstractmethod
    def run(self, ctx: CheckContext) -> bool:
        """Observe, judge, repair where configured; True while the process still drifts."""

    def found(self, ctx: CheckContext, detail: str) -> None:
        ctx.events.record_drift(self.kind, detail, ctx.wall())

    def repaired(self, ctx: CheckContext, detail: str, counted: bool = True) -> None:
        ctx.events.record_repair(self.kind, detail, ctx.wall(), counted)


class AffinityCheck(DriftCheck):
    kind = EventKind.AFFINITY

    def __init__(self) -> None:
        self.good_masks: dict[int, frozenset[int]] = {}  # tid -> last mask seen within the instance

    def run(self, ctx: CheckContext) -> bool:
        name, cpus = ctx.instance.name, frozenset(ctx.instance.cpus)
        verdict = drift.check_affinity(cpus, ctx.proc.threads(ctx.pid), self.good_masks)
        self.good_masks = verdict.good_masks
        if not verdict.drifted:
            return False
        # The thread's own name (anyone's to choose) goes into status and the log: escaped.
        found = "; ".join(
            f"thread {d.tid} ({printable(d.name)}) allowed {format_list(d.allowed)}, last ran on {d.last_cpu}"
            for d in verdict.drifted[:4]
        ) + (f" and {len(verdict.drifted) - 4} more" if len(verdict.drifted) > 4 else "")
        self.found(ctx, f"outside CPUs {format_list(cpus)}: {found}")
        if not ctx.monitor.repair:
            log.warning("%s: affinity drift: %s (repair = false: not fixed)", name, found)
            return True
        fixed, gone = [], 0
        for d in verdict.drifted:
            try:
                if ctx.pinner.set_thread_affinity(d.tid, d.target):
                    fixed.append(f"{d.tid}->{format_list(d.target)}")
                    self.good_masks[d.tid] = d.target
                else:
                    gone += 1
            except OSError as exc:
                log.error("%s: cannot re-pin thread %d: %s", name, d.tid, exc.strerror)
        detail = (f"re-pinned {len(fixed)} thread(s): {', '.join(fixed[:8])}"
                  + (f"; {gone} exited meanwhile" if gone else ""))
        log.warning("%s: affinity drift: %s; %s", name, found, detail)
        self.repaired(ctx, detail)
        return False


class MemoryCheck(DriftCheck):
    kind = EventKind.MEMORY

    def __init__(self) -> None:
        self.verdict: drift.MemoryVerdict | None = None
        self.checked_at = 0.0
        self.migrated_from: int | None = None  # remote anonymous bytes before our last migrate_pages

    def run(self, ctx: CheckContext) -> bool:
        usage = ctx.proc.cgroup_numa_stat(ctx.pid) if ctx.instance_cgroups else None
        if usage is None:
            # numa_maps walks every page table of the process: only every numa_maps_interval_s.
            if self.verdict is not None and ctx.now - self.checked_at < ctx.monitor.numa_maps_interval_s:
                return self.verdict.drifted
            usage = ctx.proc.numa_maps(ctx.pid)
            if usage is None:
                return False
        self.checked_at = ctx.now
        mems = frozenset(ctx.instance.mems)
        verdict = self.verdict = drift.check_memory(usage, mems, ctx.monitor.min_local_fraction)
        if self.migrated_from is not None:
            # The reading after a migration: kernel counters (memory.numa_stat) settle
            # within a pass, so what moved is measured here rather than right after the call.
            moved = max(self.migrated_from - verdict.remote_bytes, 0)
            detail = (f"migrate_pages moved {moved / 2**20:.1f} MiB back to node(s) {format_list(mems)}; "
                      f"now {verdict.local_fraction or 0:.1%} local")
            log.info("%s: memory repair result: %s", ctx.instance.name, detail)
            self.repaired(ctx, detail, counted=False)
            self.migrated_from = None
        if not verdict.drifted:
            return False
        found = (f"{verdict.local_fraction:.1%} of {verdict.anon_bytes / 2**20:.0f} MiB anonymous memory on nodes "
                 f"{format_list(mems)}; {verdict.remote_bytes / 2**20:.0f} MiB on node(s) "
                 f"{format_list(verdict.remote_nodes)}")
        self.found(ctx, found)
        self._repair(ctx, verdict, found)
        return True  # a migration is measured at the next pass: drifting until then

    def _repair(self, ctx: CheckContext, verdict: drift.MemoryVerdict, found: str) -> None:
        name, mems = ctx.instance.name, frozenset(ctx.instance.mems)
        if not ctx.monitor.repair or ctx.instance.policy == Policy.INTERLEAVE:
            log.warning("%s: memory drift: %s (not repaired)", name, found)
            return
        refused = ctx.pinner.memory_calls().migrate_refused
        if refused is not None:  # a seccomp profile: every try would fail the same way
            log.warning("%s: memory drift: %s (not repaired: migrate_pages is refused here: %s)", name, found, refused)
            return
        try:
            left = ctx.pinner.migrate_pages(ctx.pid, verdict.remote_nodes, ctx.instance.mems)
        except OSError as exc:
            log.error("%s: memory drift: %s; migrate_pages failed: %s", name, found, exc.strerror)
            return
        detail = (f"migrate_pages from node(s) {format_list(verdict.remote_nodes)} to {format_list(mems)}"
                  + (f"; {left} page(s) could not move" if left else ""))
        log.warning("%s: memory drift: %s; %s", name, found, detail)
        self.repaired(ctx, detail)
        self.migrated_from = verdict.remote_bytes
        # Measure the result at the next pass, even with numa_maps (whatever the clock reads:
        # a monotonic clock is small on a host that booted minutes ago).
        self.checked_at = float("-inf")


class AllowedSetCheck(DriftCheck):
    """The instance's cgroup now allows fewer CPUs than it was planned on (a cpuset changed
    under it). Re-pinning cannot widen a cpuset: this is reported, and status shows only
    the CPUs it can run on; the repair is a new plan (the daemon re-plans when the set it
    plans within changes)."""

    kind = EventKind.ALLOWED
    reader: ClassVar[CgroupReader] = CgroupReader("/")

    def __init__(self) -> None:
        self.allowed: frozenset[int] | None = None  # the process's cpuset at the last pass
        self.told: frozenset[int] = frozenset()  # the CPUs last reported missing: said once

    def run(self, ctx: CheckContext) -> bool:
        self.allowed = self.reader.cpuset_of(ctx.pid)
        planned = frozenset(ctx.instance.cpus)
        missing = frozenset() if self.allowed is None else planned - self.allowed
        # (`missing` is empty when the cpuset is unknown: the last test only tells mypy so)
        if missing and missing != self.told and self.allowed is not None:
            detail = (f"its cgroup allows only CPUs {format_list(planned & self.allowed or set())} of the planned "
                      f"{format_list(planned)} (cpuset changed under it)")
            log.warning("%s: %s", ctx.instance.name, detail)
            self.found(ctx, detail)
        self.told = missing
        return bool(missing)


# Every drift kind the monitor checks, in the order it checks them.
CHECKS: tuple[type[DriftCheck], ...] = (AffinityCheck, MemoryCheck, AllowedSetCheck)


def fresh_checks() -> dict[EventKind, DriftCheck]:
    """A new process's checks, remembering nothing of the last one."""
    return {check.kind: check() for check in CHECKS}


def run_checks(checks: dict[EventKind, DriftCheck], ctx: CheckContext) -> bool:
    """Every check runs (none hides another's repair); True when any still drifts."""
    return any([check.run(ctx) for check in checks.values()])
