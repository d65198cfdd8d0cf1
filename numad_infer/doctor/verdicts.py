"""`numa-infer doctor`: the host settings around the instances, judged against what this
configuration's plan needs. Pure: `host_facts.read_facts` collects what the kernel says
into `HostFacts`, and `diagnose` turns it into one `Check` per setting. Nothing here
changes the host; every check names the command or file that would.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

from numad_infer.host.cpufeatures import EngineCpuReport, idle_units, offered_units
from numad_infer.util.cpuset import format_list
from numad_infer.util.printable import printable_lines

# The one-line fix for most of what follows: the tuned profile numa-infer ships
# (packaging/tuned/numa-infer/tuned.conf, installed under /usr/lib/tuned/).
TUNED_FIX = "tuned-adm profile numa-infer"

# Another process using more than this share of one inference CPU over the sample
# competes with an instance's threads for it (decode waits for its slowest thread).
NEIGHBOUR_PERCENT = 5.0

# Programs that move processes or pages between nodes themselves and so fight the
# placement numa-infer keeps: numad, and the Kubernetes NRI resource policies.
NUMA_MANAGERS = ("numad", "nri-resource-policy-topology-aware", "nri-resource-policy-balloons")

# vm.swappiness at or below this keeps the kernel from swapping anonymous memory (the
# weights, the KV cache) while page cache can still be dropped.
MAX_SWAPPINESS = 10


class Level(Enum):
    """A check's verdict; INFO describes the machine and never changes the exit status."""

    OK = "ok"
    INFO = "info"
    WARN = "warn"
    FAIL = "fail"

    @property
    def rank(self) -> int:
        return {Level.OK: 0, Level.INFO: 0, Level.WARN: 1, Level.FAIL: 2}[self]


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    seen: str
    wanted: str
    why: str
    fix: str  # "" when there is nothing to do

    def to_json(self) -> dict[str, str]:
        return {**asdict(self), "level": self.level.value}


@dataclass(frozen=True)
class CpuFreq:
    governor: str | None  # None: no cpufreq driver for this CPU (VMs, some firmware)
    epp: str | None  # energy_performance_preference; None where the driver has none


@dataclass(frozen=True)
class NodeMemory:
    free_bytes: int
    file_bytes: int  # page cache on the node: the kernel can drop it to make room
    instance_bytes: int  # anonymous memory running instances already hold there (theirs to reuse)
    holders: tuple[str, ...] = ()  # the instances holding it, by name


@dataclass(frozen=True)
class Irq:
    number: int
    cpus: frozenset[int]  # effective affinity (or the allowed one where the kernel shows no effective one)
    names: tuple[str, ...]
    count: int  # interrupts since boot: one that never fired disturbs nobody


@dataclass(frozen=True)
class Neighbour:
    pid: int
    name: str
    cpu: int
    percent: float  # of that CPU over the sample


@dataclass(frozen=True)
class Needs:
    """What doctor needs of the plan: where the instances run and what they load."""

    cpus: frozenset[int]  # every inference CPU
    online_cpus: frozenset[int]
    # Per node: what the planned instances bound there hold (weights, KV cache, the engine's
    # overhead: model/memory.py's estimate, summed as the planner sums it).
    need_bytes: dict[int, int]
    model_path: str
    mlock: bool
    engine: str
    per_instance: str = ""  # how one instance's estimate adds up (MemoryEstimate.describe)
    context_keys: str = "model.context_size"  # the keys a fix names: each [[models]] table's own


@dataclass(frozen=True)
class HostFacts:
    numa_balancing: int | None  # None: kernel without automatic NUMA balancing
    thp_enabled: str | None  # the bracketed choice of .../transparent_hugepage/enabled
    thp_defrag: str | None
    cpufreq: dict[int, CpuFreq]  # per inference CPU
    zone_reclaim_mode: int | None
    swap_total_bytes: int
    swappiness: int | None
    nodes: dict[int, NodeMemory]
    irqs: tuple[Irq, ...]
    irqbalance: bool
    neighbours: tuple[Neighbour, ...]
    sample_s: float
    managers: tuple[str, ...]  # NUMA managers seen running, as "name (pid N)"
    cpu_flags: frozenset[str]
    engine_cpu: EngineCpuReport  # Engine.cpu: the kernels it runs, or why it cannot tell
    nodes_per_package: dict[int, tuple[int, ...]]  # package id -> its nodes with CPUs; empty: unknown


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_numa_balancing(f: HostFacts) -> Check:
    name, wanted = "kernel.numa_balancing", "0"
    if f.numa_balancing is None:
        return Check(name, Level.OK, "absent", wanted, "this kernel has no automatic NUMA balancing", "")
    if f.numa_balancing == 0:
        return Check(name, Level.OK, "0", wanted,
                     "the kernel leaves the instances' pages where numa-infer put them", "")
    return Check(name, Level.WARN, str(f.numa_balancing), wanted,
                 "the kernel unmaps pages to sample access and migrates them behind numa-infer's back",
                 f"{TUNED_FIX}, or: sysctl -w kernel.numa_balancing=0 (persist in /etc/sysctl.d/)")


