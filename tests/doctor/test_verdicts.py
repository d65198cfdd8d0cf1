"""`numa-infer doctor`: each check on fake /sys and /proc trees (the real reader pointed
at them with --fsroot), for each verdict it can give, and the command as an operator runs it.

Fakes: the trees stand in for a 2-socket server with cpufreq and IRQs that this VM does
not have; `llama-server` is a shell script printing the backend log of a build with ggml's
CPU variants (and `python` one printing a single-backend build's system-info line), because
a build with AVX-512 or AMX cannot run on this CPU. The noisy-neighbour sampler is a real
busy process on this host's own /proc in one test, and injected in the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from numad_infer.doctor.host_facts import HostReader
from numad_infer.doctor.pipeline import checkup
from numad_infer.doctor.verdicts import Level, Needs, Neighbour, check_neighbours
from numad_infer.host.identity import BackendKind
from numad_infer.validate.pipeline import load
from tests.daemon_harness import wait_for
from tests.doctor.hosts import doctor, fake_process, GOOD_FLAGS, Mutate, put, run_cli, setup


def test_a_good_host_passes_every_check(tmp_path: Path) -> None:
    checks = doctor(tmp_path)
    assert {name: c.level for name, c in checks.items() if c.level not in (Level.OK, Level.INFO)} == {}
    assert checks["IRQs on inference CPUs"].seen.startswith("none (irqbalance running)")
    assert checks["nodes per socket"].seen == "2 socket(s), 1 node(s) per socket"


def test_numa_balancing_on_warns_and_names_the_tuned_profile(tmp_path: Path) -> None:
    check = doctor(tmp_path, lambda r: put(r, "proc/sys/kernel/numa_balancing", "1"))["kernel.numa_balancing"]
    assert (check.level, check.seen, check.wanted) == (Level.WARN, "1", "0")
    assert check.fix.startswith("tuned-adm profile numa-infer")


def test_numa_balancing_absent_is_ok(tmp_path: Path) -> None:
    check = doctor(tmp_path, lambda r: (r / "proc/sys/kernel/numa_balancing").unlink())["kernel.numa_balancing"]
    assert (check.level, check.seen) == (Level.OK, "absent")


@pytest.mark.parametrize("enabled, level", [("always [madvise] never", Level.WARN),
                                            ("always madvise [never]", Level.WARN),
                                            ("[always] madvise never", Level.OK)])
def test_thp_enabled_wants_always(tmp_path: Path, enabled: str, level: Level) -> None:
    check = doctor(tmp_path, lambda r: put(r, "sys/kernel/mm/transparent_hugepage/enabled", enabled))[
        "transparent_hugepage/enabled"]
    assert check.level == level
    assert check.seen == enabled[enabled.index("[") + 1:enabled.index("]")]


def test_thp_absent_is_info(tmp_path: Path) -> None:
    check = doctor(tmp_path, lambda r: (r / "sys/kernel/mm/transparent_hugepage/enabled").unlink())[
        "transparent_hugepage/enabled"]
    assert check.level == Level.INFO


@pytest.mark.parametrize("defrag, level", [("always defer defer+madvise madvise [never]", Level.WARN),
                                           ("always defer [defer+madvise] madvise never", Level.OK)])
def test_thp_defrag_never_warns(tmp_path: Path, defrag: str, level: Level) -> None:
    check = doctor(tmp_path, lambda r: put(r, "sys/kernel/mm/transparent_hugepage/defrag", defrag))[
        "transparent_hugepage/defrag"]
    assert check.level == level


def test_powersave_governor_on_one_inference_cpu_warns_naming_it(tmp_path: Path) -> None:
    checks = doctor(tmp_path, lambda r: put(r, "sys/devices/system/cpu/cpu5/cpufreq/scaling_governor", "powersave"))
    check = checks["cpu governor"]
    assert check.level == Level.WARN
    assert "CPUs 5)" in check.seen and "cpupower -c 5 " in check.fix


def test_governor_of_a_cpu_the_plan_leaves_out_does_not_matter(tmp_path: Path) -> None:
    # CPU 64 is CPU 0's SMT sibling: smt = false plans only the first thread of each core.
    checks = doctor(tmp_path, lambda r: put(r, "sys/devices/system/cpu/cpu64/cpufreq/scaling_governor", "powersave"))
    assert checks["cpu governor"].level == Level.OK


def test_no_cpufreq_is_info(tmp_path: Path) -> None:
    def strip(root: Path) -> None:
        for cpu in range(128):
            for name in ("scaling_governor", "energy_performance_preference"):
                (root / f"sys/devices/system/cpu/cpu{cpu}/cpufreq/{name}").unlink()

    checks = doctor(tmp_path, strip)
    assert checks["cpu governor"].level == Level.INFO
    assert "energy_performance_preference" not in checks


def test_balance_power_epp_warns(tmp_path: Path) -> None:
    checks = doctor(tmp_path, lambda r: put(
        r, "sys/devices/system/cpu/cpu40/cpufreq/energy_performance_preference", "balance_power"))
    check = checks["energy_performance_preference"]
    assert check.level == Level.WARN and "CPUs 40)" in check.seen


def test_zone_reclaim_on_warns(tmp_path: Path) -> None:
    check = doctor(tmp_path, lambda r: put(r, "proc/sys/vm/zone_reclaim_mode", "1"))["vm.zone_reclaim_mode"]
    assert (check.level, check.seen) == (Level.WARN, "1")


def _swap(swappiness: str) -> Mutate:
    def mutate(root: Path) -> None:
        put(root, "proc/meminfo", "MemTotal: 536870912 kB\nSwapTotal: 8388608 kB\nSwapFree: 8388608 kB")
        put(root, "proc/sys/vm/swappiness", swappiness)
    return mutate


def test_swap_with_default_swappiness_warns(tmp_path: Path) -> None:
    check = doctor(tmp_path, _swap("60"))["swap"]
    assert check.level == Level.WARN and check.seen == "8.0 GiB swap, vm.swappiness = 60"


def test_swap_with_low_swappiness_is_ok(tmp_path: Path) -> None:
    assert doctor(tmp_path, _swap("10"))["swap"].level == Level.OK


def test_swap_with_mlocked_weights_is_ok(tmp_path: Path) -> None:
    check = doctor(tmp_path, _swap("60"), model_extra="mlock = true\n")["swap"]
    assert check.level == Level.OK and "model.mlock" in check.why


@pytest.mark.parametrize("free_kb, file_kb, level", [(0, 0, Level.FAIL), (0, 27 << 10, Level.FAIL),
                                                     (0, 29 << 10, Level.WARN), (29 << 10, 0, Level.OK)])
def test_node_memory_against_the_instances_estimate(tmp_path: Path, free_kb: int, file_kb: int, level: Level) -> None:
    # The model is 32 bytes with no dimensions in its header: an instance holds llama-server's
    # own overhead (28 MiB) and the model's weights (none), which the file's size no longer stands for.
    checks = doctor(tmp_path, lambda r: put(r, "sys/devices/system/node/node1/meminfo",
                                            f"Node 1 MemTotal: 268435456 kB\nNode 1 MemFree: {free_kb} kB\n"
                                            f"Node 1 FilePages: {file_kb} kB"))
    assert checks["memory on node 1"].level == level
    assert checks["memory on node 0"].level == Level.OK
    assert checks["memory on node 1"].wanted.startswith(">= 28.0 MiB for ")
    assert checks["memory on node 1"].wanted.endswith("; per instance weights 0 MiB + overhead 28 MiB = 28 MiB, KV cache "
                                                      "not counted: no attention shape in the header, and a prompt "
                                                      "cache of up to 8.0 GiB with use")


def _irq_on(cpu: str, count: int = 5000, effective: bool = True) -> Mutate:
    def mutate(root: Path) -> None:
        if effective:
            put(root, "proc/irq/30/effective_affinity_list", cpu)
        else:
            (root / "proc/irq/30/effective_affinity_list").unlink()
            put(root, "proc/irq/30/smp_affinity_list", cpu)
        put(root, "proc/interrupts", f"           CPU0\n  30:   {count}   PCI-MSI eth0-rx-0\n")
    return mutate


def test_irq_on_an_inference_cpu_warns_with_the_banned_list(tmp_path: Path) -> None:
    check = doctor(tmp_path, _irq_on("3"))["IRQs on inference CPUs"]
    assert check.level == Level.WARN
    assert check.seen == "1: 30 eth0-rx-0 (irqbalance running)"
    assert "IRQBALANCE_BANNED_CPULIST=0-63" in check.fix


def test_irq_affinity_falls_back_to_smp_affinity_list(tmp_path: Path) -> None:
    assert doctor(tmp_path, _irq_on("3", effective=False))["IRQs on inference CPUs"].level == Level.WARN


def test_irq_that_never_fired_is_ignored(tmp_path: Path) -> None:
    assert doctor(tmp_path, _irq_on("3", count=0))["IRQs on inference CPUs"].level == Level.OK


def test_irqs_with_every_cpu_an_inference_cpu_is_info(tmp_path: Path) -> None:
    check = doctor(tmp_path, _irq_on("3"), extra="[placement]\nsmt = true\n")["IRQs on inference CPUs"]
    assert check.level == Level.INFO and "reserve_cpus" in check.fix


def test_irq_without_irqbalance_says_so(tmp_path: Path) -> None:
    def mutate(root: Path) -> None:
        _irq_on("3")(root)
        for name in ("comm", "cmdline"):
            (root / f"proc/700/{name}").unlink()

    check = doctor(tmp_path, mutate)["IRQs on inference CPUs"]
    assert check.level == Level.WARN and "irqbalance not running" in check.seen


def test_busy_neighbour_on_an_inference_cpu_warns(tmp_path: Path) -> None:
    checks = doctor(tmp_path, neighbours=(Neighbour(4242, "backup", 7, 80.0), Neighbour(4243, "cron", 8, 1.0),
                                          Neighbour(4244, "on-a-sibling", 70, 99.0)))
    check = checks["other processes on inference CPUs"]
    assert check.level == Level.WARN
    assert check.seen == "backup (pid 4242) 80% of CPU 7"
    assert check.fix.startswith("taskset -a -c -p 64-127 PID for 4242")


def test_real_busy_process_is_seen_on_its_cpu() -> None:
    """This host's own /proc: a pinned busy loop shows up as a neighbour of its CPU."""
    busy = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"])
    try:
        wait_for(lambda: os.sched_getaffinity(busy.pid) == {0}, "the busy loop pinned to CPU 0", timeout_s=10)
        samples: list[tuple[Neighbour, ...]] = []

        def seen_busy() -> bool:
            samples.append(tuple(HostReader("/").sampler(frozenset({os.getpid()}))(0.5)))
            mine = [n for n in samples[-1] if n.pid == busy.pid]
            return [n.cpu for n in mine] == [0] and mine[0].percent > 20

        # On a loaded machine one half-second may give the loop less than its share: sampled
        # again until it shows (a loop that is not busy, or not on CPU 0, never does).
        wait_for(seen_busy, "the busy loop seen on CPU 0 above 20%", timeout_s=15,
                 detail=lambda: repr([n for n in samples[-1] if n.pid == busy.pid]))
        seen = samples[-1]
        plan = Needs(frozenset({0}), frozenset({0, 1}), {}, "m", False, "llama-server")
        facts_level = check_neighbours(_facts_with(seen), plan).level
        assert facts_level == Level.WARN
        other = Needs(frozenset({1}), frozenset({0, 1}), {}, "m", False, "llama-server")
        assert busy.pid not in {n.pid for n in seen if n.cpu == 1 and n.percent > 5}
        assert check_neighbours(_facts_with(tuple(n for n in seen if n.pid == busy.pid)), other).level == Level.OK
    finally:
        busy.kill()
        busy.wait()


