"""Planning within what the instances' cgroup allows (a container's --cpuset-cpus, a
Guaranteed pod's CPUs, a slice's AllowedCPUs=, a CPU quota), the reader of those sets,
and a real cpuset cgroup on this host.

The 2-socket machine is a fake sysfs tree (what cannot run here); the cgroup at the end
is real (cgroup v1 cpuset on these hosts; v2 files are faked where needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.errors import ConfigError
from numad_infer.plan.placement import make_plan
from numad_infer.topology.cgroup_limits import Allowed, left_out, within
from numad_infer.topology.cgroups import CgroupReader
from numad_infer.topology.sysfs import read_topology
from tests import fakesys
from tests.fakes import served_of

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory):
    return read_topology(fakesys.write_tree(tmp_path_factory.mktemp("fs"), fakesys.dual_socket_smt()))


def cfg(placement: str = ""):
    return parse_config(f'[model]\npath = "/m.gguf"\n[placement]\n{placement}', "/etc/numa-infer.toml")


def test_only_allowed_cpus_are_planned_and_a_node_without_any_hosts_no_instance(machine) -> None:
    # A container given CPUs 4-7 of node 0 (siblings 68-71 not included).
    conf = cfg()
    plan = make_plan(conf, machine, allowed=Allowed(frozenset(range(4, 8)), None, source="the container"),
                     served=served_of(conf))
    (only,) = plan.instances
    assert only.node == 0 and only.cpus == (4, 5, 6, 7) and only.threads == 4
    assert any("node 1: none of its CPUs is allowed to the instances" in w for w in plan.warnings), plan.warnings


def test_a_node_named_in_the_config_with_no_allowed_cpu_is_refused_by_key(machine) -> None:
    with pytest.raises(ConfigError, match=r"placement.nodes = \[0, 1\]: node 1: none of its CPUs is allowed"):
        conf = cfg("nodes = [0, 1]\n")
        make_plan(conf, machine, allowed=Allowed(frozenset(range(0, 8)), None), served=served_of(conf))


def test_a_core_with_only_some_siblings_allowed_counts_only_those(machine) -> None:
    # smt = true: core (4, 68) is whole, core (5, 69) has only 5 allowed.
    conf = cfg("smt = true\n")
    plan = make_plan(conf, machine, allowed=Allowed(frozenset({4, 68, 5}), None), served=served_of(conf))
    (only,) = plan.instances
    assert only.cpus == (4, 5, 68) and only.places == ((4, 68), (5,)) and only.threads == 3


def test_allowed_cpus_whose_memory_is_not_allowed_bind_to_the_nearest_allowed_node(machine) -> None:
    conf = cfg()
    plan = make_plan(conf, machine, allowed=Allowed(frozenset({32, 33}), frozenset({0})), served=served_of(conf))
    (only,) = plan.instances
    assert only.node == 1 and only.mems == (0,)
    assert any("node 1's memory is not allowed to the instances" in w and "node(s) 0" in w for w in plan.warnings)


def test_a_cpu_quota_caps_auto_threads_across_the_instances(machine) -> None:
    conf = cfg()
    plan = make_plan(conf, machine, allowed=Allowed(None, None, quota_cpus=5.5, source="cpu.max"),
                     served=served_of(conf))
    assert [i.threads for i in plan.instances] == [3, 2] and [i.threads_batch for i in plan.instances] == [3, 2]
    assert len(plan.instances[0].cpus) == 32  # the CPUs stay: the quota is time, not CPUs
    assert any("CPU quota of 5.5 (cpu.max) caps the threads at 5" in w and "Guaranteed pod" in w
               for w in plan.warnings)


def test_an_explicit_thread_count_above_the_quota_is_a_warning_naming_it(machine) -> None:
    conf = cfg("threads = 8\n")
    plan = make_plan(conf, machine, allowed=Allowed(None, None, quota_cpus=4.0, source="cpu.max"),
                     served=served_of(conf))
    assert [i.threads for i in plan.instances] == [8, 8]
    assert any("placement.threads = 8 x 2 instance(s) is 16 threads, more than the CPU quota of 4" in w
               and "--cpuset-cpus" in w for w in plan.warnings)


def test_within_keeps_node_ids_and_says_what_is_left_out(machine) -> None:
    allowed = Allowed(frozenset({1, 65}), frozenset({1}))
    view = within(machine, allowed)
    assert [n.id for n in view.nodes] == [0, 1] and view.nodes[0].cores == ((1, 65),) and not view.nodes[1].cpus
    assert not view.nodes[0].has_memory and view.nodes[1].has_memory
    assert left_out(machine, allowed) == machine.online_cpus - {1, 65}


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_reader_takes_the_process_sets_and_the_tightest_quota_up_the_tree(tmp_path: Path) -> None:
    _write(tmp_path, "proc/self/status", "Name:\tx\nCpus_allowed_list:\t2-3,6\nMems_allowed_list:\t0\n")
    _write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n")
    _write(tmp_path, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n")
    _write(tmp_path, "sys/fs/cgroup/kubepods/pod1/cpu.max", "250000 100000\n")  # the pod's limit: 2.5 CPUs
    _write(tmp_path, "sys/fs/cgroup/kubepods/cpu.max", "800000 100000\n")
    got = CgroupReader(str(tmp_path)).for_process()
    assert got.cpus == {2, 3, 6} and got.mems == {0} and got.quota_cpus == 2.5 and got.thread_budget == 2


def test_the_reader_understands_cgroup_v1_quota_and_a_slice(tmp_path: Path) -> None:
    _write(tmp_path, "proc/self/status", "Cpus_allowed_list:\t0-7\nMems_allowed_list:\t0-1\n")
    _write(tmp_path, "proc/self/cgroup", "4:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    assert CgroupReader(str(tmp_path)).for_process().quota_cpus == 1.5
    _write(tmp_path, "sys/fs/cgroup/system.slice/cpuset.cpus.effective", "4-7\n")
    _write(tmp_path, "sys/fs/cgroup/system.slice/cpuset.mems.effective", "1\n")
    got = CgroupReader(str(tmp_path)).for_slice()
    assert got.cpus == {4, 5, 6, 7} and got.mems == {1} and got.quota_cpus is None and got.source == "system.slice"


CPUSET_V1 = Path("/sys/fs/cgroup/cpuset")


@pytest.mark.skipif(os.geteuid() != 0 or not (CPUSET_V1 / "cpuset.cpus").exists() or len(os.sched_getaffinity(0)) < 2,
                    reason="needs root, a cgroup v1 cpuset hierarchy and 2 CPUs")
def test_plan_inside_a_real_cpuset_cgroup_uses_only_its_cpu(tmp_path: Path) -> None:
    """What `--cpuset-cpus=1` gives a container: the planner, run inside such a cgroup on
    this host, plans one thread on that CPU (sysfs still shows every CPU)."""
    cpu = max(os.sched_getaffinity(0))
    group = CPUSET_V1 / f"numa-infer-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpuset.cpus").write_text(str(cpu))
        (group / "cpuset.mems").write_text((CPUSET_V1 / "cpuset.mems").read_text().split(",")[0].split("-")[0])
        model = tmp_path / "m.gguf"
        model.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(1016))  # version 3, no tensors, no metadata
        config = tmp_path / "numa-infer.toml"
        config.write_text(f'[model]\npath = "{model}"\n[server]\nengine = "llama-cpp-python"\nuser = "root"\n[frontend]\nlisten = ""\n')
        command = (f"echo $$ > {group}/tasks && exec {sys.executable} -m numad_infer --backend process "
                   f"--config {config} plan --json")
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert done.returncode == 0, done.stderr
        plan = json.loads(done.stdout)
        assert [(i["cpus"], i["threads"]) for i in plan["instances"]] == [([cpu], 1)]
        assert plan["allowed"]["cpus"] == [cpu] and plan["allowed"]["source"] == "the daemon's cgroup"
    finally:
        group.rmdir()


def test_an_instance_whose_cpuset_narrowed_under_it_is_drift_told_once_and_status_shows_only_what_it_can_use(
        tmp_path: Path, machine) -> None:
    from numad_infer.config.schema import MonitorSection
    from numad_infer.host.procfs import ProcReader
    from numad_infer.lifecycle.drift import EventKind
    from numad_infer.supervision.drift_checks import AllowedSetCheck, CheckContext, HostPinner
    from numad_infer.supervision.instance import Runtime

    conf = cfg()
    instance = make_plan(conf, machine, allowed=Allowed(frozenset({0, 1}), None), served=served_of(conf)).instances[0]
    assert instance.cpus == (0, 1)
    _write(tmp_path, "proc/42/cpuset", "/kubepods/pod1\n")
    effective = "sys/fs/cgroup/cpuset/kubepods/pod1/cpuset.effective_cpus"
    _write(tmp_path, effective, "0-1\n")
    runtime = Runtime(instance)
    runtime.new_process(42)
    check = runtime.checks[EventKind.ALLOWED]
    assert isinstance(check, AllowedSetCheck)
    check.reader = CgroupReader(str(tmp_path))
    ctx = CheckContext(instance, 42, 0.0, lambda: 1000.0, MonitorSection(), ProcReader(str(tmp_path)), False, runtime,
                       HostPinner())
    assert not check.run(ctx) and runtime.runnable_cpus == (0, 1) and runtime.last_drift is None
    _write(tmp_path, effective, "1\n")  # the kubelet (or an NRI plugin) moved CPU 0 away
    assert check.run(ctx) and check.run(ctx)
    assert runtime.runnable_cpus == (1,) and runtime.drift_counts == {"allowed": 1}
    assert runtime.last_drift is not None and "allows only CPUs 1 of the planned 0-1" in runtime.last_drift.detail


def test_a_quota_smaller_than_the_instances_keeps_as_many_instances_as_it_holds_threads(machine) -> None:
    # `--cpus=1` on a two-node machine: two instances of one thread each would take turns
    # on one CPU's time; one instance with one thread is what the quota holds.
    conf = cfg()
    plan = make_plan(conf, machine, allowed=Allowed(None, None, quota_cpus=1.0, source="cpu.max"),
                     served=served_of(conf))
    assert [i.threads for i in plan.instances] == [1]
    assert plan.instances[0].name == "infer@0"
    assert any("CPU quota of 1 (cpu.max) holds 1 thread(s): 1 instance(s) of 2 planned, infer@1" in w
               and "--cpuset-cpus" in w for w in plan.warnings), plan.warnings
