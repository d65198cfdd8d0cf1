"""supervision/supervisor.py: what the monitor saw of one instance, acted on: a crash
restarted (then backed off, then failed), a replaced process counted, a drain before a
restart, a hold drained then stopped and released, a probe judged against CPU progress.

Over the stand-ins of tests/fakes.py (RecordingBackend for systemd or child processes,
FakeFrontdoor for HAProxy's runtime API, FakeProc for /proc): this host runs no servers for
these tests. The real processes: tests/e2e/."""

from __future__ import annotations

import pytest

from numad_infer.backends.base import Observation
from numad_infer.config.load import parse_config
from numad_infer.frontdoor.haproxy import AdminState
from numad_infer.lifecycle.states import State
from numad_infer.plan.placement import make_plan
from numad_infer.supervision.health import ProbeResult
from numad_infer.supervision.instance import Runtime
from numad_infer.supervision.reconcile import Reconciler
from numad_infer.supervision.slot_keeper import SlotKeeper
from numad_infer.supervision.supervisor import Supervisor
from numad_infer.validate.loaded import Loaded
from tests.fakes import (FakeFrontdoor, FakeProc, RecordingBackend, answering_probe, cfg, loaded_for, served_of,
                         three_nodes)


def test_a_changed_instance_is_drained_out_of_the_front_door_before_its_restart() -> None:
    backend, front = RecordingBackend(), FakeFrontdoor()
    rec = Reconciler(backend, FakeProc(), frontdoor=front, probe=answering_probe)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    rec.monitor(0.5)
    front.states.clear()
    backend.calls.clear()
    front.in_flight_by["infer@2"] = 2
    new = cfg("[placement]\nnodes = [0, 2]")
    rec.apply(loaded_for(new, make_plan(new, three_nodes(), served=served_of(new))), 1.0)
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
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    rec.monitor(0.5)
    front.in_flight_by["infer@2"] = 1
    new = cfg("[placement]\nnodes = [0, 2]\n[frontend]\ndrain_timeout_s = 10")
    rec.apply(loaded_for(new, make_plan(new, three_nodes(), served=served_of(new))), 1.0)
    rec.monitor(10.9)
    assert ("restart", "infer@2") not in backend.calls
    rec.monitor(11.0)
    assert backend.calls[-1] == ("restart", "infer@2")



def test_an_unhealthy_instance_that_makes_no_progress_is_restarted_without_waiting() -> None:
    # SIGSTOPped or wedged: it will never finish its request, so draining would only wait.
    backend, front, proc = RecordingBackend(), FakeFrontdoor(), FakeProc()
    rec = Reconciler(backend, proc, frontdoor=front)
    config = cfg("[monitor]\nstartup_grace_s = 0\n[tuning]\nunhealthy_after = 1\nprobe_timeout_s = 0.2")
    rec.apply(loaded_for(config, make_plan(config, three_nodes(), served=served_of(config))), 0.0)
    backend.calls.clear()
    pid = backend.running["infer@0"]
    proc.cpu[pid] = 5.0
    front.in_flight_by["infer@0"] = 1
    rec.monitor(1.0)  # nothing listens on the ports: every probe fails
    proc.cpu[pid] = 5.0  # and no CPU used since
    rec.monitor(2.0)
    assert ("restart", "infer@0") in backend.calls
    assert rec.runtimes["infer@0"].supervision.restarts >= 1



# -- one lifecycle: what happens to an instance's process is its state, not side flags -------------

def lifecycle(rec: Reconciler, name: str = "infer@0") -> tuple[State, int]:
    sup = rec.runtimes[name].supervision
    return sup.state, sup.restarts



def test_a_crash_goes_exited_restarting_starting_and_the_next_one_backs_off() -> None:
    backend = RecordingBackend()
    rec = Reconciler(backend, FakeProc(), probe=answering_probe)
    conf = cfg("[tuning]\nrestart_backoff_s = 5")
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
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
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
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
    config = cfg("[monitor]\nstartup_grace_s = 30\n[tuning]\nunhealthy_after = 1")
    rec.apply(loaded_for(config, make_plan(config, three_nodes(), served=served_of(config))), 0.0)
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