def check_thp(f: HostFacts) -> list[Check]:
    enabled = "transparent_hugepage/enabled"
    if f.thp_enabled is None:
        return [Check(enabled, Level.INFO, "absent", "always", "this kernel has no transparent huge pages", "")]
    # llama.cpp reads the weights into posix_memalign'd memory and never madvises it
    # (ggml.c), so only `always` gives the weights 2 MiB pages: fewer TLB misses while
    # every decode step streams all of them.
    checks = [Check(enabled, Level.OK, f.thp_enabled, "always",
                    "the weights (anonymous memory, never madvised by llama.cpp) get 2 MiB pages", "")
              if f.thp_enabled == "always" else
              Check(enabled, Level.WARN, f.thp_enabled, "always",
                    "llama.cpp never madvises its weights, so they get 4 KiB pages and decode pays TLB misses",
                    f"{TUNED_FIX}, or: echo always > /sys/kernel/mm/transparent_hugepage/enabled")]
    defrag = "transparent_hugepage/defrag"
    if f.thp_defrag is None:
        return checks
    if f.thp_defrag == "never":
        checks.append(Check(defrag, Level.WARN, "never", "madvise, defer+madvise, defer or always",
                            "without compaction a fragmented node hands the weights 4 KiB pages",
                            "echo madvise > /sys/kernel/mm/transparent_hugepage/defrag"))
    else:
        checks.append(Check(defrag, Level.OK, f.thp_defrag, "madvise, defer+madvise, defer or always",
                            "huge pages come from free memory at fault, and khugepaged or kcompactd make more", ""))
    return checks


def check_cpufreq(f: HostFacts, plan: Needs) -> list[Check]:
    cpus = sorted(plan.cpus)
    if not any(c.governor for c in f.cpufreq.values()):
        return [Check("cpu governor", Level.INFO, "no cpufreq", "performance",
                      "no frequency driver on the inference CPUs: the firmware or hypervisor decides", "")]
    slow = sorted(c for c in cpus if (freq := f.cpufreq.get(c)) and freq.governor not in (None, "performance"))
    seen = sorted({f.cpufreq[c].governor or "-" for c in cpus if c in f.cpufreq})
    checks = [Check("cpu governor", Level.OK, ",".join(seen), "performance",
                    "the inference CPUs run at full clock", "")
              if not slow else
              Check("cpu governor", Level.WARN, f"{','.join(seen)} (CPUs {format_list(slow)})", "performance",
                    "a ramping governor slows the prompt phase and the threads' barriers",
                    f"{TUNED_FIX}, or: cpupower -c {format_list(slow)} frequency-set -g performance")]
    with_epp = [c for c in cpus if (freq := f.cpufreq.get(c)) and freq.epp is not None]
    if with_epp:
        lazy = sorted(c for c in with_epp if f.cpufreq[c].epp != "performance")
        epps = sorted({f.cpufreq[c].epp or "-" for c in with_epp})
        checks.append(Check("energy_performance_preference", Level.OK, ",".join(epps), "performance",
                            "the CPUs' own power management favours speed", "")
                      if not lazy else
                      Check("energy_performance_preference", Level.WARN, f"{','.join(epps)} (CPUs {format_list(lazy)})",
                            "performance", "the CPU trades clock for energy on its own",
                            f"{TUNED_FIX}, or: for c in {' '.join(map(str, lazy))}; do echo performance > "
                            "/sys/devices/system/cpu/cpu$c/cpufreq/energy_performance_preference; done"))
    return checks


def check_zone_reclaim(f: HostFacts) -> Check:
    name = "vm.zone_reclaim_mode"
    if f.zone_reclaim_mode in (None, 0):
        return Check(name, Level.OK, str(f.zone_reclaim_mode if f.zone_reclaim_mode is not None else "absent"), "0",
                     "allocations do not stall reclaiming the local node first", "")
    return Check(name, Level.WARN, str(f.zone_reclaim_mode), "0",
                 "allocations stall in reclaim on the local node (and may write pages out) before using memory",
                 f"{TUNED_FIX}, or: sysctl -w vm.zone_reclaim_mode=0")


