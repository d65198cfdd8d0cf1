"""What the daemon knows about one instance: its lifecycle, its current process, its events.

Everything measured on one process (drift checks' memory, CPU progress, the key check,
engine counters) is forgotten in one place, `Runtime.new_process`, when the process
changes: a restart, a crash, adoption.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from numad_infer.engines import EngineCounters
from numad_infer.lifecycle import drift
from numad_infer.lifecycle.drift import EventKind
from numad_infer.lifecycle.states import Supervision
from numad_infer.plan.model import Instance
from numad_infer.status.records import Event
from numad_infer.supervision.drift_checks import AllowedSetCheck, DriftCheck, MemoryCheck, fresh_checks
from numad_infer.supervision.health import KeyCheck, ProbeResult

# CPU seconds a generating server uses per pass at the very least (one token takes more).
PROGRESS_CPU_S = 0.01


@dataclass
class CpuProgress:
    """Is the process using CPU between passes? A drain waits only for one that is."""

    seen: float | None = None  # the process's CPU seconds at the last pass
    progress: bool | None = None  # did it use CPU since the last pass (None: not known yet)
    stalled_since: float | None = None  # requests in flight and no CPU used since then

    def update(self, cpu: float | None, busy: int | None, now: float) -> None:
        self.progress = None if cpu is None or self.seen is None else cpu - self.seen >= PROGRESS_CPU_S
        self.seen = cpu
        if busy and self.progress is False:
            self.stalled_since = self.stalled_since if self.stalled_since is not None else now
        else:
            self.stalled_since = None


@dataclass
class EngineRate:
    """Engines with counters of their own (llama-server): the last reading, and the decode
    rate between the last two (tokens generated per second of wall time, all slots)."""

    counters: EngineCounters | None = None
    at: float = 0.0
    decode_tokens_per_s: float | None = None

    def update(self, counters: EngineCounters | None, now: float) -> None:
        if counters is None:
            self.decode_tokens_per_s = None
            return
        previous = self.counters
        if previous is not None and now > self.at and counters.tokens_predicted >= previous.tokens_predicted:
            self.decode_tokens_per_s = (counters.tokens_predicted - previous.tokens_predicted) / (now - self.at)
        self.counters, self.at = counters, now


@dataclass
class PromptTally:
    """Prompt tokens the instance took from its cache and computed, since the daemon began
    watching it: the engine's counters (EngineCounters), summed over its processes. A
    server's counters start at 0 with each process; what one counted after the last
    reading before it ended is not known, and not counted."""

    cached_before: float = 0.0  # processes before the current one
    computed_before: float = 0.0
    cached: float = 0.0  # the current process's last reading
    computed: float = 0.0
    reported: bool = False  # has the engine ever given both figures

    def update(self, counters: EngineCounters | None) -> None:
        if counters is None or counters.prompt_tokens_cached is None or counters.prompt_tokens_computed is None:
            return
        if counters.prompt_tokens_cached < self.cached or counters.prompt_tokens_computed < self.computed:
            self.new_process()  # the counters went back: a process of its own the daemon did not restart
        self.cached, self.computed, self.reported = counters.prompt_tokens_cached, counters.prompt_tokens_computed, True

    def new_process(self) -> None:
        self.cached_before += self.cached
        self.computed_before += self.computed
        self.cached = self.computed = 0.0

    @property
    def totals(self) -> tuple[int, int] | None:
        """(cached, computed), None while the engine has not reported them."""
        if not self.reported:
            return None
        return round(self.cached_before + self.cached), round(self.computed_before + self.computed)


@dataclass
class Runtime:
    instance: Instance
    supervision: Supervision = field(default_factory=Supervision)
    pid: int | None = None
    last_probe: ProbeResult | None = None
    last_drift: Event | None = None
    last_repair: Event | None = None
    drift_counts: dict[str, int] = field(default_factory=dict)
    repair_counts: dict[str, int] = field(default_factory=dict)
    # Measurements of the current process (its lifecycle is `supervision.state`):
    drifting: bool = False
    checks: dict[EventKind, DriftCheck] = field(default_factory=fresh_checks)
    cpu: CpuProgress = field(default_factory=CpuProgress)
    key_check: KeyCheck = KeyCheck.UNKNOWN  # does this process take server.api_key_file's key
    engine: EngineRate = field(default_factory=EngineRate)
    # Not of one process: kept across them (new_process folds the last one's in).
    prompt: PromptTally = field(default_factory=PromptTally)
    # How its last restart as the only instance of its model in rotation kept the model
    # served (surge.py: "surge: ...", "hold: ...", "surge failed: ..."), for status.
    cover: str | None = None
    copy: str | None = None  # the name of its copy while a surge of it is under way

    def __post_init__(self) -> None:
        if not self.supervision.name and self.instance is not None:
            self.supervision.name = self.instance.name  # for the transition log

    def new_process(self, pid: int | None) -> None:
        """Forget everything measured on the previous process (a restart, a crash, adoption)."""
        self.pid, self.checks, self.cpu, self.engine = pid, fresh_checks(), CpuProgress(), EngineRate()
        self.key_check = KeyCheck.UNKNOWN
        self.prompt.new_process()

    # -- events, counted per kind for status and metrics ------------------------------------------
    def record_drift(self, kind: EventKind, detail: str, at: float) -> None:
        self.last_drift = Event(at, kind.value, detail)
        self.drift_counts[kind.value] = self.drift_counts.get(kind.value, 0) + 1

    def record_repair(self, kind: EventKind, detail: str, at: float, counted: bool = True) -> None:
        """`counted` False: a repair's measured result, reported but not a repair of its own."""
        self.last_repair = Event(at, kind.value, detail)
        if counted:
            self.repair_counts[kind.value] = self.repair_counts.get(kind.value, 0) + 1

    # -- read by status, metrics and older callers ----------------------------------------------------
    @property
    def memory(self) -> drift.MemoryVerdict | None:
        check = self.checks.get(EventKind.MEMORY)
        return check.verdict if isinstance(check, MemoryCheck) else None

    @property
    def runnable_cpus(self) -> tuple[int, ...]:
        """The planned CPUs the kernel lets the process run on now (all of them, unless its
        cgroup's cpuset was narrowed under it)."""
        check = self.checks.get(EventKind.ALLOWED)
        allowed = check.allowed if isinstance(check, AllowedSetCheck) else None
        return self.instance.cpus if allowed is None else tuple(c for c in self.instance.cpus if c in allowed)

    @property
    def migrated_from(self) -> int | None:
        check = self.checks.get(EventKind.MEMORY)
        return check.migrated_from if isinstance(check, MemoryCheck) else None

    @migrated_from.setter
    def migrated_from(self, value: int | None) -> None:
        check = self.checks.get(EventKind.MEMORY)
        if isinstance(check, MemoryCheck):
            check.migrated_from = value

    @property
    def counters(self) -> EngineCounters | None:
        return self.engine.counters

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.engine.decode_tokens_per_s

    def on_counters(self, counters: EngineCounters | None, now: float) -> None:
        self.engine.update(counters, now)
        self.prompt.update(counters)
