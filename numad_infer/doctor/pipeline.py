"""`numa-infer doctor`'s pipeline: what the validated plan needs of the host, the facts
host_facts reads (and the engine reported to validation), and doctor's verdicts on them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from numad_infer.doctor.host_facts import HostReader, Sampler
from numad_infer.doctor.verdicts import Check, HostFacts, Needs, diagnose
from numad_infer.host.procfs import ProcReader

if TYPE_CHECKING:
    from numad_infer.status.records import Status
    from numad_infer.validate.loaded import Loaded


def plan_needs(loaded: Loaded) -> Needs:
    """The inference CPUs and what each node must hold for its instances (weights, KV cache,
    overhead; an interleaved instance's spread evenly over its nodes), from the validated plan."""
    fits = loaded.fits()
    views = [m.served.view.model for m in loaded.models]
    return Needs(cpus=frozenset(c for i in loaded.plan.instances for c in i.cpus),
                 online_cpus=frozenset(c for n in loaded.topology.nodes for c in n.cpus),
                 need_bytes={f.node: f.need for f in fits}, model_path=" and ".join(v.path for v in views),
                 mlock=all(v.mlock for v in views), engine=loaded.engine.name,
                 # Named per model only when there are several: one model's figures need no label.
                 per_instance="; ".join(f"{m.served.name}: {m.memory.describe()}" if len(loaded.models) > 1
                                        else m.memory.describe() for m in loaded.models),
                 context_keys=" or ".join(m.served.key_for("model.context_size") for m in loaded.models))


def read_facts(loaded: Loaded, fsroot: str | os.PathLike[str], status: Status | None, sample_s: float,
               sampler: Sampler | None = None) -> tuple[HostFacts, Needs]:
    """Everything doctor judges. `status` (the running daemon's, or None) names the instances'
    processes: their memory is theirs to reuse, and their CPU use is no neighbour's."""
    reader = HostReader(fsroot)
    plan = plan_needs(loaded)
    # This command, the daemon and its instances are what the CPUs are for, not neighbours.
    ours = frozenset({os.getpid(), *((status.daemon.pid,) if status and status.daemon.pid else ()),
                      *(i.pid for i in (status.instances if status else ()) if i.pid)})
    held = _held(status, fsroot)
    nodes = {n: mem for n in plan.need_bytes
             if (mem := reader.node_memory(n, *held.get(n, (0, ())))) is not None}
    facts = HostFacts(
        numa_balancing=reader.sysctl("kernel.numa_balancing"),
        thp_enabled=reader.thp("enabled"),
        thp_defrag=reader.thp("defrag"),
        cpufreq=reader.cpufreq(plan.cpus),
        zone_reclaim_mode=reader.sysctl("vm.zone_reclaim_mode"),
        swap_total_bytes=reader.swap_total_bytes(),
        swappiness=reader.sysctl("vm.swappiness"),
        nodes=nodes,
        irqs=reader.irqs(),
        irqbalance=bool(reader.running(("irqbalance",))),
        neighbours=(sampler or reader.sampler(ours))(sample_s),
        sample_s=sample_s,
        managers=reader.managers(),
        cpu_flags=reader.cpu_flags(),
        # What validation asked the engine (Engine.cpu), not a second asking.
        engine_cpu=loaded.engine_cpu,
        nodes_per_package=reader.nodes_per_package({n.id: n.cpus for n in loaded.topology.nodes if n.cpus}),
    )
    return facts, plan


def _held(status: Status | None, fsroot: str | os.PathLike[str]) -> dict[int, tuple[int, tuple[str, ...]]]:
    """Per node, the anonymous memory the running instances hold there, and which do."""
    held: dict[int, tuple[int, tuple[str, ...]]] = {}
    if status is None or Path(fsroot) != Path("/"):
        return held
    procs = ProcReader("/")
    for inst in status.instances:
        usage = procs.numa_maps(inst.pid) if inst.pid else None
        for node, nbytes in (usage.anon.items() if usage else ()):
            total, names = held.get(node, (0, ()))
            held[node] = (total + nbytes, names if not nbytes or inst.name in names else (*names, inst.name))
    return held


def checkup(loaded: Loaded, fsroot: str | os.PathLike[str], status: Status | None, sample_s: float,
            sampler: Sampler | None = None) -> list[Check]:
    return diagnose(*read_facts(loaded, fsroot, status, sample_s, sampler))