def _facts_with(neighbours: tuple[Neighbour, ...]):
    from numad_infer.doctor.verdicts import HostFacts
    from numad_infer.host.cpufeatures import EngineCpuReport

    return HostFacts(0, "always", "madvise", {}, 0, 0, 10, {}, (), False, neighbours, 0.5, (), frozenset(),
                     EngineCpuReport(None, "", ""), {})


@pytest.mark.parametrize("argv", [["/usr/sbin/numad", "-i", "15"],
                                  ["/usr/bin/nri-resource-policy-topology-aware", "--config-namespace", "x"]])
def test_numa_manager_running_fails(tmp_path: Path, argv: list[str]) -> None:
    check = doctor(tmp_path, lambda r: fake_process(r, 900, argv))["NUMA managers"]
    assert check.level == Level.FAIL and f"{Path(argv[0]).name} (pid 900)" == check.seen


@pytest.mark.parametrize("flags, variant, level, seen", [
    (GOOD_FLAGS, "skylakex", Level.OK, "skylakex (AVX2+AVX512)"),
    (GOOD_FLAGS, "haswell", Level.WARN, "haswell (AVX2)"),
    (GOOD_FLAGS + " amx_tile amx_int8", "skylakex", Level.WARN, "skylakex (AVX2+AVX512)"),
    (GOOD_FLAGS + " amx_tile amx_int8", "sapphirerapids", Level.OK,
     "sapphirerapids (AMX_INT8+AVX2+AVX512+AVX512_BF16+AVX512_VNNI)"),
    ("fpu sse2 avx avx2", "haswell", Level.OK, "haswell (AVX2)"),
    ("fpu sse2 avx avx2", "sse42", Level.WARN, "sse42 (no AVX2)"),
    (GOOD_FLAGS, None, Level.WARN, "unknown"),
])
def test_engine_isa_against_the_cpu(tmp_path: Path, flags: str, variant: str | None, level: Level, seen: str) -> None:
    check = doctor(tmp_path, lambda r: put(r, "proc/cpuinfo", f"flags\t\t: {flags}"), variant=variant)[
        "engine vector ISA"]
    assert (check.level, check.seen) == (level, seen), check
    if variant is None:  # the engine's own reason, as Engine.cpu gave it
        assert "named no libggml-cpu variant" in check.why
    elif level == Level.WARN:
        assert "scripts/build-llama-server" in check.fix