def test_a_hold_drains_then_stops_the_instance_and_its_release_starts_it_again() -> None:
    backend, front, proc = RecordingBackend(), FakeFrontdoor(), FakeProc()
    rec = Reconciler(backend, proc, frontdoor=front, probe=answering_probe)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
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
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 5.5)
    assert "infer@1" not in backend.running
    rec.holds = {}
    rec.monitor(6.0)
    assert backend.calls[-1] == ("start", "infer@1") and lifecycle(rec, "infer@1") == (State.STARTING, 0)
    rec.monitor(7.0)
    assert lifecycle(rec, "infer@1") == (State.HEALTHY, 0)



def test_a_probe_that_answers_while_requests_stall_for_30s_counts_as_failed() -> None:
    from numad_infer.supervision.supervisor import STALL_AFTER_S, judge_probe

    answered = ProbeResult(True, 0.002)
    assert judge_probe(answered, None, 100.0) is answered
    assert judge_probe(answered, 100.0 - STALL_AFTER_S + 1, 100.0).ok
    stalled = judge_probe(answered, 100.0 - STALL_AFTER_S, 100.0)
    assert not stalled.ok and stalled.error == "stalled: requests in flight and no CPU used for 30s"


# -- Supervisor.step alone: one instance's state and what was seen of it -> the call made ---------

TABLE_CONFIG = "[monitor]\nstartup_grace_s = 10\n[tuning]\nunhealthy_after = 2\nrestart_backoff_s = 2\n"


def table_loaded() -> Loaded:
    """The applied value the supervisor is handed (Reconciler.apply's), with TABLE_CONFIG."""
    config = cfg(TABLE_CONFIG)
    return loaded_for(config, make_plan(config, three_nodes(), served=served_of(config)))

NOW = 5.0  # within the grace period of an instance started at 0


def runtime_in(start: str) -> Runtime:
    """infer@0 in the state named, reached through the lifecycle's own moves (pid 101 while it runs)."""
    conf = cfg()
    rt = Runtime(make_plan(conf, three_nodes(), served=served_of(conf)).instances[0], pid=101)
    sup = rt.supervision
    if start in ("starting", "healthy", "unhealthy"):
        sup.on_started(0.0)
    if start in ("healthy", "unhealthy"):
        sup.on_probe(True, 1.0, cfg(TABLE_CONFIG).monitor)
    if start == "unhealthy":
        sup.on_probe(False, 2.0, cfg(TABLE_CONFIG).monitor, "refused")
    if start in ("held", "failed"):
        rt.pid = None
        sup.on_held("numa-infer tune") if start == "held" else sup.on_failed("3 restarts within 100s")
    assert sup.state.value == start, (start, sup.state)
    return rt


@pytest.mark.parametrize("start, pid, pending, held_by, probe_ok, calls, state, probed, restarts", [
    # A running instance, probed.
    ("healthy", 101, False, None, True, [], State.HEALTHY, True, 0),
    ("healthy", 101, False, None, False, [], State.UNHEALTHY, True, 0),  # one failure of unhealthy_after = 2
    ("unhealthy", 101, False, None, False, [("restart", "infer@0")], State.RESTARTING, False, 1),  # the second
    ("starting", 101, False, None, False, [], State.STARTING, True, 0),  # in its grace period: not counted
    # Its process gone, or replaced by the service manager.
    ("healthy", None, False, None, None, [("restart", "infer@0")], State.RESTARTING, False, 1),
    ("healthy", None, True, None, None, [], State.EXITED, False, 0),  # pending: the manager restarts it
    ("healthy", 202, False, None, True, [], State.HEALTHY, True, 1),  # Restart= brought it back: counted
    # Holds, with no front door to drain out of.
    ("healthy", 101, False, "numa-infer tune", None, [("stop", "infer@0")], State.HELD, False, 0),
    ("held", None, False, "numa-infer tune", None, [], State.HELD, False, 0),
    ("held", 303, False, "numa-infer tune", None, [("stop", "infer@0")], State.HELD, False, 0),  # started meanwhile
    ("held", None, False, None, None, [("start", "infer@0")], State.STARTING, False, 0),  # released
    # Failed: left alone until a reload, whatever its process does.
    ("failed", None, False, None, None, [], State.FAILED, False, 0),
    ("failed", 404, False, None, True, [], State.FAILED, False, 0),
])
def test_one_step_for_one_instance_makes_the_call_and_the_move_the_table_says(
        start: str, pid: int | None, pending: bool, held_by: str | None, probe_ok: bool | None,
        calls: list[tuple[str, str]], state: State, probed: bool, restarts: int) -> None:
    # RecordingBackend stands in for systemctl or child processes, FakeProc for /proc: the
    # supervisor is given what a monitor pass saw, and nothing here runs a server.
    backend = RecordingBackend()
    supervisor = Supervisor(backend, FakeProc(), None, wall=lambda: NOW)
    rt = runtime_in(start)
    seen = Observation(pid, pending, "active (running)" if pid else "inactive")
    result = None if probe_ok is None else ProbeResult(probe_ok, 0.001, "" if probe_ok else "refused")
    assert supervisor.step(table_loaded(), rt, seen, held_by, result, NOW) is probed
    assert backend.calls == calls
    assert (rt.supervision.state, rt.supervision.restarts) == (state, restarts)


