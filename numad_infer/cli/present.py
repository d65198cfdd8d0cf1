"""What the commands print: the topology, the plan, the engine line, what the cgroup
allows, the status table. Values in, text out; no I/O.

Every line leaves here escaped (`printable`): the status carries what others wrote (a
thread's name in a drift, an instance's or HAProxy's answer in an error), and the rest
(paths, warnings) costs nothing to escape."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from numad_infer.lifecycle.states import State
from numad_infer.status.records import in_rotation, prompt_cache_share
from numad_infer.util.cpuset import format_list
from numad_infer.util.printable import printable, printable_lines
from numad_infer.util.tables import format_table

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numad_infer.config.schema import Config
    from numad_infer.engines import Engine
    from numad_infer.plan.memory_fit import InstanceMemory, NodeFit
    from numad_infer.plan.model import Plan
    from numad_infer.status.records import InstanceStatus, Status, TenantStatus
    from numad_infer.topology.cgroup_limits import Allowed
    from numad_infer.topology.model import Topology


def format_topology(topo: Topology) -> str:
    ids = topo.node_ids
    out = [f"available: {len(ids)} nodes ({format_list(ids)})"]
    for node in topo.nodes:
        out.append(f"node {node.id} cpus: {' '.join(map(str, node.cpus))}")
        threads = {len(c) for c in node.cores}
        smt = f" ({'/'.join(map(str, sorted(threads)))} thread(s) per core)" if node.cores else ""
        out.append(f"node {node.id} cores: {len(node.cores)}{smt}: "
                   + " ".join("[" + ",".join(map(str, c)) + "]" for c in node.cores))
        out.append(f"node {node.id} size: {node.memory_total_bytes // 2**20} MB")
    out.append("node distances:")
    out.append("node " + "".join(f"{i:>4}" for i in ids))
    for node in topo.nodes:
        out.append(f"{node.id:>4}:" + "".join(f"{node.distances.get(i, 0):>4}" for i in ids))
    out += [f"warning: {w}" for w in topo.warnings]
    return printable_lines(out)


def format_plan(plan: Plan, warnings: tuple[str, ...] | None = None) -> str:
    """The plan as a table, then `warnings` (default: the plan's own)."""
    rows = [("INSTANCE", "NODE", "CPUS", "MEMS", "POLICY", "THREADS", "PORT", "CACHE-RAM")]
    for i in plan.instances:
        rows.append((i.name, "-" if i.node is None else str(i.node), format_list(i.cpus), format_list(i.mems),
                     i.policy.value, str(i.threads), str(i.port), prompt_cache_text(i.prompt_cache_mib)))
    lines = format_table(rows)
    lines += [f"warning: {w}" for w in (plan.warnings if warnings is None else warnings)]
    return printable_lines(lines)


def prompt_cache_text(mib: int | None) -> str:
    """An instance's prompt cache bound as the planner sized it (`--cache-ram`'s MiB): `1536
    MiB`, `off`, or `-` where it did not size it (the engine keeps none, or the operator's
    extra_args bound it: the memory lines say what)."""
    return "-" if mib is None else "off" if mib == 0 else f"{mib} MiB"


def format_memory(memory: Sequence[InstanceMemory], fits: Sequence[NodeFit]) -> list[str]:
    """What one instance of each model holds, then per node what its instances need against its memory."""
    return [*(f"memory per instance ({m.model}): {m.detail}" for m in memory), *(fit.describe() for fit in fits)]


def format_engine(config: Config, engine: Engine) -> str:
    """Which server every instance runs, and the key that chose it (or that it is the default)."""
    chosen = "server.engine" if "engine" in config.server.model_fields_set else "the default; server.engine"
    if not engine.program_key:
        return printable(f"engine: {engine.name} ({chosen})")
    return printable(f"engine: {engine.name} ({chosen}), every instance runs {engine.program(config)} "
                     f"(server.{engine.program_key})")


def format_allowed(topo: Topology, allowed: Allowed) -> list[str]:
    """What the instances' cgroup allows, and what of the machine that leaves out (nothing
    when it restricts nothing)."""
    from numad_infer.topology.cgroup_limits import left_out

    if allowed.cpus is None and allowed.mems is None and allowed.quota_cpus is None:
        return []
    lines = [f"allowed to the instances: {allowed.describe()}"]
    cpus = left_out(topo, allowed)
    mems = {n.id for n in topo.nodes if n.memory_total_bytes > 0} - set(allowed.mems or {n.id for n in topo.nodes})
    if cpus or mems:
        lines.append("left out: " + ", ".join(([f"CPUs {format_list(cpus)}"] if cpus else [])
                                             + ([f"memory of node(s) {format_list(mems)}"] if mems else [])))
    return [printable(line) for line in lines]


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_status(status: Status) -> str:
    d = status.daemon
    lines = [f"numa-infer: {d.state.value}" + (f" (pid {d.pid}, backend {d.backend})" if d.pid else "")
             + f", config {d.config}"]
    if d.status:  # made from the rest of the status as the state file was written (statefile.py)
        lines.append(f"status: {d.status}")
    reload = d.last_reload
    if reload is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(reload.at))
        if reload.ok:
            lines.append(f"last {reload.why}: {when} ok (added {len(reload.added)}, changed {len(reload.changed)}, "
                         f"removed {len(reload.removed)})")
        else:
            lines.append(f"last {reload.why}: {when} FAILED: {reload.error}")
    if d.allowed:
        lines.append(f"allowed: {d.allowed}")
    if d.metrics_error:
        lines.append(f"metrics: {d.metrics_error}")
    lines += [f"warning: {w}" for w in d.warnings]
    front = status.frontdoor
    if front is not None:
        if front.up:
            left = sum(front.abandoned.values())
            lines.append(f"front door: http://{front.listen} up, {front.in_flight} in flight, {front.queued} queued"
                         + (f", {left} stopped as their client left" if left else "")
                         + ("; reloading (still routing by the previous plan)" if front.reloading else ""))
        else:
            where = f"http://{front.listen} " if front.listen else ""
            lines.append(f"front door: {where}DOWN" + (f": {front.error}" if front.error else ""))
        lines += [_tenant_line(t) for t in front.tenants]
    # The engine's own columns only where an instance has them (llama-server).
    engine = any(i.slots is not None for i in status.instances)
    if status.multi:
        lines += _by_model(status, engine)
    else:
        # One model: said only when it is not served (e.g. its only instance restarting,
        # its requests held), as the [[models]] form says it on its model line.
        lines += [f"model: NOT SERVING: {m.problem}" for m in status.models if not m.healthy and m.problem]
        lines += _instance_table(status.instances, engine)
    for i in status.instances:
        for label, event in (("last drift", i.last_drift), ("last repair", i.last_repair)):
            if event is not None:
                when = time.strftime("%H:%M:%S", time.localtime(event.at))
                lines.append(f"  {i.name}: {label} {when} [{event.kind}] {event.detail}")
        if i.error:
            lines.append(f"  {i.name}: error: {i.error}")
        if i.log_error:
            lines.append(f"  {i.name}: {i.state.value}: its log says: {i.log_error}")
        if i.restart_cover:
            lines.append(f"  {i.name}: last restart: {i.restart_cover}")
        if i.unit_state:
            lines.append(f"  {i.name}: unit {i.unit_state}")
    return printable_lines(lines)


