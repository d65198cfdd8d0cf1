"""The reconcile loop over fakes (tests/fakes.py): supervision, drains, restarts one at a time,
holds, and which instances a reload touches. The loop's real processes: tests/e2e/."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from numad_infer.backends.base import Observation
from numad_infer.config.schema import MonitorSection
from numad_infer.frontdoor.haproxy import AdminState
from numad_infer.host.proc_types import NodeUsage
from numad_infer.lifecycle.drift import EventKind
from numad_infer.lifecycle.states import RestartDecision, State, Supervision
from numad_infer.plan.placement import make_plan
from numad_infer.supervision.health import ProbeResult
from numad_infer.supervision.reconcile import Reconciler
from tests.fakes import FakeFrontdoor, FakeProc, RecordingBackend, answering_probe, cfg, loaded_for, three_nodes

MON = MonitorSection(startup_grace_s=10, unhealthy_after=3, max_restarts=3, restart_window_s=100, restart_backoff_s=2)


def test_failed_probes_in_grace_period_do_not_count() -> None:
    sup = Supervision()
    sup.on_started(0.0)
    assert not any(sup.on_probe(False, t, MON) for t in (1, 2, 3, 4, 5))
    assert sup.state == State.STARTING and sup.failures == 0


def test_restart_after_consecutive_failures_then_backoff_then_failed() -> None:
    sup = Supervision()
    sup.on_started(0.0)
    assert sup.on_probe(True, 1, MON) is False and sup.state == State.HEALTHY
    assert [sup.on_probe(False, t, MON) for t in (20, 21, 22)] == [False, False, True]
    assert sup.restart_decision(22, MON) == RestartDecision.RESTART
    sup.on_restart(22, MON)
    assert sup.restart_decision(23, MON) == RestartDecision.WAIT  # backoff 2 s
    assert sup.restart_decision(24, MON) == RestartDecision.RESTART
    sup.on_restart(24, MON)
    assert sup.restart_decision(27, MON) == RestartDecision.WAIT  # backoff doubled: 4 s
    sup.on_restart(28, MON)
    assert sup.restart_decision(100, MON) == RestartDecision.FAIL  # 3 restarts within the window
    assert sup.restart_decision(200, MON) == RestartDecision.RESTART  # the window moved on


def test_reload_restarts_only_the_instance_whose_port_changed() -> None:
    backend = RecordingBackend()
    rec = Reconciler(backend)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    backend.calls.clear()
    pids = dict(backend.running)
    # Dropping node 1 moves infer@2 from port 8082 to 8081; infer@0 stays as it was.
    new = cfg("[placement]\nnodes = [0, 2]")
    result = rec.apply(loaded_for(new, make_plan(new, three_nodes())), 1.0)
    assert (result.changed, result.removed, result.unchanged) == (("infer@2",), ("infer@1",), ("infer@0",))
    assert backend.calls == [("stop", "infer@1"), ("restart", "infer@2")]
    assert backend.running["infer@0"] == pids["infer@0"]


def test_adoption_keeps_running_instances_whose_definition_is_unchanged() -> None:
    backend = RecordingBackend(running={"infer@0": 42})
    backend.current_specs = lambda config: {"infer@0": repr(make_plan(cfg(), three_nodes()).instances[0])}
    rec = Reconciler(backend)
    result = rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    assert result.unchanged == ("infer@0",) and result.added == ("infer@1", "infer@2")
    assert ("restart", "infer@0") not in backend.calls and backend.running["infer@0"] == 42
    assert rec.runtimes["infer@0"].pid == 42


def test_unknown_instance_states_never_cause_a_restart() -> None:
    backend = RecordingBackend()
    rec = Reconciler(backend)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    backend.calls.clear()

    def broken(names):
        raise RuntimeError("systemctl show failed")

    backend.observe = broken
    rec.monitor(1.0)
    assert backend.calls == []


def test_a_changed_instance_is_drained_out_of_the_front_door_before_its_restart() -> None:
    backend, front = RecordingBackend(), FakeFrontdoor()
    rec = Reconciler(backend, FakeProc(), frontdoor=front, probe=answering_probe)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    rec.monitor(0.5)
    front.states.clear()
    backend.calls.clear()
    front.in_flight_by["infer@2"] = 2
    new = cfg("[placement]\nnodes = [0, 2]")
    rec.apply(loaded_for(new, make_plan(new, three_nodes())), 1.0)
    # Two requests still run on infer@2: no restart yet, only taken out of rotation. infer@1,
    # no longer planned, goes at the next pass, once its requests are answered.
    assert backend.calls == []
    assert front.states == [("infer@2", AdminState.DRAIN)]
    assert rec.runtimes["infer@2"].supervision.state == State.DRAINING
    rec.monitor(2.0)
    assert ("stop", "infer@1") in backend.calls
    assert ("restart", "infer@2") not in backend.calls
    front.in_flight_by["infer@2"] = 0
    rec.monitor(3.0)
    assert backend.calls[-1] == ("restart", "infer@2")
    assert ("infer@2", AdminState.MAINT) in front.states
    assert rec.runtimes["infer@2"].supervision.state == State.RESTARTING
    assert rec.runtimes["infer@2"].supervision.restarts == 0  # a definition change is no repair


def test_the_drain_is_bounded_by_drain_timeout_s() -> None:
    backend, front = RecordingBackend(), FakeFrontdoor()
    rec = Reconciler(backend, FakeProc(), frontdoor=front, probe=answering_probe)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    rec.monitor(0.5)
    front.in_flight_by["infer@2"] = 1
    new = cfg("[placement]\nnodes = [0, 2]\n[frontend]\ndrain_timeout_s = 10")
    rec.apply(loaded_for(new, make_plan(new, three_nodes())), 1.0)
    rec.monitor(10.9)
    assert ("restart", "infer@2") not in backend.calls
    rec.monitor(11.0)
    assert backend.calls[-1] == ("restart", "infer@2")


def test_an_unhealthy_instance_that_makes_no_progress_is_restarted_without_waiting() -> None:
    # SIGSTOPped or wedged: it will never finish its request, so draining would only wait.
    backend, front, proc = RecordingBackend(), FakeFrontdoor(), FakeProc()
    rec = Reconciler(backend, proc, frontdoor=front)
    config = cfg("[monitor]\nunhealthy_after = 1\nstartup_grace_s = 0\nprobe_timeout_s = 0.2")
    rec.apply(loaded_for(config, make_plan(config, three_nodes())), 0.0)
    backend.calls.clear()
    pid = backend.running["infer@0"]
    proc.cpu[pid] = 5.0
    front.in_flight_by["infer@0"] = 1
    rec.monitor(1.0)  # nothing listens on the ports: every probe fails
    proc.cpu[pid] = 5.0  # and no CPU used since
    rec.monitor(2.0)
    assert ("restart", "infer@0") in backend.calls
    assert rec.runtimes["infer@0"].supervision.restarts >= 1


def test_behind_the_front_door_changed_instances_restart_one_at_a_time() -> None:
    # A reload that changes every instance must leave some in rotation at every moment.
    backend, front = RecordingBackend(), FakeFrontdoor()
    rec = Reconciler(backend, FakeProc(), frontdoor=front, probe=answering_probe)
    backend.specs = lambda loaded: {i.name: repr(i) + repr(loaded.config.server.extra_args)  # type: ignore[method-assign]
                                    for i in loaded.plan.instances}
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    rec.monitor(0.5)
    backend.calls.clear()
    new = cfg('[server]\nextra_args = ["--n_batch", "64"]')
    rec.apply(loaded_for(new, make_plan(new, three_nodes())), 1.0)
    assert backend.calls == [("restart", "infer@0")]
    rec.monitor(2.0)  # infer@0 answers: healthy again, so the next one goes
    assert backend.calls == [("restart", "infer@0"), ("restart", "infer@1")]
    rec.monitor(3.0)
    assert backend.calls == [("restart", "infer@0"), ("restart", "infer@1"), ("restart", "infer@2")]
    rec.monitor(4.0)
    assert all(rt.supervision.state == State.HEALTHY for rt in rec.runtimes.values())


# -- one lifecycle: what happens to an instance's process is its state, not side flags -------------

def lifecycle(rec: Reconciler, name: str = "infer@0") -> tuple[State, int]:
    sup = rec.runtimes[name].supervision
    return sup.state, sup.restarts


def test_a_crash_goes_exited_restarting_starting_and_the_next_one_backs_off() -> None:
    backend = RecordingBackend()
    rec = Reconciler(backend, FakeProc(), probe=answering_probe)
    rec.apply(loaded_for(cfg("[monitor]\nrestart_backoff_s = 5"), make_plan(cfg(), three_nodes())), 0.0)
    rec.monitor(1.0)
    assert lifecycle(rec) == (State.HEALTHY, 0)
    backend.calls.clear()
    first = backend.running.pop("infer@0")  # the process dies; this backend does not bring it back
    rec.monitor(2.0)
    # Gone, then restarted at once (the first restart in the window waits for nothing).
    assert backend.calls == [("restart", "infer@0")] and lifecycle(rec) == (State.RESTARTING, 1)
    assert rec.runtimes["infer@0"].last_drift.detail == f"main process {first} is gone"
    rec.monitor(3.0)
    # The new PID is the restart's result: not counted again as a crash.
    assert lifecycle(rec) == (State.HEALTHY, 1)
    backend.running.pop("infer@0")
    rec.monitor(4.0)  # the second restart waits restart_backoff_s after the first (t = 2 + 5)
    assert lifecycle(rec) == (State.BACKOFF, 1) and backend.calls == [("restart", "infer@0")]
    rec.monitor(6.9)
    assert lifecycle(rec) == (State.BACKOFF, 1)
    rec.monitor(7.0)
    assert lifecycle(rec) == (State.RESTARTING, 2) and backend.calls[-1] == ("restart", "infer@0")


def test_a_process_the_service_manager_replaced_counts_as_a_crash_and_is_not_restarted_again() -> None:
    backend = RecordingBackend()
    rec = Reconciler(backend, FakeProc(), probe=answering_probe)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    rec.monitor(1.0)
    backend.calls.clear()
    old = backend.running["infer@1"]
    backend.running["infer@1"] = 999  # systemd's Restart= brought it back between two passes
    rec.monitor(2.0)
    assert backend.calls == [] and lifecycle(rec, "infer@1") == (State.HEALTHY, 1)
    assert rec.runtimes["infer@1"].last_drift.detail == f"main process {old} replaced by 999"
    assert lifecycle(rec, "infer@0") == (State.HEALTHY, 0)


def test_while_restarting_the_old_process_is_not_probed_and_its_exit_is_not_a_crash() -> None:
    # systemctl restart --no-block: the old PID stays a while, then goes, then the new one comes.
    answer = [True]

    def probe(host: str, port: int, timeout: float, path: str) -> ProbeResult:
        return ProbeResult(answer[0], 0.0, "refused")
    backend = RecordingBackend()
    later: dict[str, int] = {}
    backend.restart = lambda instance: (backend.calls.append(("restart", instance.name)),
                                        later.__setitem__(instance.name, 555))
    # Between the old process and the new one the unit is "activating": pending, as systemd says.
    backend.observe = lambda names: {n: Observation(backend.running.get(n), n in later and n not in backend.running,
                                                    "activating") for n in names}
    rec = Reconciler(backend, FakeProc(), probe=probe)
    config = cfg("[monitor]\nunhealthy_after = 1\nstartup_grace_s = 30")
    rec.apply(loaded_for(config, make_plan(config, three_nodes())), 0.0)
    rec.monitor(0.5)
    assert lifecycle(rec) == (State.HEALTHY, 0)
    answer[0] = False  # from now on every probe fails
    rec.monitor(1.0)
    assert lifecycle(rec) == (State.RESTARTING, 1)
    rec.monitor(2.0)  # same old PID, probe refused: part of the restart, not a new failure
    assert lifecycle(rec) == (State.RESTARTING, 1) and backend.calls.count(("restart", "infer@0")) == 1
    backend.running.pop("infer@0")
    rec.monitor(3.0)  # the old one is gone: the restart's doing, no drift event
    assert lifecycle(rec) == (State.RESTARTING, 1)
    assert rec.runtimes["infer@0"].last_drift is None
    backend.running["infer@0"] = later["infer@0"]
    rec.monitor(4.0)
    assert lifecycle(rec) == (State.STARTING, 1) and rec.runtimes["infer@0"].pid == 555


def test_a_rollout_stops_at_an_instance_that_does_not_come_up_on_the_new_definition(caplog) -> None:
    # A bad extra_args: the first instance restarted on it never answers. The others must
    # keep serving on the old definition, not follow it down.
    backend, front = RecordingBackend(), FakeFrontdoor()
    broken: set[int] = set()
    rec = Reconciler(backend, FakeProc(), frontdoor=front,
                     probe=lambda host, port, timeout, path: ProbeResult(port not in broken, 0.0, "refused"))
    backend.specs = lambda loaded: {i.name: repr(i) + repr(loaded.config.server.extra_args)  # type: ignore[method-assign]
                                    for i in loaded.plan.instances}
    base = "[monitor]\nstartup_grace_s = 0\nunhealthy_after = 1\nrestart_backoff_s = 1\n"
    rec.apply(loaded_for(cfg(base), make_plan(cfg(base), three_nodes())), 0.0)
    rec.monitor(0.5)
    backend.calls.clear()
    new = cfg(base + '[server]\nextra_args = ["--bogus"]')
    broken.add(8080)  # infer@0, once restarted on the new definition, never answers
    rec.apply(loaded_for(new, make_plan(new, three_nodes())), 1.0)
    for t in range(2, 30):
        rec.monitor(float(t))
    restarted = {name for call, name in backend.calls if call == "restart"}
    assert restarted == {"infer@0"}, backend.calls
    assert "rolling restart stopped: infer@0 not healthy on the new definition" in caplog.text
    assert rec.runtimes["infer@1"].supervision.state == State.HEALTHY
    broken.clear()  # a reload that fixes it: the rollout goes on
    fixed = cfg(base + '[server]\nextra_args = ["--good"]')
    rec.apply(loaded_for(fixed, make_plan(fixed, three_nodes())), 40.0)
    for t in range(41, 50):
        rec.monitor(float(t))
    assert {name for call, name in backend.calls if call == "restart"} == {"infer@0", "infer@1", "infer@2"}


def test_remote_anonymous_memory_is_migrated_back_to_the_instance_nodes(monkeypatch) -> None:
    # A fake /proc/PID/numa_maps with most anonymous pages on the wrong node (this CI host
    # has one node, where memory is always local), and migrate_pages recorded, not called.
    from numad_infer.host import pinning

    backend, proc = RecordingBackend(), FakeProc()
    usage: dict[int, NodeUsage] = {}
    proc.numa_maps = lambda pid: usage.get(pid, NodeUsage(anon={0: 200 << 20, 2: 800 << 20}, file={1: 50 << 20},
                                                          source="numa_maps"))
    moved: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

    def migrate(pid: int, from_nodes, to_nodes) -> int:
        moved.append((pid, tuple(from_nodes), tuple(to_nodes)))
        usage[pid] = NodeUsage(anon={0: 990 << 20, 2: 10 << 20}, file={1: 50 << 20}, source="numa_maps")
        return 0

    monkeypatch.setattr(pinning, "migrate_pages", migrate)
    rec = Reconciler(backend, proc, probe=answering_probe)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    rec.monitor(1.0)
    pid0 = backend.running["infer@0"]
    # Every instance read 20 % local: each is moved back from node 2 (and 0) to its own node.
    assert (pid0, (2,), (0,)) in moved
    rt = rec.runtimes["infer@0"]
    assert rt.last_drift.kind == "memory" and "20.0% of 1000 MiB" in rt.last_drift.detail
    assert rt.repair_counts == {"memory": 1}
    rec.monitor(2.0)  # the reading after the migration says what moved
    assert rt.memory.local_fraction == 0.99
    assert rt.last_repair.detail.startswith("migrate_pages moved 790.0 MiB back to node(s) 0; now 99.0% local")
    assert [m for m in moved if m[0] == pid0] == [(pid0, (2,), (0,))]  # once: the page cache on node 1 stays
    assert (backend.running["infer@1"], (0, 2), (1,)) in moved


def test_memory_drift_under_a_profile_that_refuses_migrate_pages_is_reported_not_retried(
        monkeypatch, caplog) -> None:
    # podman's and Kubernetes' default seccomp profiles refuse migrate_pages (tests/host/test_pinning_under_seccomp.py
    # shows the probe with a real filter): the drift is shown, no call is made, and the log
    # says why, rather than an ERROR for a call that can only fail again.
    from numad_infer.host import pinning

    backend, proc = RecordingBackend(), FakeProc()
    proc.numa_maps = lambda pid: NodeUsage(anon={0: 200 << 20, 2: 800 << 20}, source="numa_maps")
    monkeypatch.setattr(pinning, "memory_calls", lambda: pinning.MemoryCalls(None, "Operation not permitted"))
    monkeypatch.setattr(pinning, "migrate_pages", lambda *a: pytest.fail("migrate_pages called"))
    rec = Reconciler(backend, proc, probe=answering_probe)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    with caplog.at_level("WARNING"):
        rec.monitor(1.0)
    rt = rec.runtimes["infer@0"]
    assert rt.memory is not None and rt.memory.drifted and rt.last_drift.kind == "memory"
    assert not rt.repair_counts
    assert "not repaired: migrate_pages is refused here: Operation not permitted" in caplog.text


def test_interleaved_instances_are_never_migrated(monkeypatch) -> None:
    from numad_infer.host import pinning

    backend, proc = RecordingBackend(), FakeProc()
    proc.numa_maps = lambda pid: NodeUsage(anon={0: 1 << 20, 1: 1 << 20, 2: 1 << 20}, source="numa_maps")
    monkeypatch.setattr(pinning, "migrate_pages", lambda *a: pytest.fail("migrate_pages called"))
    config = cfg('[placement]\nmode = "interleave"')
    rec = Reconciler(backend, proc, probe=answering_probe)
    rec.apply(loaded_for(config, make_plan(config, three_nodes())), 0.0)
    rec.monitor(1.0)
    (rt,) = rec.runtimes.values()
    assert rt.memory is not None and not rt.memory.drifted


def test_a_hold_drains_then_stops_the_instance_and_its_release_starts_it_again() -> None:
    backend, front, proc = RecordingBackend(), FakeFrontdoor(), FakeProc()
    rec = Reconciler(backend, proc, frontdoor=front, probe=answering_probe)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    rec.monitor(0.5)
    backend.calls.clear()
    pid = backend.running["infer@1"]
    proc.cpu[pid] = 1.0
    front.in_flight_by["infer@1"] = 2
    rec.holds = {"infer@1": "numa-infer tune (pid 4242)"}
    rec.monitor(1.0)
    assert lifecycle(rec, "infer@1")[0] == State.DRAINING and ("infer@1", AdminState.DRAIN) in front.states
    assert backend.calls == []  # its requests finish first
    front.in_flight_by["infer@1"] = 0
    rec.monitor(2.0)
    assert backend.calls == [("stop", "infer@1")] and lifecycle(rec, "infer@1") == (State.HELD, 0)
    assert rec.runtimes["infer@1"].supervision.last_error == "held by numa-infer tune (pid 4242)"
    for t in (3.0, 4.0, 5.0):  # held: never restarted, never counted, out of rotation
        rec.monitor(t)
    assert backend.calls == [("stop", "infer@1")]
    assert [state for name, state in front.states[-3:] if name == "infer@1"] == [AdminState.MAINT]
    assert lifecycle(rec, "infer@0") == (State.HEALTHY, 0)  # the other nodes serve throughout
    # A reload meanwhile does not start it either.
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 5.5)
    assert "infer@1" not in backend.running
    rec.holds = {}
    rec.monitor(6.0)
    assert backend.calls[-1] == ("start", "infer@1") and lifecycle(rec, "infer@1") == (State.STARTING, 0)
    rec.monitor(7.0)
    assert lifecycle(rec, "infer@1") == (State.HEALTHY, 0)


def test_a_hold_whose_holder_died_is_dropped(tmp_path) -> None:
    import os
    import subprocess

    from numad_infer.supervision import holds

    mine = holds.acquire(tmp_path, "infer@0", "test")
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / "infer@1.hold").write_text(f'{{"pid": {gone.pid}, "started": 0, "by": "x", "since": 0}}')
    (tmp_path / "infer@2.hold").write_text("not json")
    found = holds.active(tmp_path)
    assert set(found) == {"infer@0"} and found["infer@0"].pid == os.getpid()
    assert not (tmp_path / "infer@1.hold").exists()
    holds.release(mine)
    assert holds.active(tmp_path) == {}


# -- the split: drift checks registered once, per process; monitor says what it found -------------

def test_every_drift_check_kind_is_registered_once_and_a_new_process_gets_fresh_ones() -> None:
    from numad_infer.supervision.drift_checks import CHECKS, MemoryCheck
    from numad_infer.supervision.reconcile import Runtime

    kinds = [check.kind for check in CHECKS]
    assert len(kinds) == len(set(kinds))
    rt = Runtime(make_plan(cfg(), three_nodes()).instances[0], pid=10)
    assert set(rt.checks) == set(kinds)
    memory = rt.checks[EventKind.MEMORY]
    assert isinstance(memory, MemoryCheck)
    memory.checked_at = 99.0
    rt.new_process(11)
    assert rt.checks[EventKind.MEMORY] is not memory and rt.checks[EventKind.MEMORY].checked_at == 0.0


def test_every_drift_check_runs_even_when_an_earlier_one_drifts() -> None:
    from numad_infer.supervision.drift_checks import DriftCheck, run_checks

    ran: list[EventKind] = []

    class Drifts(DriftCheck):
        kind = EventKind.AFFINITY

        def run(self, ctx) -> bool:
            ran.append(self.kind)
            return True

    class Clean(DriftCheck):
        kind = EventKind.MEMORY

        def run(self, ctx) -> bool:
            ran.append(self.kind)
            return False

    assert run_checks({EventKind.AFFINITY: Drifts(), EventKind.MEMORY: Clean()}, None) is True  # type: ignore[arg-type]
    assert ran == [EventKind.AFFINITY, EventKind.MEMORY]


def test_a_probe_that_answers_while_requests_stall_for_30s_counts_as_failed() -> None:
    from numad_infer.supervision.supervisor import STALL_AFTER_S, judge_probe

    answered = ProbeResult(True, 0.002)
    assert judge_probe(answered, None, 100.0) is answered
    assert judge_probe(answered, 100.0 - STALL_AFTER_S + 1, 100.0).ok
    stalled = judge_probe(answered, 100.0 - STALL_AFTER_S, 100.0)
    assert not stalled.ok and stalled.error == "stalled: requests in flight and no CPU used for 30s"


def test_monitor_returns_each_instance_state_and_nothing_when_states_cannot_be_read() -> None:
    backend = RecordingBackend()
    rec = Reconciler(backend, FakeProc(), probe=answering_probe)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    assert rec.monitor(1.0) == {"infer@0": State.HEALTHY, "infer@1": State.HEALTHY, "infer@2": State.HEALTHY}

    def broken(names):
        raise RuntimeError("systemctl show failed")

    backend.observe = broken
    assert rec.monitor(2.0) == {}


def test_a_crash_is_logged_as_transitions_once_each(caplog) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="numad_infer.lifecycle.states")
    backend = RecordingBackend()
    rec = Reconciler(backend, FakeProc(), probe=answering_probe)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    rec.monitor(1.0)
    caplog.clear()
    backend.running.pop("infer@0")
    rec.monitor(2.0)
    moves = [r.getMessage() for r in caplog.records if r.name == "numad_infer.lifecycle.states"]
    assert moves == ["infer@0: healthy -> exited (main process gone)",
                     "infer@0: exited -> restarting (not running (inactive))"]


def test_an_instance_no_longer_planned_finishes_its_requests_before_it_stops() -> None:
    # Before: a reload that dropped a node stopped its instance at once, and the requests it
    # was answering through the front door failed.
    backend, front, proc = RecordingBackend(), FakeFrontdoor(), FakeProc()
    rec = Reconciler(backend, proc, frontdoor=front, probe=answering_probe)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    rec.monitor(0.5)
    backend.calls.clear()
    leaving = rec.runtimes["infer@2"].instance.port
    proc.connections = {leaving: 2}
    new = cfg("[placement]\nnodes = [0, 1]")
    rec.apply(loaded_for(new, make_plan(new, three_nodes())), 1.0)
    assert "infer@2" not in rec.runtimes and backend.calls == []
    rec.monitor(2.0)
    assert ("stop", "infer@2") not in backend.calls  # two clients still wait for their answers
    proc.connections = {leaving: 0}
    rec.monitor(3.0)
    assert backend.calls.count(("stop", "infer@2")) == 1
    rec.monitor(4.0)
    assert backend.calls.count(("stop", "infer@2")) == 1


def test_an_instance_no_longer_planned_is_stopped_after_the_drain_timeout() -> None:
    backend, front, proc = RecordingBackend(), FakeFrontdoor(), FakeProc()
    rec = Reconciler(backend, proc, frontdoor=front, probe=answering_probe)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    rec.monitor(0.5)
    proc.connections = {rec.runtimes["infer@2"].instance.port: 1}  # a client that never hangs up
    new = cfg("[placement]\nnodes = [0, 1]\n[frontend]\ndrain_timeout_s = 30")
    rec.apply(loaded_for(new, make_plan(new, three_nodes())), 1.0)
    rec.monitor(30.0)
    assert ("stop", "infer@2") not in backend.calls
    rec.monitor(31.5)
    assert ("stop", "infer@2") in backend.calls


def test_an_instance_planned_again_while_it_leaves_is_stopped_before_the_new_one_starts() -> None:
    backend, front, proc = RecordingBackend(), FakeFrontdoor(), FakeProc()
    rec = Reconciler(backend, proc, frontdoor=front, probe=answering_probe)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    rec.monitor(0.5)
    proc.connections = {rec.runtimes["infer@2"].instance.port: 1}
    fewer = cfg("[placement]\nnodes = [0, 1]")
    rec.apply(loaded_for(fewer, make_plan(fewer, three_nodes())), 1.0)
    backend.calls.clear()
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 2.0)
    # The leaving one holds the port the new one needs: it goes first.
    assert backend.calls.index(("stop", "infer@2")) < backend.calls.index(("start", "infer@2"))


def test_another_model_file_changes_every_instances_definition_and_rolls_them_one_at_a_time() -> None:
    """The pipeline puts the model's and engine's identity in the value it returns; both
    backends make it part of each instance's definition, so another file at the same path
    restarts the instances as a changed definition does: behind the front door, one at a time."""
    from numad_infer.backends.process import ProcessBackend

    config = cfg()
    plan = make_plan(config, three_nodes())
    before, after = loaded_for(config, plan), loaded_for(config, plan)
    def with_artifacts(loaded, artifacts: str):
        (model,) = loaded.models
        return dataclasses.replace(loaded, models=(dataclasses.replace(model, artifacts=artifacts),))

    before = with_artifacts(before, "model /m.gguf: 1:10:100:1")
    after = with_artifacts(after, "model /m.gguf: 1:11:100:2")
    process = ProcessBackend(Path("/nonexistent"))
    assert process.specs(before) != process.specs(after)
    backend, front = RecordingBackend(), FakeFrontdoor()
    backend.specs = lambda loaded: {i.name: repr(i) + loaded.artifacts  # type: ignore[method-assign]
                                    for i in loaded.plan.instances}
    rec = Reconciler(backend, FakeProc(), frontdoor=front, probe=answering_probe)
    rec.apply(before, 0.0)
    rec.monitor(0.5)
    backend.calls.clear()
    diff = rec.apply(after, 1.0)
    assert set(diff.changed) == {"infer@0", "infer@1", "infer@2"}
    assert backend.calls == [("restart", "infer@0")]  # the others wait for it to be healthy


def test_another_file_for_one_of_several_models_rolls_that_models_instances_alone() -> None:
    """[[models]]: each instance's definition carries its own model's file identity, so a new
    file for one model restarts its instances, and no other model's (both backends)."""
    from numad_infer.backends.process import ProcessBackend
    from numad_infer.backends.systemd import SystemdBackend
    from numad_infer.backends.base import BackendKind
    from numad_infer.config.load import parse_config

    config = parse_config('[[models]]\nname = "a"\npath = "/m/a.gguf"\nnodes = [0, 1]\n'
                          '[[models]]\nname = "b"\npath = "/m/b.gguf"\nnodes = [2]\n', "/etc/numa-infer.toml")
    plan = make_plan(config, three_nodes())

    def with_b(kind, b_file: str):
        loaded = loaded_for(config, plan, kind=kind)
        a, b = loaded.models
        return dataclasses.replace(loaded, models=(dataclasses.replace(a, artifacts="model a: 1"),
                                                   dataclasses.replace(b, artifacts=f"model b: {b_file}")))

    for backend, kind in ((ProcessBackend(Path("/nonexistent")), BackendKind.PROCESS),
                          (SystemdBackend.__new__(SystemdBackend), BackendKind.SYSTEMD)):
        old, new = backend.specs(with_b(kind, "1")), backend.specs(with_b(kind, "2"))
        assert sorted(n for n in new if new[n] != old[n]) == ["infer@b-2"], kind
