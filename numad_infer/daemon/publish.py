"""What the daemon publishes each pass (the state file, metrics, sd_notify's STATUS=):
the instances' runtimes and the front door's counters projected into `status` types."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from numad_infer.backends.childlog import InstanceLogs, last_error_line
from numad_infer.backends.process import ProcessFrontdoorRunner
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.frontdoor.haproxy import BackendStat
from numad_infer.frontdoor.haproxy_config import server_name
from numad_infer.frontdoor.spare import spare_stat
from numad_infer.lifecycle.states import State
from numad_infer.status.records import (
    DaemonState,
    DaemonStatus,
    FrontdoorStatus,
    InstanceStatus,
    MemoryStatus,
    ModelStatus,
    ReloadResult,
    Status,
    TenantStatus,
    group_models,
)
from numad_infer.status.verdicts import summary_line
from numad_infer.supervision.health import KeyCheck
from numad_infer.supervision.instance import Runtime
from numad_infer.topology.cgroup_limits import left_out
from numad_infer.tune.bandwidth_file import Results
from numad_infer.util.cpuset import format_list
from numad_infer.validate.loaded import Loaded


def status_line(runtimes: list[Runtime], last_reload: ReloadResult | None, frontdoor: Frontdoor | None = None,
                loaded: Loaded | None = None) -> str:
    """One line: `2/2 instances healthy (1 starting, 1 drifting); config error ...`; with
    several models also `; 1/2 models serving (beta not)`. The published Status makes its
    own from itself (verdicts.summary_line); this is the same line for STATUS=, from the
    runtimes, and follows the front door where it is given one."""
    fd = frontdoor if frontdoor is not None and front_door(frontdoor) else None
    found = tuple(InstanceStatus.planned(rt.instance, rt.pid, rt.supervision.state, drifting=rt.drifting,
                                         rotation=None if fd is None else _rotation(rt, fd),
                                         copy_rotation=None if fd is None else _copy_rotation(rt, fd))
                  for rt in runtimes)
    daemon = DaemonStatus(DaemonState.RUNNING, "", last_reload=last_reload)
    served = () if frontdoor is None else models(found, frontdoor, loaded)
    return summary_line(Status(daemon, found, None if fd is None else frontdoor_status(fd, {}), served))


def front_door(fd: Frontdoor) -> bool:
    """A front door was asked for: running, or refused (`fd.error`, e.g. its port in use at
    start): then it serves nothing, and no model is served through it."""
    return bool(fd.listen or fd.error)


def instances(runtimes: list[Runtime], now: float, frontdoor: Frontdoor, loaded: Loaded | None,
              tuned: Results) -> tuple[InstanceStatus, ...]:
    cpu = None if loaded is None or loaded.engine_cpu.cpu is None else loaded.engine_cpu.cpu.describe()

    def status(rt: Runtime) -> InstanceStatus:
        # The slots column only for an engine that reports its busy slots; both per model.
        model = None if loaded is None else loaded.model(rt.instance.model)
        slots = (loaded.engine.slots(model.served.view) if loaded is not None and model is not None
                 and loaded.engine.metrics_path else None)
        weights = 0 if model is None else model.decode_bytes
        return replace(_instance_status(rt, now, frontdoor, slots, _efficiency(rt, weights, tuned)), cpu_backend=cpu)

    return tuple(status(rt) for rt in runtimes)


def models(instances: tuple[InstanceStatus, ...], frontdoor: Frontdoor,
           loaded: Loaded | None) -> tuple[ModelStatus, ...]:
    """The instances grouped by the model they serve, each with its health and its queue at
    the front door."""
    if loaded is None:
        return ()
    served = tuple((m.served.ident, m.served.name, m.served.aliases) for m in loaded.models)
    load: dict[str, tuple[int, int]] = {}
    stats = frontdoor.stats if frontdoor.listen else None
    # One backend per model at the front door, by the model's key (frontdoor/control.py's
    # model_stats); until it has been read, the instances' own counts.
    per_model: dict[str, BackendStat] = frontdoor.model_stats if stats is not None else {}
    for key, _, _ in served:
        stat = per_model.get(key)
        if stat is not None:
            load[key] = (stat.queued, stat.in_flight)
        elif stats is not None:
            mine = [i for i in instances if i.model == key]
            load[key] = (sum(i.queued or 0 for i in mine), sum(i.in_flight or 0 for i in mine))
    behind = loaded.config.frontend.enabled and front_door(frontdoor)
    return group_models(served, instances, behind, load, loaded.config.frontend.queue_timeout_s if behind else None)


def allowed_line(loaded: Loaded | None) -> str | None:
    """What the instances may use, and what that leaves out of the machine."""
    if loaded is None:
        return None
    out = left_out(loaded.topology, loaded.allowed)
    return loaded.allowed.describe() + (f"; left out: CPUs {format_list(out)}" if out else "")


def frontdoor_status(fd: Frontdoor, abandoned: Mapping[str, int]) -> FrontdoorStatus | None:
    """`abandoned`: requests the daemon ended because their client left, by backend
    (frontdoor/abandon_watch.py), shown by model."""
    if not fd.listen:
        # Asked for and never started (its port taken at start): down, and why.
        return FrontdoorStatus("", False, error=fd.error) if fd.error else None
    stats = fd.stats
    models = {backend: model for model, backend in fd.backends.items()}
    return FrontdoorStatus(fd.listen, stats is not None, None if stats is None else stats.queued,
                           None if stats is None else stats.in_flight, fd.error or None, fd.queue_size or None,
                           {} if fd.answers is None else dict(fd.answers.responses), fd.reloads.pending is not None,
                           _tenants(fd), {**dict.fromkeys(fd.backends, 0),  # every model's counter from 0
                                          **{models.get(be, be): n for be, n in sorted(abandoned.items())}})


def _tenants(fd: Frontdoor) -> tuple[TenantStatus, ...]:
    """The configured tenants only: a name in HAProxy's table or log that the configuration
    no longer has (removed by a reload) is not shown, so the labels stay bounded."""
    usage = fd.requests.timings.tenants()
    out = []
    for name in fd.tenants:
        count, used = fd.tenant_counts.get(name), usage.get(name)
        # No entry in a table that was read: no request since HAProxy started.
        in_flight, last_minute = (count.in_flight, count.last_minute) if count else (
            (0, 0) if fd.stats is not None else (None, None))
        if used is None:
            out.append(TenantStatus(name, in_flight, last_minute))
            continue
        out.append(TenantStatus(name, in_flight, last_minute, used.answers, used.time_to_first_token,
                                used.request_duration, used.prompt_tokens, used.completion_tokens,
                                used.counted_answers, used.left))
    return tuple(out)


def _efficiency(rt: Runtime, weights: int, tuned: Results) -> float | None:
    """Decode tokens/s x bytes a decoded token reads (model/gguf.py) / the node's measured bandwidth."""
    if rt.decode_tokens_per_s is None or rt.instance.node is None or not weights:
        return None
    gbs = tuned.local_gbs(rt.instance.node)
    return None if not gbs else rt.decode_tokens_per_s * weights / (gbs * 1e9)


