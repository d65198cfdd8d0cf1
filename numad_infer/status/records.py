"""What `numa-infer status` shows, as one typed model: written by the daemon (the state
file, every pass, through `statefile`), read by the CLI and the Prometheus endpoint.

Adding a column is three edits: a field here; its value, filled in by the daemon
(`daemon._instance_status`, or `InstanceStatus.planned` when the plan already says it);
and its cell in `cli.present.format_status`. A field nobody fills stays at its default.
Plain dataclasses, no pydantic: `numa-infer status` with the daemon running reads only
this file and `statefile` and should start fast. The JSON shape is the state file's (schema `SCHEMA`);
a file of another schema is refused with one line, never a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from numad_infer.errors import NumaInferError
from numad_infer.lifecycle.states import State
from numad_infer.util.histogram import Histogram
from numad_infer.util.typedjson import DecodeError, decode

if TYPE_CHECKING:  # the planner needs pydantic (the config): `status` must start without it
    from numad_infer.plan.model import Instance

SCHEMA = 2
# How `DaemonStatus.metrics` begins when the endpoint could not listen (status/metrics.py).
METRICS_REFUSED = "cannot listen on "


class StatusError(NumaInferError):
    pass


class DaemonState(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    NOT_RUNNING = "not running"  # no daemon: what `status` shows from the plan and the units

    @property
    def live(self) -> bool:
        return self in (DaemonState.STARTING, DaemonState.RUNNING)


@dataclass(frozen=True)
class Event:
    at: float  # wall-clock time
    kind: str  # a drift.EventKind value
    detail: str


@dataclass(frozen=True)
class ReloadResult:
    at: float
    ok: bool
    why: str  # "start", "reload", "cpu hotplug"
    error: str | None = None
    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    # HAProxy was reloaded by it (tenants, their keys or the routing changed), with or
    # without an instance changing: `reload` says so rather than "added none, changed none".
    frontdoor_reloaded: bool = False


@dataclass(frozen=True)
class RestartResult:
    """The answer to `numa-infer restart` (its request's id), and how far the roll is."""
    id: str
    at: float
    ok: bool
    instances: tuple[str, ...] = ()
    error: str | None = None
    left: tuple[str, ...] = ()  # not yet restarted and healthy again: the roll is over when empty


@dataclass(frozen=True)
class MemoryStatus:
    anon_bytes: int
    remote_bytes: int
    file_bytes: int
    file_local_fraction: float | None
    source: str


@dataclass(frozen=True)
class InstanceStatus:
    name: str
    node: int | None
    cpus: tuple[int, ...]
    mems: tuple[int, ...]
    threads: int
    port: int
    pid: int | None
    state: State
    model: str = ""  # the [[models]] name it serves; "" with a single [model]
    unit_state: str | None = None  # what systemd says, when no daemon supervises
    uptime_s: float | None = None
    restarts: int = 0
    consecutive_failures: int = 0
    error: str | None = None
    drifting: bool = False
    local_memory_fraction: float | None = None
    memory: MemoryStatus | None = None
    probe_latency_ms: float | None = None
    last_drift: Event | None = None
    last_repair: Event | None = None
    drift_events: dict[str, int] = field(default_factory=dict)
    repairs: dict[str, int] = field(default_factory=dict)
    # From the front door (None without one): its view of this instance.
    rotation: str | None = None  # HAProxy's words: UP, DOWN, DRAIN, MAINT
    in_flight: int | None = None
    queued: int | None = None
    served: int | None = None
    # From the engine's own counters (llama-server; None for llama-cpp-python).
    slots: int | None = None  # requests it works on at once (server.parallel)
    busy_slots: int | None = None
    decode_tokens_per_s: float | None = None  # generated tokens per second over the last pass
    # decode_tokens_per_s x bytes a decoded token reads (every layer, the output
    # projection, one embedding row) / the node's read bandwidth as `numa-infer tune` measured it
    decode_efficiency: float | None = None
    # From the front door's log of each request (request_log.py), since the daemon started:
    # until the first byte of the answer's body (a stream's first token), and until its last.
    time_to_first_token: Histogram | None = None
    request_duration: Histogram | None = None
    # The CPU kernels the engine runs: ggml's variant and its wide units, e.g. "haswell (AVX2)"
    cpu_backend: str | None = None
    # How its last restart as the only instance of its model in rotation kept the model
    # served: "surge: ..." (a copy served meanwhile) or "hold: ..." (requests waited), and why.
    restart_cover: str | None = None
    # HAProxy's word for the server of its surge's copy while one is under way (None: none):
    # a model whose instance restarts behind a copy in rotation is served.
    copy_rotation: str | None = None
    # The last error-looking line of its log while it fails or is not running (the process
    # backend's log file, childlog.last_error_line): what the program itself said, escaped.
    log_error: str | None = None
    # KV cache (llama-server's /slots): tokens its busy slots hold, and the cells of all its slots.
    kv_cache_tokens: int | None = None
    kv_cache_size: int | None = None
    # Prompt tokens since the daemon started, over all the instance's processes (llama-server's
    # /metrics: prompt_tokens_cached_total, prompt_tokens_total): taken from its cache, computed.
    prompt_tokens_cached: int | None = None
    prompt_tokens_computed: int | None = None
    # Its prompt cache's bound as the plan sized it (Instance.prompt_cache_mib: --cache-ram's
    # MiB, 0 off); None where the plan did not size it (the engine keeps none, or the
    # operator's extra_args bound it).
    prompt_cache_mib: int | None = None

    @property
    def prompt_cache_share(self) -> float | None:
        """Of the prompt tokens it served, the share taken from its cache (None: none yet)."""
        return prompt_cache_share((self,))

    @classmethod
    def planned(cls, instance: Instance, pid: int | None, state: State, **observed: Any) -> InstanceStatus:
        """What the plan says of `instance` (its place and port) plus what was observed of it:
        the one projection of a planned instance, for the daemon and for `status` without one."""
        return cls(name=instance.name, node=instance.node, cpus=instance.cpus, mems=instance.mems,
                   threads=instance.threads, port=instance.port, pid=pid, state=state, model=instance.model,
                   prompt_cache_mib=instance.prompt_cache_mib, **observed)


@dataclass(frozen=True)
class ModelStatus:
    """One served model: the ids that route to it, its instances, and whether it answers."""
    name: str  # what clients send ("" with a single [model] that has no model.name)
    aliases: tuple[str, ...] = ()
    instances: tuple[str, ...] = ()
    healthy: bool = False  # served: `serving`, through `model_health`
    problem: str | None = None  # why not, when not
    # The front door's queue and requests in its instances, for this model (None without one).
    queued: int | None = None
    in_flight: int | None = None


@dataclass(frozen=True)
class TenantStatus:
    """One `[[tenants]]` table's use of the front door (frontdoor/tenants.py)."""

    name: str
    in_flight: int | None = None  # answered or queued now; None: not read this pass
    last_minute: int | None = None  # let through in the last 60 s (what requests_per_minute holds)
    # Since the daemon started, by HTTP status; HAProxy's own refusals (429, 403) included.
    answers: dict[str, int] = field(default_factory=dict)
    time_to_first_token: Histogram | None = None  # of its requests an instance answered
    request_duration: Histogram | None = None
    # Tokens the engine reported in its answers, whole or streamed (frontdoor/token_count.py),
    # since the daemon started, and how many answers reported them.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counted_answers: int = 0
    # Since the daemon started, requests whose client left before the answer's end: not in
    # `answers` (HAProxy logs the 502 it never sent for one the daemon ended).
    left: int = 0


@dataclass(frozen=True)
class FrontdoorStatus:
    listen: str
    up: bool
    queued: int | None = None
    in_flight: int | None = None
    error: str | None = None
    queue_size: int | None = None  # frontend.queue_size: one more waiting request gets a 503
    # Answers sent to clients by class ("2xx", "5xx"...) since HAProxy (re)started.
    responses: dict[str, int] = field(default_factory=dict)
    # A new haproxy.cfg was written and its reload not yet seen taken (reload_watch.py):
    # until then HAProxy still routes by the previous plan (a removed model still answers).
    reloading: bool = False
    tenants: tuple[TenantStatus, ...] = ()  # in the configuration's order
    # Requests the daemon ended because their client had left (frontdoor/abandoned.py), by
    # model, since the daemon started.
    abandoned: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class DaemonStatus:
    state: DaemonState
    config: str
    pid: int | None = None
    version: str | None = None
    backend: str | None = None
    started_at: float | None = None
    updated_at: float | None = None
    interval_s: float | None = None
    generation: int = 0
    last_reload: ReloadResult | None = None
    last_restart: RestartResult | None = None
    warnings: tuple[str, ...] = ()
    # The one line also sent as STATUS= to systemd; made from the rest of the status
    # (status/verdicts.summary_line) where it is written and shown, so it never disagrees
    # with the tables.
    status: str | None = None
    pass_duration_s: float | None = None
    pass_started_at: float | None = None  # wall clock: the last published pass saw the fleet as of then
    metrics: str | None = None  # the metrics endpoint's address, or why it has none: METRICS_REFUSED...
    # What the instances' cgroup lets them use, and what of the machine that leaves out.
    allowed: str | None = None
    min_local_fraction: float | None = None  # monitor.min_local_fraction: below it is memory drift

    @property
    def metrics_error(self) -> str | None:
        """Why `[metrics] listen` is not served (`cannot listen on ADDR: why`), or None."""
        return self.metrics if self.metrics is not None and self.metrics.startswith(METRICS_REFUSED) else None

    @property
    def config_ok(self) -> bool:
        """The last start, reload or re-plan was applied (numa_infer_config_ok)."""
        return self.last_reload is None or self.last_reload.ok


def in_rotation(rotation: str | None) -> bool:
    """HAProxy sends a server requests while it is UP, also "UP 1/2" (one failed check of
    the `fall` it takes to go DOWN); "DOWN 1/2" is on its way up, not there yet."""
    return rotation is not None and rotation.split(" ")[0] == "UP"


def serving(instances: Iterable[InstanceStatus], frontdoor: bool) -> bool:
    """Is the model of `instances` served? Behind a front door exactly while it has a server
    of the model in rotation (up, not drained, not in maintenance; the spare server of a
    surge included): what its /healthz answers from. Without one, while one of them is
    healthy. The one verdict: the models' health (`model_health`), the status line,
    `health --ready` and the metrics all come from it."""
    if not frontdoor:
        return any(i.state == State.HEALTHY for i in instances)
    return any(in_rotation(i.rotation) or in_rotation(i.copy_rotation) for i in instances)


def prompt_cache_share(instances: tuple[InstanceStatus, ...]) -> float | None:
    """Of the prompt tokens `instances` served, the share their engines took from a cache:
    cached / (cached + computed), over those that report both; None before any token."""
    counted = [(i.prompt_tokens_cached or 0, i.prompt_tokens_computed or 0) for i in instances
               if i.prompt_tokens_cached is not None and i.prompt_tokens_computed is not None]
    served = sum(c + p for c, p in counted)
    return None if not served else sum(c for c, _ in counted) / served


@dataclass(frozen=True)
class Status:
    daemon: DaemonStatus
    instances: tuple[InstanceStatus, ...]
    frontdoor: FrontdoorStatus | None = None
    # Grouped by model (one entry with a single [model]); `instances` stays the flat list.
    models: tuple[ModelStatus, ...] = ()

    @property
    def multi(self) -> bool:
        """The [[models]] form: its instances carry the model's name."""
        return any(i.model for i in self.instances)

    def model_of(self, instance: InstanceStatus) -> str:
        """The served model's name of an instance (model.name with a single [model])."""
        for model in self.models:
            if instance.name in model.instances:
                return model.name
        return instance.model

    @property
    def healthy(self) -> bool:
        """Every instance healthy and undrifted, every model served, the front door (if any)
        up, the configuration applied and the metrics served: `status` exits 0, else what
        it printed says what is not."""
        instances_ok = bool(self.instances) and all(i.state == State.HEALTHY and not i.drifting for i in self.instances)
        return (instances_ok and (self.frontdoor is None or self.frontdoor.up) and all(m.healthy for m in self.models)
                and self.daemon.config_ok and self.daemon.metrics_error is None)

    def live(self, now: float) -> bool:
        """The daemon's loop is turning: it published within three monitoring intervals
        (at least 10 s: a pass can take a while on a busy machine)."""
        d = self.daemon
        if not d.state.live or d.updated_at is None:
            return False
        return now - d.updated_at <= max(3 * (d.interval_s or 5.0), 10.0)

    @property
    def ready(self) -> bool:
        """Requests can be served: a server in rotation behind the front door, a surge's copy
        included (with no front door, a healthy instance): `serving`, over every model."""
        front = self.frontdoor
        return (front is None or front.up) and serving(self.instances, front is not None)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **_plain(asdict(self))}

    @classmethod
    def from_json(cls, data: Any, source: str = "state file") -> Status:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else None
            raise StatusError(f"{source}: schema {found!r}, this numa-infer reads schema {SCHEMA}; "
                              "restart the daemon (systemctl restart numa-infer) so both are the same version")
        body = {k: v for k, v in data.items() if k != "schema"}
        try:
            return decode(cls, body, "state")
        except DecodeError as exc:
            raise StatusError(f"{source}: not a numa-infer state file ({exc})") from None