def check_swap(f: HostFacts, plan: Needs) -> Check:
    name = "swap"
    if f.swap_total_bytes == 0:
        return Check(name, Level.OK, "no swap", f"no swap, or vm.swappiness <= {MAX_SWAPPINESS}",
                     "the weights and the KV cache stay in memory", "")
    seen = f"{_gib(f.swap_total_bytes)} swap, vm.swappiness = {f.swappiness}"
    if f.swappiness is not None and f.swappiness <= MAX_SWAPPINESS:
        return Check(name, Level.OK, seen, f"vm.swappiness <= {MAX_SWAPPINESS}",
                     "the kernel drops page cache before it swaps anonymous memory", "")
    if plan.mlock:
        return Check(name, Level.OK, seen, f"vm.swappiness <= {MAX_SWAPPINESS}",
                     "model.mlock keeps the weights in memory; only the KV cache could be swapped", "")
    return Check(name, Level.WARN, seen, f"vm.swappiness <= {MAX_SWAPPINESS}",
                 "the kernel may swap out weights, and the next token waits on the disk",
                 f"{TUNED_FIX}, or: sysctl -w vm.swappiness={MAX_SWAPPINESS}; or set model.mlock = true")


def check_node_memory(f: HostFacts, plan: Needs) -> list[Check]:
    checks = []
    for node, need in sorted(plan.need_bytes.items()):
        mem = f.nodes.get(node)
        name = f"memory on node {node}"
        if mem is None:
            checks.append(Check(name, Level.WARN, "unknown", f">= {_gib(need)} free",
                                f"the kernel shows no meminfo for node {node}", ""))
            continue
        usable = mem.free_bytes + mem.instance_bytes
        seen = f"{_gib(mem.free_bytes)} free, {_gib(mem.file_bytes)} page cache" + (
            f", {_gib(mem.instance_bytes)} held by {_holders(mem.holders)}" if mem.instance_bytes else "")
        wanted = f">= {_gib(need)} for {plan.model_path}'s instances" + (
            f"; per instance {plan.per_instance}" if plan.per_instance else "")
        if usable >= need:
            checks.append(Check(name, Level.OK, seen, wanted, "the instances fit in the node's free memory", ""))
        elif usable + mem.file_bytes >= need:
            checks.append(Check(name, Level.WARN, seen, wanted,
                                "the instances fit only once the kernel drops page cache; a first load may be slow",
                                "sync; echo 1 > /proc/sys/vm/drop_caches (before starting the instances)"))
        else:
            checks.append(Check(name, Level.FAIL, seen, wanted,
                                "the instances do not fit: one spills to another node or fails to load",
                                "free memory on the node (stop what uses it), use a smaller quantisation or "
                                f"{plan.context_keys}, or plan fewer instances on it (numa-infer plan)"))
    return checks


def _holders(names: tuple[str, ...]) -> str:
    """Who holds a node's memory, by name: `infer@0`, `infer@0 and infer@1`."""
    if not names:
        return "the running instances"
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def check_irqs(f: HostFacts, plan: Needs) -> Check:
    name = "IRQs on inference CPUs"
    hit = sorted((irq for irq in f.irqs if irq.count and irq.cpus & plan.cpus), key=lambda i: (-i.count, i.number))
    running = "irqbalance running" if f.irqbalance else "irqbalance not running"
    wanted = f"none on CPUs {format_list(plan.cpus)}"
    if not hit:
        return Check(name, Level.OK, f"none ({running})", wanted, "interrupts land on the other CPUs", "")
    shown = ", ".join(f"{i.number} {'/'.join(i.names) or '?'}" for i in hit[:5]) + (
        f" and {len(hit) - 5} more" if len(hit) > 5 else "")
    spare = plan.online_cpus - plan.cpus
    seen = f"{len(hit)}: {shown} ({running})"
    if not spare:
        return Check(name, Level.INFO, seen, wanted,
                     "every online CPU is an inference CPU, so interrupts must land on one",
                     "keep a CPU for the OS: [placement] reserve_cpus in the config")
    ban = format_list(plan.cpus)
    fix = (f"IRQBALANCE_BANNED_CPULIST={ban} in /etc/default/irqbalance, then systemctl restart irqbalance"
           if f.irqbalance else
           f"systemctl enable --now irqbalance with IRQBALANCE_BANNED_CPULIST={ban} in /etc/default/irqbalance, "
           f"or: echo {format_list(spare)} > /proc/irq/N/smp_affinity_list for each")
    return Check(name, Level.WARN, seen, wanted,
                 "each interrupt stops an inference thread that the others wait for", fix)


