"""The reconcile loop over fakes (tests/fakes.py): the lifecycle's restart rules, what a pass
does when states cannot be read, memory drift and its repair, holds, drift checks, and a new
model file as the loop sees it. What rollout.py and supervisor.py decide alone is tested in
test_rollout.py and test_supervisor.py. The loop's real processes: tests/e2e/."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from numad_infer.config.schema import MonitorSection
from numad_infer.config.tuning import TuningSection
from numad_infer.host.proc_types import NodeUsage
from numad_infer.lifecycle.drift import EventKind
from numad_infer.lifecycle.states import RestartDecision, State, Supervision
from numad_infer.plan.placement import make_plan
from numad_infer.supervision.reconcile import Reconciler
from numad_infer.host.pinning import MemoryCalls
from tests.fakes import (FakeFrontdoor, FakeProc, RecordingBackend, StandInPinner, answering_probe, cfg, loaded_for,
                         served_of, three_nodes)

MON = MonitorSection(startup_grace_s=10, max_restarts=3, restart_window_s=100).tuned(
    TuningSection(unhealthy_after=3, restart_backoff_s=2))


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


def test_unknown_instance_states_never_cause_a_restart() -> None:
    backend = RecordingBackend()
    rec = Reconciler(backend)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    backend.calls.clear()

    def broken(names):
        raise RuntimeError("systemctl show failed")

    backend.observe = broken
    rec.monitor(1.0)
    assert backend.calls == []


def test_remote_anonymous_memory_is_migrated_back_to_the_instance_nodes() -> None:
    # A fake /proc/PID/numa_maps with most anonymous pages on the wrong node (this CI host
    # has one node, where memory is always local), and migrate_pages recorded, not called.
    backend, proc = RecordingBackend(), FakeProc()
    usage: dict[int, NodeUsage] = {}
    proc.numa_maps = lambda pid: usage.get(pid, NodeUsage(anon={0: 200 << 20, 2: 800 << 20}, file={1: 50 << 20},
                                                          source="numa_maps"))
    moved: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

    def migrate(pid: int, from_nodes, to_nodes) -> int:
        moved.append((pid, tuple(from_nodes), tuple(to_nodes)))
        usage[pid] = NodeUsage(anon={0: 990 << 20, 2: 10 << 20}, file={1: 50 << 20}, source="numa_maps")
        return 0

    rec = Reconciler(backend, proc, probe=answering_probe, pinner=StandInPinner(migrate=migrate))
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
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


def test_memory_drift_under_a_profile_that_refuses_migrate_pages_is_reported_not_retried(caplog) -> None:
    # podman's and Kubernetes' default seccomp profiles refuse migrate_pages (tests/host/test_pinning_under_seccomp.py
    # shows the probe with a real filter): the drift is shown, no call is made, and the log
    # says why, rather than an ERROR for a call that can only fail again.
    backend, proc = RecordingBackend(), FakeProc()
    proc.numa_maps = lambda pid: NodeUsage(anon={0: 200 << 20, 2: 800 << 20}, source="numa_maps")
    pinner = StandInPinner(calls=MemoryCalls(None, "Operation not permitted"))
    rec = Reconciler(backend, proc, probe=answering_probe, pinner=pinner)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    with caplog.at_level("WARNING"):
        rec.monitor(1.0)
    rt = rec.runtimes["infer@0"]
    assert rt.memory is not None and rt.memory.drifted and rt.last_drift.kind == "memory"
    assert not rt.repair_counts
    assert "not repaired: migrate_pages is refused here: Operation not permitted" in caplog.text


def test_interleaved_instances_are_never_migrated() -> None:
    backend, proc = RecordingBackend(), FakeProc()
    proc.numa_maps = lambda pid: NodeUsage(anon={0: 1 << 20, 1: 1 << 20, 2: 1 << 20}, source="numa_maps")
    config = cfg('[placement]\nmode = "interleave"')
    rec = Reconciler(backend, proc, probe=answering_probe, pinner=StandInPinner())
    rec.apply(loaded_for(config, make_plan(config, three_nodes(), served=served_of(config))), 0.0)
    rec.monitor(1.0)
    (rt,) = rec.runtimes.values()
    assert rt.memory is not None and not rt.memory.drifted


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
    conf = cfg()
    rt = Runtime(make_plan(conf, three_nodes(), served=served_of(conf)).instances[0], pid=10)
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


def test_monitor_returns_each_instance_state_and_nothing_when_states_cannot_be_read() -> None:
    backend = RecordingBackend()
    rec = Reconciler(backend, FakeProc(), probe=answering_probe)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    assert rec.monitor(1.0) == {"infer@0": State.HEALTHY, "infer@1": State.HEALTHY, "infer@2": State.HEALTHY}

    def broken(names):
        raise RuntimeError("systemctl show failed")

    backend.observe = broken
    assert rec.monitor(2.0) == {}


def test_a_pass_reads_the_listening_sockets_once_for_every_instances_port_check() -> None:
    class Counting(FakeProc):
        def __init__(self) -> None:
            super().__init__()
            self.reads, self.tables = 0, []

        def listeners(self):
            self.reads += 1
            return super().listeners()

        def port_owner(self, host, port, pid, table=None):
            self.tables.append(table)
            return super().port_owner(host, port, pid, table)

    proc = Counting()
    rec = Reconciler(RecordingBackend(), proc, probe=answering_probe)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    rec.monitor(1.0)
    assert proc.reads == 1  # three instances, each probed: one reading (bench/README.md: the daemon at 64)
    assert len(proc.tables) >= 3 and all(table is not None for table in proc.tables)


def test_a_crash_is_logged_as_transitions_once_each(caplog) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="numad_infer.lifecycle.states")
    backend = RecordingBackend()
    rec = Reconciler(backend, FakeProc(), probe=answering_probe)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    rec.monitor(1.0)
    caplog.clear()
    backend.running.pop("infer@0")
    rec.monitor(2.0)
    moves = [r.getMessage() for r in caplog.records if r.name == "numad_infer.lifecycle.states"]
    assert moves == ["infer@0: healthy -> exited (main process gone)",
                     "infer@0: exited -> restarting (not running (inactive))"]


def test_another_model_file_changes_every_instances_definition_and_rolls_them_one_at_a_time() -> None:
    """The pipeline puts the model's and engine's identity in the value it returns; both
    backends make it part of each instance's definition, so another file at the same path
    restarts the instances as a changed definition does: behind the front door, one at a time."""
    from numad_infer.backends.process import ProcessBackend

    config = cfg()
    plan = make_plan(config, three_nodes(), served=served_of(config))
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
    assert backend.calls == []  # infer@0 leaves rotation first (its count of requests is a pass old)
    rec.monitor(1.5)
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
    plan = make_plan(config, three_nodes(), served=served_of(config))

    def with_b(kind, b_file: str):
        loaded = loaded_for(config, plan, kind=kind)
        a, b = loaded.models
        return dataclasses.replace(loaded, models=(dataclasses.replace(a, artifacts="model a: 1"),
                                                   dataclasses.replace(b, artifacts=f"model b: {b_file}")))

    for backend, kind in ((ProcessBackend(Path("/nonexistent")), BackendKind.PROCESS),
                          (SystemdBackend.__new__(SystemdBackend), BackendKind.SYSTEMD)):
        old, new = backend.specs(with_b(kind, "1")), backend.specs(with_b(kind, "2"))
        assert sorted(n for n in new if new[n] != old[n]) == ["infer@b-2"], kind


def test_the_applied_value_is_held_once_by_the_reconciler_and_handed_down() -> None:
    """Issue 37: one read-only `Loaded`, the one applied, held by the reconciler and handed to
    the supervisor and the rollout with each call. Neither keeps a configuration, key, engine,
    plan or model file of its own, and the reconciler keeps no part of it beside it, so no
    pass can run on half of one reload and half of another."""
    from numad_infer.config.values import Section
    from numad_infer.engines.base import Engine
    from numad_infer.plan.model import Plan
    from numad_infer.validate.loaded import Loaded

    backend = RecordingBackend()
    rec = Reconciler(backend, FakeProc(), frontdoor=FakeFrontdoor(), probe=answering_probe)  # type: ignore[arg-type]
    assert rec.loaded is None
    for n, key in enumerate(("k-FIRST-37", "k-SECOND-37")):
        config = cfg(f"[tuning]\nprobe_timeout_s = {n + 1}\n[frontend]\ndrain_timeout_s = {n + 7}")
        loaded = loaded_for(config, make_plan(config, three_nodes(), served=served_of(config)), api_key=key)
        rec.apply(loaded, float(n))
        rec.monitor(n + 0.5)
        assert rec.loaded is loaded
        held = [(type(obj).__name__, name, value) for obj in (rec, rec.supervisor, rec.rollout)
                for name, value in vars(obj).items() if not (obj is rec and name == "loaded")]
        for owner, name, value in held:
            parts = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
            assert not any(isinstance(v, Loaded | Section | Engine | Plan) for v in parts), f"{owner}.{name}"
            assert key not in repr(value), f"{owner}.{name} holds the key"