@pytest.mark.parametrize("state, rotation", [
    (State.HEALTHY, AdminState.READY), (State.DRAINING, AdminState.DRAIN), (State.STARTING, AdminState.MAINT),
    (State.UNHEALTHY, AdminState.MAINT), (State.RESTARTING, AdminState.MAINT), (State.BACKOFF, AdminState.MAINT),
    (State.EXITED, AdminState.MAINT), (State.HELD, AdminState.MAINT), (State.FAILED, AdminState.MAINT),
    (State.STOPPED, AdminState.MAINT),
])
def test_an_instance_is_in_the_front_doors_rotation_only_while_healthy(state: State, rotation: AdminState) -> None:
    front = FakeFrontdoor()  # HAProxy's runtime API: the admin state asked for is recorded
    supervisor = Supervisor(RecordingBackend(), FakeProc(), front, wall=lambda: 0.0)  # type: ignore[arg-type]
    rt = runtime_in("healthy")
    rt.supervision.state = state
    supervisor.rotate(rt)
    assert front.states == [("infer@0", rotation)]


def test_a_hold_behind_the_front_door_drains_first_and_a_release_before_its_end_resumes_service() -> None:
    backend, front, proc = RecordingBackend(), FakeFrontdoor(), FakeProc()
    supervisor = Supervisor(backend, proc, front, wall=lambda: 0.0)  # type: ignore[arg-type]
    loaded = table_loaded()
    rt = runtime_in("healthy")
    front.in_flight_by["infer@0"] = 2
    supervisor.step(loaded, rt, Observation(101, False, "active"), "numa-infer tune", None, NOW)
    assert rt.supervision.state == State.DRAINING and backend.calls == []
    assert front.states == [("infer@0", AdminState.DRAIN)]
    # The holder gave up before the requests were answered: back in service, never stopped.
    supervisor.step(loaded, rt, Observation(101, False, "active"), None, ProbeResult(True, 0.001), NOW + 1)
    assert rt.supervision.state == State.HEALTHY and backend.calls == []


class RecordingKeeper:
    """Stands in for slot_keeper.SlotKeeper: its calls, in order with the backend's, and
    the front door's states when each restore ran (it must run before the instance is READY)."""

    def __init__(self, calls: list, front: FakeFrontdoor) -> None:
        from numad_infer.model.identity import FileIdentity
        self.calls, self.front, self.host = calls, front, ""
        self.loaded_with: dict[str, FileIdentity | None] = {}
        self.restored_while: list = []

    def save(self, name, port, key, model, timeout_s):
        self.calls.append(("save", name, timeout_s))

    def restore(self, name, port, key, model, timeout_s):
        self.calls.append(("restore", name, timeout_s))
        self.restored_while.append(list(self.front.states))
        return 1

    after_start = SlotKeeper.after_start
    before_restart = SlotKeeper.before_restart

    def forget(self, name):
        self.calls.append(("forget", name))

    def forget_all_but(self, names):
        pass


def _kept(tmp_path, extra: str = ""):
    backend, front = RecordingBackend(), FakeFrontdoor()
    rec = Reconciler(backend, FakeProc(), frontdoor=front, probe=answering_probe)
    keeper = RecordingKeeper(backend.calls, front)
    rec.supervisor.keeper = keeper  # type: ignore[assignment]
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    # The model file the keeper is given is the applied value's: this one, on disk.
    config = parse_config(f'[model]\npath = "{model}"\n{extra}', "/etc/numa-infer.toml")
    rec.apply(loaded_for(config, make_plan(config, three_nodes(), served=served_of(config))), 0.0)
    rec.monitor(0.5)  # healthy: the model file it loaded is noted
    return backend, front, rec, keeper, model