def check_neighbours(f: HostFacts, plan: Needs) -> Check:
    name = "other processes on inference CPUs"
    busy = sorted((n for n in f.neighbours if n.cpu in plan.cpus and n.percent > NEIGHBOUR_PERCENT),
                  key=lambda n: (-n.percent, n.pid))
    wanted = f"none above {NEIGHBOUR_PERCENT:g}% of a CPU over {f.sample_s:g}s"
    if not busy:
        return Check(name, Level.OK, "none", wanted, "the instances have their CPUs to themselves", "")
    shown = ", ".join(f"{n.name} (pid {n.pid}) {n.percent:.0f}% of CPU {n.cpu}" for n in busy[:5])
    pids = " ".join(str(p) for p in sorted({n.pid for n in busy}))
    spare = plan.online_cpus - plan.cpus
    move = (f"taskset -a -c -p {format_list(spare)} PID for {pids}" if spare
            else f"stop or move {pids}; keep a CPU for them with [placement] reserve_cpus")
    return Check(name, Level.WARN, shown, wanted, "they take time slices from the instances' pinned threads", move)


def check_managers(f: HostFacts) -> Check:
    name = "NUMA managers"
    if not f.managers:
        return Check(name, Level.OK, "none", "none", "nothing else moves the instances or their pages", "")
    return Check(name, Level.FAIL, ", ".join(f.managers), "none",
                 "it re-pins processes and migrates pages, fighting numa-infer's placement",
                 "systemctl disable --now numad (or remove the NRI resource policy from this node)")


def check_isa(f: HostFacts, plan: Needs) -> Check:
    """`idle_units`, the verdict `check` warns with too, on the CPU flags doctor read."""
    name = "engine vector ISA"
    offered = offered_units(f.cpu_flags)
    if not offered:
        return Check(name, Level.INFO, "CPU has no AVX2", "-", "nothing wider to use", "")
    wanted = "+".join(sorted(offered))
    cpu = f.engine_cpu.cpu
    if cpu is None:
        return Check(name, Level.WARN, "unknown", wanted, f"cannot tell what {plan.engine} uses: {f.engine_cpu.source}",
                     "")
    idle = idle_units(f.cpu_flags, cpu)
    if not idle:
        return Check(name, Level.OK, cpu.describe(), wanted, f"{plan.engine} uses the CPU's wide units", "")
    return Check(name, Level.WARN, cpu.describe(), wanted,
                 f"{plan.engine} leaves {' and '.join(idle)} idle: prompt processing is slower "
                 "(up to 1.76x on Q4_K_M)",
                 f.engine_cpu.fix)


def check_nodes_per_socket(f: HostFacts) -> Check:
    name = "nodes per socket"
    if not f.nodes_per_package:
        return Check(name, Level.INFO, "unknown", "-", "the kernel shows no physical_package_id", "")
    counts = sorted({len(nodes) for nodes in f.nodes_per_package.values()})
    seen = (f"{len(f.nodes_per_package)} socket(s), "
            f"{'/'.join(map(str, counts))} node(s) per socket")
    if counts == [1]:
        return Check(name, Level.INFO, seen, "-", "one instance per socket", "")
    return Check(name, Level.INFO, seen, "-",
                 "SNC/NPS splits each socket: one instance per node, each with that node's share of bandwidth", "")


def diagnose(facts: HostFacts, plan: Needs) -> list[Check]:
    """Every check, in the order an operator reads the host: kernel, CPUs, memory, neighbours, engine."""
    return [check_numa_balancing(facts), *check_thp(facts), *check_cpufreq(facts, plan), check_zone_reclaim(facts),
            check_swap(facts, plan), *check_node_memory(facts, plan), check_irqs(facts, plan),
            check_neighbours(facts, plan), check_managers(facts), check_isa(facts, plan),
            check_nodes_per_socket(facts)]


def worst(checks: list[Check]) -> Level:
    return max((c.level for c in checks), key=lambda level: level.rank, default=Level.OK)


def exit_status(checks: list[Check]) -> int:
    """0: nothing to do (ok and info only), 1: a warning, 2: a failure."""
    return worst(checks).rank


def format_checks(checks: list[Check]) -> str:
    """Each check as the operator reads it, every line escaped: `seen` holds what the host
    (or a tree under --fsroot) says, process names and file contents among it."""
    lines = []
    for c in checks:
        lines.append(f"[{c.level.value.upper():>4}] {c.name}: {c.seen} (wanted {c.wanted})")
        lines.append(f"       {c.why}")
        if c.fix:
            lines.append(f"       fix: {c.fix}")
    counts = {level: sum(c.level == level for c in checks) for level in Level}
    lines.append(", ".join(f"{n} {level.value}" for level, n in counts.items()))
    return printable_lines(lines)