def test_engine_isa_of_a_single_backend_build_comes_from_its_system_info(tmp_path: Path) -> None:
    """llama-cpp-python: its libggml-cpu.so says what it was compiled for (system_info's
    words); an AVX2 build on a CPU with AVX-512 leaves that idle, and the fix is a rebuild."""
    config, root = setup(tmp_path, lambda r: put(r, "proc/cpuinfo", f"flags\t\t: {GOOD_FLAGS}"))
    python = tmp_path / "home" / "python"
    python.write_text("#!/bin/sh\necho 'CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 0 | AMX_INT8 = 0 | '\n")
    python.chmod(0o755)
    text = config.read_text()
    server = text[text.index("[server]"):text.index("[tuning]")]
    config.write_text(text.replace(server, f'[server]\nengine = "llama-cpp-python"\npython = "{python}"\n'))
    loaded = load(str(config), BackendKind.PROCESS, str(root))
    check = {c.name: c for c in checkup(loaded, root, None, 0.0, sampler=lambda seconds: ())}["engine vector ISA"]
    assert (check.level, check.seen, check.wanted) == (Level.WARN, "AVX2", "AVX2+AVX512"), check
    assert "leaves AVX512 idle" in check.why and "GGML_NATIVE" in check.fix


def test_nodes_per_socket_reports_sub_numa_clustering(tmp_path: Path) -> None:
    def one_socket(root: Path) -> None:
        for cpu in range(128):
            put(root, f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id", "0")

    check = doctor(tmp_path, one_socket)["nodes per socket"]
    assert (check.level, check.seen) == (Level.INFO, "1 socket(s), 2 node(s) per socket")
    assert "SNC/NPS" in check.why


@pytest.mark.parametrize("mutate, code, worst", [
    (None, 0, "ok"),
    (lambda r: put(r, "proc/sys/kernel/numa_balancing", "1"), 1, "warn"),
    (lambda r: fake_process(r, 900, ["/usr/sbin/numad"]), 2, "fail"),
])
def test_cli_json_and_exit_status_follow_the_worst(tmp_path: Path, mutate: Mutate | None, code: int, worst: str) -> None:
    config, root = setup(tmp_path, mutate)
    proc = run_cli(config, root, "--json")
    assert proc.returncode == code, proc.stderr
    data = json.loads(proc.stdout)
    assert data["worst"] == worst
    names = {c["name"] for c in data["checks"]}
    assert {"kernel.numa_balancing", "transparent_hugepage/enabled", "cpu governor", "vm.zone_reclaim_mode", "swap",
            "memory on node 0", "memory on node 1", "IRQs on inference CPUs", "other processes on inference CPUs",
            "NUMA managers", "engine vector ISA", "nodes per socket"} <= names
    assert all(set(c) == {"name", "level", "seen", "wanted", "why", "fix"} for c in data["checks"])


def test_cli_text_names_the_fix(tmp_path: Path) -> None:
    config, root = setup(tmp_path, lambda r: put(r, "proc/sys/kernel/numa_balancing", "1"))
    proc = run_cli(config, root)
    assert proc.returncode == 1
    assert "[WARN] kernel.numa_balancing: 1 (wanted 0)" in proc.stdout
    assert "fix: tuned-adm profile numa-infer" in proc.stdout


def test_a_running_instance_is_no_neighbour_and_its_memory_counts_as_its_own(tmp_path: Path) -> None:
    """This host's own /proc and /sys: a process standing in for a running instance (busy on
    CPU 0, 64 MiB of anonymous memory touched) is left out of the neighbours, and its
    memory is added back to what its node has for it."""
    from numad_infer.doctor.pipeline import read_facts
    from numad_infer.lifecycle.states import State
    from numad_infer.status.records import DaemonState, DaemonStatus, InstanceStatus, Status

    config, _ = setup(tmp_path)
    loaded = load(str(config), BackendKind.PROCESS, "/")
    instance = busy = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; os.sched_setaffinity(0, {0}); b = bytearray(64 << 20)\n"
                               "for i in range(0, len(b), 4096): b[i] = 1\nprint(flush=True)\nwhile True: pass"],
        stdout=subprocess.PIPE)
    try:
        assert busy.stdout is not None and busy.stdout.readline() == b"\n"
        status = Status(DaemonStatus(DaemonState.RUNNING, str(config), pid=None),
                        tuple(InstanceStatus.planned(i, instance.pid, State.HEALTHY) for i in loaded.plan.instances[:1]))
        facts, plan = read_facts(loaded, "/", status, 0.5)
        assert instance.pid not in {n.pid for n in facts.neighbours}
        node = loaded.plan.instances[0].mems[0]
        assert facts.nodes[node].instance_bytes >= 64 << 20
        # Without the status it is someone else's process: a neighbour on CPU 0.
        facts, _ = read_facts(loaded, "/", None, 0.5)
        assert [n.cpu for n in facts.neighbours if n.pid == instance.pid] == [0]
        assert facts.nodes[node].instance_bytes == 0
    finally:
        busy.kill()
        busy.wait()