@pytest.mark.parametrize(("change", "saved"), [("none", True), ("model file replaced", False)])
def test_a_requested_restart_saves_the_slots_first_and_restores_them_before_rotation(tmp_path, change: str,
                                                                                      saved: bool) -> None:
    backend, front, rec, keeper, model = _kept(tmp_path, "[frontend]\ndrain_timeout_s = 7")
    assert keeper.loaded_with["infer@0"] is not None
    assert [c for c in backend.calls if c[0] == "restore"] == [("restore", "infer@0", 7.0), ("restore", "infer@1", 7.0),
                                                                ("restore", "infer@2", 7.0)]  # nothing kept: a no-op
    backend.calls.clear()
    if change == "model file replaced":
        fresh = tmp_path / "new.gguf"
        fresh.write_bytes(b"GGUF2")
        fresh.replace(model)
    assert rec.rollout.request(["infer@0"], rec.runtimes, rec.holds) is None
    rec.monitor(1.0)  # out of rotation first: the count it had is a pass old
    assert ("infer@0", AdminState.DRAIN) in front.states and not [c for c in backend.calls if c[0] == "restart"]
    rec.monitor(1.2)  # nothing in flight: restarted
    first = ("save", "infer@0", 7.0) if saved else ("forget", "infer@0")
    assert backend.calls[:2] == [first, ("restart", "infer@0")], backend.calls
    front.states.clear()
    rec.monitor(1.5)  # the new process answers: restored, then put back in rotation
    assert ("restore", "infer@0", 7.0) in backend.calls
    assert ("infer@0", AdminState.READY) not in keeper.restored_while[-1]
    assert ("infer@0", AdminState.READY) in front.states


def test_a_restart_after_failed_probes_saves_nothing(tmp_path) -> None:
    backend, front, rec, keeper, _ = _kept(tmp_path, "[monitor]\nstartup_grace_s = 0\n[tuning]\nunhealthy_after = 1")
    backend.calls.clear()
    rec.liveness_probe = lambda host, port, timeout, path: ProbeResult(port != rec.runtimes["infer@0"].instance.port,
                                                                       0.001, "no answer")
    rec.monitor(1.0)
    rec.monitor(2.0)
    assert ("restart", "infer@0") in backend.calls
    assert not [c for c in backend.calls if c[0] == "save"]


@pytest.mark.parametrize("extra", ['[server]\nextra_args = ["--slot-save-path", "/srv/own/"]\n',
                                   '[server]\nengine = "llama-cpp-python"\npython = "/usr/bin/python3"\n'])
def test_no_slot_is_saved_or_restored_where_numa_infer_gave_no_slot_path(tmp_path, extra: str) -> None:
    # An operator's own --slot-save-path is theirs (the keeper would look for its files in
    # the wrong place); llama-cpp-python keeps no slot files at all.
    backend, front, rec, keeper, _ = _kept(tmp_path, extra)
    assert rec.rollout.request(["infer@0"], rec.runtimes, rec.holds) is None
    rec.monitor(1.0)
    rec.monitor(1.2)
    rec.monitor(1.5)
    assert ("restart", "infer@0") in backend.calls
    assert not [c for c in backend.calls if c[0] in ("save", "restore", "forget")], backend.calls


def test_under_systemd_slots_are_kept_only_where_the_units_were_rendered_with_a_slot_path(tmp_path) -> None:
    import dataclasses

    from numad_infer.host.identity import BackendKind

    config = parse_config(f'[model]\npath = "{tmp_path / "m.gguf"}"\n', "/etc/numa-infer.toml")
    loaded = loaded_for(config, make_plan(config, three_nodes(), served=served_of(config)), kind=BackendKind.SYSTEMD)
    assert not loaded.keeps_slots("infer@0")  # the host cannot (no group, no directory)
    assert dataclasses.replace(loaded, slots_group="numa-infer").keeps_slots("infer@0")
    assert not loaded.keeps_slots("infer@9")  # not planned
