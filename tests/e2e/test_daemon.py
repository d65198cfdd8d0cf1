"""The daemon on this host: process backend, real servers of both engines on a tiny model.

The topology is a fake 2-node sysfs (tests/daemon_harness.py) because these CI hosts
have one node and two CPUs; processes, pinning, probes, signals and the notify socket
are all real.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.daemon_harness import ENGINES, daemons, generated_model


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return generated_model("tiny")


@pytest.fixture(params=ENGINES)
def daemon(request: pytest.FixtureRequest, tmp_path: Path, tiny_model: Path):
    """Every test here runs once per engine: the supervision must not care which."""
    with daemons(tmp_path, tiny_model) as start:
        yield functools.partial(start, engine=request.param)


def allowed_cpus(pid: int) -> list[set[int]]:
    masks = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            masks.append(os.sched_getaffinity(int(tid)))
        except ProcessLookupError:
            pass
    return masks


def completion(port: int) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "hello", "max_tokens": 4}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def test_start_brings_up_pinned_healthy_instances_and_notifies(daemon) -> None:
    run = daemon()
    started = time.monotonic()
    state = run.all_healthy(2)
    print(f"start to all healthy: {time.monotonic() - started:.1f}s")
    assert "READY=1" in run.notify.fields()
    run.wait(lambda s: "STATUS=2/2 instances healthy" in run.notify.fields(), 5, "STATUS= on the notify socket")
    for inst, cpu in (("infer@0", 0), ("infer@1", 1)):
        info = run.instance(state, inst)
        assert info["cpus"] == [cpu] and info["threads"] == 1 and info["mems"] == [0]
        assert all(mask == {cpu} for mask in allowed_cpus(info["pid"]))
        environ = open(f"/proc/{info['pid']}/environ", "rb").read().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in environ and f"OMP_PLACES={{{cpu}}}".encode() in environ
        assert not any(e.startswith(b"NOTIFY_SOCKET=") for e in environ)
        if os.geteuid() == 0:
            # A root daemon drops its servers to server.user (default numa-infer, which the
            # package makes; nobody where this host lacks it), groups and all.
            import pwd
            try:
                user = pwd.getpwnam("numa-infer")
            except KeyError:
                user = pwd.getpwnam("nobody")
            server = psutil.Process(info["pid"])
            assert set(server.uids()) == {user.pw_uid} and set(server.gids()) == {user.pw_gid}, server.uids()
            assert open(f"/proc/{info['pid']}/status").read().split("Groups:")[1].split("\n")[0].strip() == ""
            assert b"HOME=/nonexistent" in environ or any(e.startswith(b"HOME=/") for e in environ)
        assert completion(info["port"])["choices"][0]["text"] is not None
    status = run.cli("status", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    for shown in json.loads(status.stdout)["instances"]:
        # What status says, checked against the processes themselves, not the state file.
        argv = psutil.Process(shown["pid"]).cmdline()
        assert argv[argv.index("--port") + 1] == str(shown["port"]) and shown["state"] == "healthy", argv
        # The CPU kernels the engine runs: the wheel's portable AVX2 build.
        assert "AVX2" in shown["cpu_backend"], shown["cpu_backend"]
    run.wait(lambda s: all(i["local_memory_fraction"] is not None for i in s["instances"]), 10, "memory reading")
    text = run.cli("status")
    assert "2/2 instances healthy" in text.stdout and "infer@1" in text.stdout


def test_killed_instance_comes_back_and_is_counted(daemon) -> None:
    run = daemon()
    state = run.all_healthy(2)
    old = run.instance(state, "infer@1")["pid"]
    killed = time.monotonic()
    os.kill(old, signal.SIGKILL)
    state = run.wait(lambda s: (i := run.instance(s, "infer@1"))["state"] == "healthy" and i["pid"] not in (None, old)
                     and i["restarts"] == 1, 60, "infer@1 back")
    print(f"kill -9 to healthy again: {time.monotonic() - killed:.1f}s")
    assert run.instance(state, "infer@0")["restarts"] == 0


def test_stopped_instance_is_found_unhealthy_and_restarted(daemon) -> None:
    run = daemon()
    state = run.all_healthy(2)
    old = run.instance(state, "infer@0")["pid"]
    os.kill(old, signal.SIGSTOP)
    stopped = time.monotonic()
    run.wait(lambda s: run.instance(s, "infer@0")["state"] == "unhealthy", 20, "infer@0 unhealthy")
    print(f"SIGSTOP to detection: {time.monotonic() - stopped:.1f}s")
    state = run.wait(lambda s: (i := run.instance(s, "infer@0"))["state"] == "healthy" and i["pid"] != old, 60, "restart")
    print(f"SIGSTOP to healthy again: {time.monotonic() - stopped:.1f}s")
    assert run.instance(state, "infer@0")["last_repair"]["kind"] == "health"
    assert not os.path.exists(f"/proc/{old}") or open(f"/proc/{old}/stat").read().split()[2] == "Z"


def test_thread_moved_by_another_process_is_repinned_within_two_intervals(daemon) -> None:
    run = daemon()
    state = run.all_healthy(2)
    pid = run.instance(state, "infer@1")["pid"]
    tid = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))[-1]
    moved = time.monotonic()
    subprocess.run(["taskset", "-p", "-c", "0", str(tid)], check=True, capture_output=True)
    deadline = moved + 2 * 0.5 + 1.0  # two intervals, plus slack for this shared 2-CPU machine
    while os.sched_getaffinity(tid) != {1}:
        assert time.monotonic() < deadline, f"thread {tid} still on {os.sched_getaffinity(tid)}"
        time.sleep(0.02)
    print(f"affinity drift to re-pinned: {time.monotonic() - moved:.2f}s")
    state = run.wait(lambda s: (run.instance(s, "infer@1")["last_repair"] or {}).get("kind") == "affinity", 5, "repair")
    assert f"{tid}->1" in run.instance(state, "infer@1")["last_repair"]["detail"]
    assert "affinity drift" in run.logs()


def test_reload_applies_only_the_difference(daemon) -> None:
    run = daemon()
    state = run.all_healthy(2)
    pid0 = run.instance(state, "infer@0")["pid"]
    run.write_config(placement="nodes = [0]")
    result = run.cli("reload")
    assert result.returncode == 0 and "removed infer@1" in result.stdout, result.stderr
    state = run.state()
    assert [i["name"] for i in state["instances"]] == ["infer@0"] and run.instance(state, "infer@0")["pid"] == pid0
    assert any(f == "RELOADING=1" for f in run.notify.fields())
    run.write_config(placement="nodes = [0, 1]")
    assert "added infer@1" in run.cli("reload").stdout
    state = run.all_healthy(2)
    assert run.instance(state, "infer@0")["pid"] == pid0


def test_invalid_reload_keeps_the_old_plan_and_says_why(daemon) -> None:
    run = daemon()
    state = run.all_healthy(2)
    pids = [i["pid"] for i in state["instances"]]
    run.write_config(placement='reserve_cpus = "0-1"')
    result = run.cli("reload")
    assert result.returncode == 1 and "placement.reserve_cpus" in result.stderr and str(run.config) in result.stderr
    state = run.state()
    assert [i["pid"] for i in state["instances"]] == pids
    assert state["daemon"]["last_reload"]["ok"] is False and "reserves every CPU of every node" in state["daemon"]["last_reload"]["error"]
    assert any("config error" in f and "placement.reserve_cpus" in f for f in run.notify.fields() if f.startswith("STATUS="))
    assert "reload failed, still running the previous configuration" in run.logs()
    run.write_config()
    assert run.cli("reload").returncode == 0
    assert [i["pid"] for i in run.all_healthy(2)["instances"]] == pids


def test_sigterm_stops_everything_and_notifies(daemon) -> None:
    run = daemon(env={"WATCHDOG_USEC": "1000000"})
    state = run.all_healthy(2)
    pids = [i["pid"] for i in state["instances"]]
    # At WATCHDOG_USEC = 1 s, pings are due every 0.5 s.
    run.wait(lambda s: run.notify.fields().count("WATCHDOG=1") >= 2, 10, "two watchdog pings")
    assert run.stop() == 0
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)
    fields = run.notify.fields()
    assert "STOPPING=1" in fields and fields.count("WATCHDOG=1") >= 2
    assert run.cli("status").returncode == 3


def test_invalid_config_at_start_exits_nonzero_with_status(daemon) -> None:
    run = daemon(placement="nodes = [3]")
    assert run.proc.wait(30) == 1
    assert "placement.nodes = [3]: node 3 does not exist" in run.logs()
    assert any(f.startswith("STATUS=configuration error") for f in run.notify.fields())
    assert run.state() is None


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def test_metrics_follow_what_happened(daemon) -> None:
    port = 19464 + os.getpid() % 500
    run = daemon(extra_config=f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    state = run.all_healthy(2)
    before = scrape(port)
    assert before['numa_infer_instance_healthy{model="",node="1",server="infer@1"}'] == 1.0
    assert before['numa_infer_instance_restarts_total{model="",node="1",server="infer@1"}'] == 0.0
    assert before["numa_infer_pass_duration_seconds"] > 0
    # Which CPU kernels each instance's engine runs, as an info metric.
    assert [k for k in before if k.startswith('numa_infer_instance_cpu_backend_info{') and 'server="infer@1"' in k
            and "AVX2" in k and before[k] == 1.0], sorted(before)[:5]
    os.kill(run.instance(state, "infer@1")["pid"], signal.SIGKILL)
    run.wait(lambda s: run.instance(s, "infer@1")["restarts"] == 1 and run.instance(s, "infer@1")["state"] == "healthy",
             60, "restart")
    after = scrape(port)
    assert after['numa_infer_instance_restarts_total{model="",node="1",server="infer@1"}'] == 1.0
    assert after['numa_infer_instance_restarts_total{model="",node="0",server="infer@0"}'] == 0.0
    assert after['numa_infer_repairs_total{kind="health",model="",node="1",server="infer@1"}'] == 1.0
    assert after['numa_infer_local_memory_fraction{model="",node="0",server="infer@0"}'] == 1.0


def test_cpu_going_offline_changes_the_plan(daemon) -> None:
    run = daemon()
    state = run.all_healthy(2)
    pid0 = run.instance(state, "infer@0")["pid"]
    # Hot-unplug CPU 1 in the (fake) sysfs the daemon reads: node 1 is left without CPUs.
    cpu = run.fsroot / "sys/devices/system/cpu"
    (cpu / "cpu1/online").write_text("0\n")
    (cpu / "online").write_text("0\n")
    state = run.wait(lambda s: [i["name"] for i in s["instances"]] == ["infer@0"], 20, "re-plan without node 1")
    assert run.instance(state, "infer@0")["pid"] == pid0
    assert state["daemon"]["last_reload"]["why"] == "cpu hotplug"
    assert "CPUs changed: offline 1" in run.logs()


def test_an_api_key_guards_the_instances_and_the_probe_still_passes(daemon, tmp_path: Path) -> None:
    from numad_infer.supervision.health import KeyCheck, check_key

    key = tmp_path / "api-key"
    key.write_text("k-123\n")
    key.chmod(0o600)
    run = daemon()
    before = {i["name"]: i["pid"] for i in run.all_healthy(2)["instances"]}
    run.server_extra = f'api_key_file = "{key}"'
    run.write_config()
    reload = run.cli("reload")
    assert reload.returncode == 0 and "changed infer@0, infer@1" in reload.stdout, reload  # a new key restarts them
    state = run.wait(lambda s: all(i["state"] == "healthy" and i["pid"] not in (None, before[i["name"]])
                                   for i in s["instances"]), 60, "healthy with the key")
    port = run.instance(state, "infer@0")["port"]
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    for target in (port, run.frontend_port):
        plain = urllib.request.Request(f"http://127.0.0.1:{target}/v1/completions", data=body, method="POST",
                                       headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(plain, timeout=30)
        assert refused.value.code == 401
        keyed = urllib.request.Request(f"http://127.0.0.1:{target}/v1/completions", data=body, method="POST",
                                       headers={"Content-Type": "application/json", "Authorization": "Bearer k-123"})
        with urllib.request.urlopen(keyed, timeout=30) as response:
            assert json.load(response)["usage"]["completion_tokens"] == 2
    assert check_key("127.0.0.1", port, "k-123", 2, "/v1/models") == KeyCheck.ACCEPTED
    # What the daemon sees when an instance runs with another key than the file's.
    assert check_key("127.0.0.1", port, "wrong", 2, "/v1/models") == KeyCheck.REJECTED
    # Three more monitoring passes, each with its probe and key check: still no restart.
    since = time.time()
    state = run.wait(lambda s: s["daemon"]["updated_at"] > since + 3 * run.interval_s, 30, "three more passes")
    assert all(i["state"] == "healthy" and i["error"] is None for i in state["instances"]), state
    assert "k-123" not in (run.state_file.read_text() + run.config.read_text().replace(str(key), ""))
    with open(f"/proc/{run.instance(state, 'infer@0')['pid']}/cmdline", "rb") as cmdline:
        assert b"k-123" not in cmdline.read()


CPUSET_V1 = Path("/sys/fs/cgroup/cpuset")


@pytest.fixture
def cpuset_group():
    """A real cgroup v1 cpuset holding CPUs 0-1 (what a container or pod gets), removed
    after the daemon that ran in it is gone."""
    if os.geteuid() != 0 or not (CPUSET_V1 / "cpuset.cpus").exists() or os.sched_getaffinity(0) != {0, 1}:
        pytest.skip("needs root, a cgroup v1 cpuset hierarchy and CPUs 0-1")
    group = CPUSET_V1 / f"numa-infer-daemon-{os.getpid()}"
    group.mkdir()
    (group / "cpuset.cpus").write_text("0-1")
    (group / "cpuset.mems").write_text("0")
    yield group
    for pid in (group / "tasks").read_text().split():  # anything left goes back to the root cpuset
        try:
            (CPUSET_V1 / "tasks").write_text(pid)
        except OSError:
            pass
    group.rmdir()


def test_a_narrowed_cpuset_is_a_new_plan_and_the_untouched_instance_keeps_its_pid(cpuset_group, daemon) -> None:
    """`podman update --cpuset-cpus=1`, a kubelet or NRI plugin moving the pod: the daemon
    re-plans within the new set, drains and removes the instance that lost its CPU, keeps
    the other one (same PID), and calls it a new plan, not drift to fight."""
    run = daemon(cgroup=cpuset_group)
    before = run.all_healthy(2)
    kept = run.instance(before, "infer@1")["pid"]
    (cpuset_group / "cpuset.cpus").write_text("1")
    state = run.wait(lambda s: [i["name"] for i in s["instances"]] == ["infer@1"]
                     and s["daemon"]["last_reload"]["why"] == "allowed set change", 60, "the new plan")
    assert run.instance(state, "infer@1")["pid"] == kept and run.instance(state, "infer@1")["state"] == "healthy"
    assert state["daemon"]["last_reload"]["removed"] == ["infer@0"] and not state["daemon"]["last_reload"]["changed"]
    assert "left out: CPUs 0" in state["daemon"]["allowed"]
    assert run.instance(state, "infer@1")["drift_events"].get("affinity", 0) == 0
    assert "a new plan (not drift)" in run.logs()
    status = run.cli("status")
    assert "allowed: CPUs 1" in status.stdout and "infer@0" not in status.stdout, status.stdout


def test_health_says_live_and_ready_for_probes_and_3_once_the_daemon_is_gone(daemon) -> None:
    run = daemon()
    run.all_healthy(2)
    # Ready is "in rotation": HAProxy's own health check puts a server UP a moment after
    # the daemon finds it healthy.
    run.wait(lambda s: all(i["rotation"] == "UP" for i in s["instances"]), 30, "both instances in rotation")
    live, ready = run.cli("health", "--live"), run.cli("health", "--ready")
    assert live.returncode == 0 and live.stdout.startswith("live: last pass"), live
    # Ready needs one instance in rotation (on a loaded host HAProxy may be counting a
    # failed check of the other one).
    assert ready.returncode == 0 and ready.stdout.startswith("ready: ") and "/2 instance(s) in rotation" in ready.stdout
    assert not ready.stdout.startswith("ready: 0/"), ready
    run.stop()
    gone = run.cli("health", "--ready")
    assert gone.returncode == 3 and "not running" in gone.stdout


def test_health_verdicts_from_a_status() -> None:
    import dataclasses

    from numad_infer.lifecycle.states import State
    from numad_infer.status.records import DaemonState, DaemonStatus, FrontdoorStatus, InstanceStatus, Status

    now = 1000.0
    inst = InstanceStatus(name="infer@0", node=0, cpus=(0,), mems=(0,), threads=1, port=1, pid=2, state=State.HEALTHY,
                          rotation="UP")
    status = Status(DaemonStatus(DaemonState.RUNNING, "c", updated_at=now - 2, interval_s=5), (inst,),
                    FrontdoorStatus("127.0.0.1:8000", True, 0, 0, None))
    assert status.live(now) and status.ready
    stale = dataclasses.replace(status, daemon=dataclasses.replace(status.daemon, updated_at=now - 16))
    assert not stale.live(now)
    drained = dataclasses.replace(status, instances=(dataclasses.replace(inst, rotation="MAINT"),))
    assert not drained.ready
    for seen, ready in (("UP 1/2", True), ("DOWN 1/2", False), ("DRAIN", False)):
        assert dataclasses.replace(status, instances=(dataclasses.replace(inst, rotation=seen),)).ready is ready
    no_front = dataclasses.replace(status, frontdoor=None, instances=(dataclasses.replace(inst, rotation=None),))
    assert no_front.ready