def test_the_memory_running_instances_hold_on_a_node_names_each_of_them(tmp_path: Path) -> None:
    """Before: "64.0 MiB held by its instance", for a node whose memory two instances hold.
    Now each is named; this host's own /proc: two processes standing in for two instances."""
    import dataclasses

    from numad_infer.doctor.pipeline import read_facts
    from numad_infer.doctor.verdicts import NodeMemory, check_node_memory
    from numad_infer.lifecycle.states import State
    from numad_infer.status.records import DaemonState, DaemonStatus, InstanceStatus, Status

    config, _ = setup(tmp_path)
    loaded = load(str(config), BackendKind.PROCESS, "/")
    code = "b = bytearray(16 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint(flush=True)\nimport time; time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == b"\n"
        first = InstanceStatus.planned(loaded.plan.instances[0], procs[0].pid, State.HEALTHY)
        status = Status(DaemonStatus(DaemonState.RUNNING, str(config), pid=None),
                        (first, dataclasses.replace(first, name="infer@9", pid=procs[1].pid)))
        facts, plan = read_facts(loaded, "/", status, 0.1)
        node = loaded.plan.instances[0].mems[0]
        assert facts.nodes[node].holders == ("infer@0", "infer@9")
        (check,) = [c for c in check_node_memory(facts, plan) if c.name == f"memory on node {node}"]
        assert "held by infer@0 and infer@9" in check.seen and "its instance" not in check.seen
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    one = dataclasses.replace(facts, nodes={node: NodeMemory(1 << 40, 0, 1 << 30, ("infer@3",))})
    (check,) = [c for c in check_node_memory(one, plan) if c.name == f"memory on node {node}"]
    assert check.seen.endswith(", 1.0 GiB held by infer@3")