def _by_model(status: Status, engine: bool) -> list[str]:
    """[[models]]: a line per model (its health, its queue), then its instances' table."""
    lines: list[str] = []
    placed: set[str] = set()
    for model in status.models:
        aliases = f" (aliases: {', '.join(model.aliases)})" if model.aliases else ""
        health = "healthy" if model.healthy else f"NOT SERVING: {model.problem}"
        load = "" if model.in_flight is None else f", {model.in_flight} in flight, {model.queued} queued"
        mine = tuple(i for i in status.instances if i.name in model.instances)
        cached = _cached(mine)
        reuse = "" if cached == "-" else f", prompt tokens cached {cached}"
        lines.append(f"model {model.name}{aliases}: {health}{load}{reuse}")
        placed.update(i.name for i in mine)
        lines += ["  " + row for row in _instance_table(mine, engine)]
    rest = tuple(i for i in status.instances if i.name not in placed)
    if rest:  # a model a reload removed, its instances still draining
        lines.append("not in the configuration:")
        lines += ["  " + row for row in _instance_table(rest, engine)]
    return lines


def _instance_table(instances: tuple[InstanceStatus, ...], engine: bool) -> list[str]:
    cache = any(i.prompt_cache_mib is not None for i in instances)  # a prompt cache the plan sized
    rows = [("INSTANCE", "NODE", "CPUS", "PORT", "PID", "STATE", "UPTIME", "RESTARTS", "LOCAL-MEM", "PROBE",
             "ROTATION", "INFLIGHT", "QUEUED") + (("SLOTS", "TOK/S", "BW-EFF", "PROMPT-CACHED") if engine else ())
            + (("CACHE-RAM",) if cache else ())]
    for i in instances:
        frac = i.local_memory_fraction
        row: tuple[str, ...] = (i.name, _dash(i.node), format_list(i.cpus), str(i.port), _dash(i.pid),
               i.state.value + (" drifting" if i.drifting else ""), _age(i.uptime_s), str(i.restarts),
               "-" if frac is None else f"{frac:.1%}",
               "-" if i.probe_latency_ms is None else f"{i.probe_latency_ms:.0f}ms",
               _dash(i.rotation), _dash(i.in_flight), _dash(i.queued))
        if engine:
            row += ("-" if i.slots is None else f"{_dash(i.busy_slots)}/{i.slots} busy",
                    "-" if i.decode_tokens_per_s is None else f"{i.decode_tokens_per_s:.1f}",
                    "-" if i.decode_efficiency is None else f"{i.decode_efficiency:.0%}",
                    _cached((i,)))
        if cache:
            row += (prompt_cache_text(i.prompt_cache_mib),)
        rows.append(row)
    return format_table(rows)