def _copy_rotation(rt: Runtime, frontdoor: Frontdoor) -> str | None:
    """HAProxy's word for the model's spare server while `rt`'s copy serves from it (surge.py)."""
    spare = spare_stat(frontdoor, rt.instance.model) if rt.copy is not None and frontdoor.listen else None
    return None if spare is None else spare.status


def _rotation(rt: Runtime, frontdoor: Frontdoor) -> str | None:
    stat = None if frontdoor.stats is None else frontdoor.stats.servers.get(server_name(rt.instance.name))
    return None if stat is None else stat.status


# Where an instance's own words of why it failed can be read: not while it runs well.
_FAILING = (State.FAILED, State.BACKOFF, State.EXITED, State.UNHEALTHY)


def _log_error(rt: Runtime, frontdoor: Frontdoor) -> str | None:
    """The last error-looking line of the instance's log while it fails, where the daemon
    writes its log to a file (the process backend's `--instance-logs file`)."""
    runner = frontdoor.runner  # only the process backend's writes the children's output itself
    if rt.supervision.state not in _FAILING or not isinstance(runner, ProcessFrontdoorRunner):
        return None
    if runner.output.mode is not InstanceLogs.FILE:
        return None
    return last_error_line(Path(runner.output.log_dir) / f"{rt.instance.name}.log")


def _instance_status(rt: Runtime, now: float, frontdoor: Frontdoor, slots: int | None,
                     efficiency: float | None) -> InstanceStatus:
    """`slots`: requests an instance works on at once, where its engine reports them."""
    sup, inst, mem = rt.supervision, rt.instance, rt.memory
    stat = None if frontdoor.stats is None else frontdoor.stats.servers.get(server_name(inst.name))
    timings = frontdoor.timings(inst) if frontdoor.listen else None
    prompt = rt.prompt.totals
    status = InstanceStatus.planned(
        inst, rt.pid, sup.state,
        uptime_s=round(now - sup.started_at, 1) if sup.started_at is not None and rt.pid else None,
        restarts=sup.restarts, consecutive_failures=sup.failures,
        error=("refuses the API key of server.api_key_file: restart it to give it the current key"
               if rt.key_check == KeyCheck.REJECTED else sup.last_error or None), drifting=rt.drifting,
        local_memory_fraction=None if mem is None or mem.local_fraction is None else round(mem.local_fraction, 4),
        memory=None if mem is None else MemoryStatus(
            mem.anon_bytes, mem.remote_bytes, mem.file_bytes,
            None if mem.file_local_fraction is None else round(mem.file_local_fraction, 4), mem.source),
        probe_latency_ms=(None if rt.last_probe is None or not rt.last_probe.ok
                          else round(rt.last_probe.latency_s * 1000, 1)),
        last_drift=rt.last_drift, last_repair=rt.last_repair,
        drift_events=dict(rt.drift_counts), repairs=dict(rt.repair_counts),
        rotation=None if stat is None else stat.status, in_flight=None if stat is None else stat.in_flight,
        queued=None if stat is None else stat.queued, served=None if stat is None else stat.served,
        slots=slots, busy_slots=None if rt.counters is None else rt.counters.busy_slots,
        kv_cache_tokens=None if rt.counters is None else rt.counters.kv_cache_tokens,
        kv_cache_size=None if rt.counters is None else rt.counters.kv_cache_size,
        prompt_tokens_cached=None if prompt is None else prompt[0],
        prompt_tokens_computed=None if prompt is None else prompt[1],
        decode_tokens_per_s=None if rt.decode_tokens_per_s is None else round(rt.decode_tokens_per_s, 1),
        decode_efficiency=None if efficiency is None else round(efficiency, 4),
        restart_cover=rt.cover,
        copy_rotation=_copy_rotation(rt, frontdoor), log_error=_log_error(rt, frontdoor),
        time_to_first_token=None if timings is None else timings[0],
        request_duration=None if timings is None else timings[1])
    # Never a CPU the instance cannot run on: its cgroup may have been narrowed under it.
    return replace(status, cpus=rt.runnable_cpus)