def model_health(instances: tuple[InstanceStatus, ...], frontdoor: bool,
                 hold_s: float | None = None) -> tuple[bool, str | None]:
    """A model answers while at least one of its instances is in rotation (healthy, where
    there is no front door); otherwise what is wrong, as counts of its instances' states,
    and, behind the front door (`hold_s`: frontend.queue_timeout_s), what its requests do
    meanwhile: they wait for an instance (frontdoor/hold.py)."""
    if serving(instances, frontdoor):
        return True, None
    if not instances:
        return False, "no instance planned"
    counts: dict[str, int] = {}
    for i in instances:
        word = "healthy, out of rotation" if i.state == State.HEALTHY else i.state.value
        counts[word] = counts.get(word, 0) + 1
    states = ", ".join(f"{n} {word}" for word, n in sorted(counts.items()))
    held = f"; its requests wait up to {hold_s:g}s for one (hold), then 503" if frontdoor and hold_s else ""
    return False, f"no instance in rotation ({states}){held}"


def group_models(served: tuple[tuple[str, str, tuple[str, ...]], ...], instances: tuple[InstanceStatus, ...],
                 frontdoor: bool, load: dict[str, tuple[int, int]] | None = None,
                 hold_s: float | None = None) -> tuple[ModelStatus, ...]:
    """`served`: (key, name, aliases) per model, in the configuration's order; an instance is
    the model's whose key it carries (`Instance.model`: "" in the single form). `load`: the
    front door's (queued, in flight) per model key."""
    out = []
    for key, name, aliases in served:
        mine = tuple(i for i in instances if i.model == key)
        healthy, problem = model_health(mine, frontdoor, hold_s)
        queued, in_flight = (load or {}).get(key, (None, None))
        out.append(ModelStatus(name, aliases, tuple(i.name for i in mine), healthy, problem, queued, in_flight))
    return tuple(out)


def _plain(value: Any) -> Any:
    """asdict() output -> JSON types (enums by value, tuples as lists)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