def _cached(instances: tuple[InstanceStatus, ...]) -> str:
    """Prompt tokens taken from the engines' caches: "62% of 4.1k" (of every prompt token served)."""
    share = prompt_cache_share(instances)
    if share is None:
        return "-"
    served = sum((i.prompt_tokens_cached or 0) + (i.prompt_tokens_computed or 0) for i in instances)
    return f"{share:.0%} of {_count(served)}"


def _count(n: int) -> str:
    return str(n) if n < 1000 else f"{n / 1000:.1f}k" if n < 1_000_000 else f"{n / 1e6:.1f}M"


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def rotation_words(status: Status) -> str:
    """What `health --ready` says its verdict (Status.ready) stands on: the servers the front
    door has in rotation (a surge's copy included) and why none, or without a front door
    the healthy instances."""
    front, count = status.frontdoor, len(status.instances)
    if front is None:
        healthy = sum(i.state == State.HEALTHY for i in status.instances)
        return f"{healthy}/{count} instance(s) healthy (no front door)"
    text = f"{sum(in_rotation(i.rotation) for i in status.instances)}/{count} instance(s) in rotation"
    copies = sum(in_rotation(i.copy_rotation) for i in status.instances)
    text += f", {copies} surge cop{'y' if copies == 1 else 'ies'}" if copies else ""
    return text if front.up else text + "; front door down" + (f": {front.error}" if front.error else "")


def join_names(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "none"


def _tenant_line(tenant: TenantStatus) -> str:
    now = ("" if tenant.in_flight is None
           else f"{tenant.in_flight} in flight, {tenant.last_minute} let through in the last minute; ")
    answered = ", ".join(f"{status} x{n}" for status, n in sorted(tenant.answers.items())) or "none"
    left = f"; {tenant.left} left before the answer" if tenant.left else ""
    tokens = (f"; tokens {tenant.prompt_tokens} prompt, {tenant.completion_tokens} completion in "
              f"{tenant.counted_answers} answer(s)" if tenant.counted_answers else "")
    return f"  tenant {tenant.name}: {now}answers since the daemon started: {answered}{left}{tokens}"
