"""supervision/rollout.py: bringing the running set to a plan. Which instances a reload
stops, starts, adopts and restarts; one at a time behind a front door; instances no longer
planned finish their requests first; `numa-infer restart` rolled as a changed definition is.

Over the stand-ins of tests/fakes.py (RecordingBackend for systemd or child processes,
FakeFrontdoor for HAProxy's runtime API, FakeProc for /proc): this host runs no servers for
these tests. The real processes: tests/e2e/."""

from __future__ import annotations

import pytest

from numad_infer.backends.base import Observation
from numad_infer.frontdoor.haproxy import AdminState
from numad_infer.lifecycle.states import State
from numad_infer.plan.placement import make_plan
from numad_infer.supervision.health import ProbeResult
from numad_infer.supervision.instance import Runtime
from numad_infer.supervision.reconcile import Reconciler
from numad_infer.supervision.rollout import Rollout
from numad_infer.supervision.supervisor import Supervisor
from numad_infer.validate.loaded import Loaded
from tests.fakes import (FakeFrontdoor, FakeProc, RecordingBackend, answering_probe, cfg, loaded_for, served_of,
                         three_nodes)


def test_reload_restarts_only_the_instance_whose_port_changed() -> None:
    backend = RecordingBackend()
    rec = Reconciler(backend)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    backend.calls.clear()
    pids = dict(backend.running)
    # Dropping node 1 moves infer@2 from port 8082 to 8081; infer@0 stays as it was.
    new = cfg("[placement]\nnodes = [0, 2]")
    result = rec.apply(loaded_for(new, make_plan(new, three_nodes(), served=served_of(new))), 1.0)
    assert (result.changed, result.removed, result.unchanged) == (("infer@2",), ("infer@1",), ("infer@0",))
    assert backend.calls == [("stop", "infer@1"), ("restart", "infer@2")]
    assert backend.running["infer@0"] == pids["infer@0"]



def test_adoption_keeps_running_instances_whose_definition_is_unchanged() -> None:
    backend = RecordingBackend(running={"infer@0": 42})
    conf = cfg()
    backend.current_specs = lambda config: {"infer@0": repr(make_plan(conf, three_nodes(), served=served_of(conf))
                                                            .instances[0])}
    rec = Reconciler(backend)
    result = rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    assert result.unchanged == ("infer@0",) and result.added == ("infer@1", "infer@2")
    assert ("restart", "infer@0") not in backend.calls and backend.running["infer@0"] == 42
    assert rec.runtimes["infer@0"].pid == 42



def test_behind_the_front_door_changed_instances_restart_one_at_a_time() -> None:
    # A reload that changes every instance must leave some in rotation at every moment.
    backend, front = RecordingBackend(), FakeFrontdoor()
    rec = Reconciler(backend, FakeProc(), frontdoor=front, probe=answering_probe)
    backend.specs = lambda loaded: {i.name: repr(i) + repr(loaded.config.server.extra_args)  # type: ignore[method-assign]
                                    for i in loaded.plan.instances}
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    rec.monitor(0.5)
    backend.calls.clear()
    new = cfg('[server]\nextra_args = ["--n_batch", "64"]')
    rec.apply(loaded_for(new, make_plan(new, three_nodes(), served=served_of(new))), 1.0)
    # Out of rotation first: the count of requests it has is a pass old (states.drain_first).
    assert backend.calls == [] and rec.runtimes["infer@0"].supervision.state == State.DRAINING
    rec.monitor(1.5)  # nothing in flight now: restarted
    assert backend.calls == [("restart", "infer@0")]
    rec.monitor(2.0)  # infer@0 answers: healthy again, so the next one goes (drained first)
    rec.monitor(2.5)
    assert backend.calls == [("restart", "infer@0"), ("restart", "infer@1")]
    rec.monitor(3.0)
    rec.monitor(3.5)
    assert backend.calls == [("restart", "infer@0"), ("restart", "infer@1"), ("restart", "infer@2")]
    rec.monitor(4.0)
    assert all(rt.supervision.state == State.HEALTHY for rt in rec.runtimes.values())



def test_a_rollout_stops_at_an_instance_that_does_not_come_up_on_the_new_definition(caplog) -> None:
    # A bad extra_args: the first instance restarted on it never answers. The others must
    # keep serving on the old definition, not follow it down.
    backend, front = RecordingBackend(), FakeFrontdoor()
    broken: set[int] = set()
    rec = Reconciler(backend, FakeProc(), frontdoor=front,
                     probe=lambda host, port, timeout, path: ProbeResult(port not in broken, 0.0, "refused"))
    backend.specs = lambda loaded: {i.name: repr(i) + repr(loaded.config.server.extra_args)  # type: ignore[method-assign]
                                    for i in loaded.plan.instances}
    base = "[monitor]\nstartup_grace_s = 0\n[tuning]\nunhealthy_after = 1\nrestart_backoff_s = 1\n"
    conf = cfg(base)
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    rec.monitor(0.5)
    backend.calls.clear()
    new = cfg(base + '[server]\nextra_args = ["--bogus"]')
    broken.add(8080)  # infer@0, once restarted on the new definition, never answers
    rec.apply(loaded_for(new, make_plan(new, three_nodes(), served=served_of(new))), 1.0)
    for t in range(2, 30):
        rec.monitor(float(t))
    restarted = {name for call, name in backend.calls if call == "restart"}
    assert restarted == {"infer@0"}, backend.calls
    assert "rolling restart stopped: infer@0 not healthy on the new definition" in caplog.text
    assert rec.runtimes["infer@1"].supervision.state == State.HEALTHY
    broken.clear()  # a reload that fixes it: the rollout goes on
    fixed = cfg(base + '[server]\nextra_args = ["--good"]')
    rec.apply(loaded_for(fixed, make_plan(fixed, three_nodes(), served=served_of(fixed))), 40.0)
    for t in range(41, 50):
        rec.monitor(float(t))
    assert {name for call, name in backend.calls if call == "restart"} == {"infer@0", "infer@1", "infer@2"}



def test_an_instance_no_longer_planned_finishes_its_requests_before_it_stops() -> None:
    # Before: a reload that dropped a node stopped its instance at once, and the requests it
    # was answering through the front door failed.
    backend, front, proc = RecordingBackend(), FakeFrontdoor(), FakeProc()
    rec = Reconciler(backend, proc, frontdoor=front, probe=answering_probe)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    rec.monitor(0.5)
    backend.calls.clear()
    leaving = rec.runtimes["infer@2"].instance.port
    proc.connections = {leaving: 2}
    new = cfg("[placement]\nnodes = [0, 1]")
    rec.apply(loaded_for(new, make_plan(new, three_nodes(), served=served_of(new))), 1.0)
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
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    rec.monitor(0.5)
    proc.connections = {rec.runtimes["infer@2"].instance.port: 1}  # a client that never hangs up
    new = cfg("[placement]\nnodes = [0, 1]\n[frontend]\ndrain_timeout_s = 30")
    rec.apply(loaded_for(new, make_plan(new, three_nodes(), served=served_of(new))), 1.0)
    rec.monitor(30.0)
    assert ("stop", "infer@2") not in backend.calls
    rec.monitor(31.5)
    assert ("stop", "infer@2") in backend.calls



def test_an_instance_planned_again_while_it_leaves_is_stopped_before_the_new_one_starts() -> None:
    backend, front, proc = RecordingBackend(), FakeFrontdoor(), FakeProc()
    rec = Reconciler(backend, proc, frontdoor=front, probe=answering_probe)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    rec.monitor(0.5)
    proc.connections = {rec.runtimes["infer@2"].instance.port: 1}
    fewer = cfg("[placement]\nnodes = [0, 1]")
    rec.apply(loaded_for(fewer, make_plan(fewer, three_nodes(), served=served_of(fewer))), 1.0)
    backend.calls.clear()
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 2.0)
    # The leaving one holds the port the new one needs: it goes first.
    assert backend.calls.index(("stop", "infer@2")) < backend.calls.index(("start", "infer@2"))


def test_a_failed_unit_write_leaves_the_running_instances_alone() -> None:
    from numad_infer.errors import NumaInferError
    from numad_infer.plan.placement import make_plan
    from numad_infer.supervision.reconcile import Reconciler
    from tests.fakes import RecordingBackend, cfg, loaded_for, three_nodes

    backend = RecordingBackend()
    rec = Reconciler(backend)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    backend.calls.clear()

    def refuse(loaded):
        raise NumaInferError("systemctl daemon-reload failed (1): Access denied")

    backend.sync = refuse
    new = cfg("[placement]\nnodes = [0, 2]")
    with pytest.raises(NumaInferError):
        rec.apply(loaded_for(new, make_plan(new, three_nodes(), served=served_of(new))), 1.0)
    # Before: infer@1 was stopped first, then the write failed and the daemon exited.
    assert backend.calls == [] and set(rec.runtimes) == {"infer@0", "infer@1", "infer@2"}


def running_fleet() -> tuple[Reconciler, RecordingBackend, FakeFrontdoor]:
    backend, front = RecordingBackend(), FakeFrontdoor()
    rec = Reconciler(backend, FakeProc(), frontdoor=front, probe=answering_probe)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    rec.monitor(0.5)
    backend.calls.clear()
    return rec, backend, front



def test_a_restart_rolls_the_instances_one_at_a_time_and_reports_what_is_left() -> None:
    rec, backend, _ = running_fleet()
    assert rec.rollout.request([], rec.runtimes, rec.holds) is None
    everyone = ("infer@0", "infer@1", "infer@2")
    assert rec.rollout.left(everyone, rec.runtimes) == everyone
    rec.roll(1.0)  # what the daemon does with the request (daemon/restarts.py)
    assert backend.calls == []  # out of rotation first, even with no request seen at the last pass
    rec.monitor(1.5)
    assert backend.calls == [("restart", "infer@0")]
    rec.monitor(2.0)  # infer@0 answers again: the next goes
    rec.monitor(2.5)
    assert backend.calls == [("restart", "infer@0"), ("restart", "infer@1")]
    assert rec.rollout.left(everyone, rec.runtimes) == ("infer@1", "infer@2")
    for t in (3.0, 3.5, 4.0):
        rec.monitor(t)
    assert [c for c in backend.calls if c[0] == "restart"] == [("restart", n) for n in everyone]
    assert rec.rollout.left(everyone, rec.runtimes) == ()
    assert all(rt.supervision.state == State.HEALTHY for rt in rec.runtimes.values())
    assert all(rt.supervision.restarts == 0 for rt in rec.runtimes.values())  # asked for, not repairs



def test_a_restart_drains_an_instance_with_requests_first() -> None:
    rec, backend, front = running_fleet()
    front.in_flight_by["infer@1"] = 3
    assert rec.rollout.request(["infer@1"], rec.runtimes, rec.holds) is None
    rec.roll(1.0)  # what the daemon does with the request (daemon/restarts.py)
    assert backend.calls == []
    assert rec.runtimes["infer@1"].supervision.state == State.DRAINING
    drain = rec.runtimes["infer@1"].supervision.drain
    assert drain is not None and drain.reason == "restart requested" and not drain.counted
    assert ("infer@1", AdminState.DRAIN) in front.states
    front.in_flight_by["infer@1"] = 0
    rec.monitor(2.0)
    assert backend.calls == [("restart", "infer@1")]



def test_a_restart_is_refused_while_a_reloads_roll_is_under_way() -> None:
    rec, backend, _ = running_fleet()
    backend.specs = lambda loaded: {i.name: repr(i) + repr(loaded.config.server.extra_args)  # type: ignore[method-assign]
                                    for i in loaded.plan.instances}
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 1.0)
    new = cfg('[server]\nextra_args = ["--batch-size", "64"]')
    rec.apply(loaded_for(new, make_plan(new, three_nodes(), served=served_of(new))), 1.0)
    assert rec.rollout.rolling  # infer@1 and infer@2 wait for infer@0
    error = rec.rollout.request(["infer@0"], rec.runtimes, rec.holds)
    assert error is not None and "a rolling restart is under way" in error and "infer@1" in error



def test_unknown_and_held_instances_are_refused_with_the_names() -> None:
    rec, _, _ = running_fleet()
    error = rec.rollout.request(["infer@9"], rec.runtimes, rec.holds)
    assert error is not None and "infer@9" in error and "infer@0, infer@1, infer@2" in error
    rec.holds = {"infer@2": "numa-infer tune (pid 42)"}
    error = rec.rollout.request(["infer@2"], rec.runtimes, rec.holds)
    assert error is not None and "held by numa-infer tune (pid 42)" in error
    assert not rec.rollout.rolling


# -- Rollout alone: a running fleet and a new plan -> what is stopped, restarted, left to roll -----

def rollout_over(front: FakeFrontdoor | None) -> tuple[Rollout, RecordingBackend, dict[str, Runtime]]:
    """A Rollout with the three instances of cfg() started, their PIDs known and healthy, nothing recorded yet.
    RecordingBackend stands in for systemctl or child processes (its specs carry
    server.extra_args, as both real backends' argv does), FakeFrontdoor for HAProxy."""
    backend = RecordingBackend()
    backend.specs = lambda loaded: {i.name: repr(i) + repr(loaded.config.server.extra_args)  # type: ignore[method-assign]
                                    for i in loaded.plan.instances}
    supervisor = Supervisor(backend, FakeProc(), front, wall=lambda: 0.0)  # type: ignore[arg-type]
    rollout, runtimes = Rollout(backend, front, supervisor), {}  # type: ignore[arg-type]
    bring(rollout, cfg(), runtimes, {}, 0.0)
    for rt in runtimes.values():  # what the monitor's next pass sees: each one's process, answering
        rt.pid = backend.running[rt.instance.name]
        rt.supervision.on_probe(True, 0.5, cfg().monitor)
    backend.calls.clear()
    return rollout, backend, runtimes


def bring(rollout: Rollout, config, runtimes: dict[str, Runtime], holds: dict[str, str], now: float) -> Loaded:
    """What Reconciler.apply does with a new configuration, through the Rollout alone: the
    value it applied, which the rollout is handed again for each later step."""
    loaded = loaded_for(config, make_plan(config, three_nodes(), served=served_of(config)))
    diff, specs = rollout.sync(loaded)
    rollout.apply(loaded, diff, specs, runtimes, holds, now)
    return loaded


NODE_1_DROPPED = "[placement]\nnodes = [0, 2]\n"  # infer@1 goes; infer@2 moves from port 8082 to 8081
NEW_ARGS = '[server]\nextra_args = ["--n_batch", "64"]\n'  # every instance's definition changes


@pytest.mark.parametrize("new, front_door, holds, calls, rolling, retiring", [
    ("", False, {}, [], [], []),
    ("", True, {}, [], [], []),
    (NODE_1_DROPPED, False, {}, [("stop", "infer@1"), ("restart", "infer@2")], [], []),
    # Behind the front door the dropped one is healthy and serving: it finishes its requests first.
    # infer@2 (changed) leaves rotation first: its restart comes at the next pass.
    (NODE_1_DROPPED, True, {}, [], [], ["infer@1"]),
    (NEW_ARGS, False, {}, [("restart", "infer@0"), ("restart", "infer@1"), ("restart", "infer@2")], [], []),
    (NEW_ARGS, True, {}, [], ["infer@1", "infer@2"], []),  # infer@0 drains first
    # A held instance's restart waits for its release, and the ones after it wait too.
    (NEW_ARGS, False, {"infer@1": "numa-infer tune"}, [("restart", "infer@0")], ["infer@1", "infer@2"], []),
], ids=["same", "same-behind-front-door", "node-dropped", "node-dropped-behind-front-door", "changed-all-at-once",
        "changed-one-at-a-time", "changed-held"])
def test_a_new_plan_stops_restarts_and_leaves_to_roll_what_the_table_says(
        new: str, front_door: bool, holds: dict[str, str], calls: list[tuple[str, str]], rolling: list[str],
        retiring: list[str]) -> None:
    rollout, backend, runtimes = rollout_over(FakeFrontdoor() if front_door else None)
    conf = cfg(new)
    bring(rollout, conf, runtimes, holds, 1.0)
    assert backend.calls == calls
    assert rollout.rolling == rolling
    assert sorted(rollout.retiring) == retiring
    assert sorted(runtimes) == sorted(i.name for i in make_plan(conf, three_nodes(), served=served_of(conf)).instances)


def test_the_rollouts_next_restart_waits_until_the_last_one_is_healthy() -> None:
    front = FakeFrontdoor()
    rollout, backend, runtimes = rollout_over(front)
    loaded = bring(rollout, cfg(NEW_ARGS), runtimes, {}, 1.0)
    assert backend.calls == [] and runtimes["infer@0"].supervision.state == State.DRAINING
    zero = runtimes["infer@0"]
    # The monitor's next pass: nothing in flight, the drain is over and it restarts.
    rollout.supervisor.step(loaded, zero, Observation(zero.pid, False, "active"), None, None, 1.5)
    assert backend.calls == [("restart", "infer@0")]
    rollout.roll(loaded, runtimes, {}, 2.0)  # infer@0 is restarting: nobody else goes
    assert backend.calls == [("restart", "infer@0")]
    runtimes["infer@0"].supervision.on_started(3.0)
    rollout.roll(loaded, runtimes, {}, 3.0)  # starting is not healthy yet
    assert backend.calls == [("restart", "infer@0")]
    runtimes["infer@0"].supervision.on_probe(True, 4.0, cfg().monitor)
    rollout.roll(loaded, runtimes, {}, 4.0)
    assert runtimes["infer@1"].supervision.state == State.DRAINING  # its turn: out of rotation first
    assert rollout.left(("infer@0", "infer@1", "infer@2"), runtimes) == ("infer@1", "infer@2")


def test_sync_gives_the_difference_against_a_previous_daemons_units_on_the_first_load() -> None:
    # The first load compares with what the backend says a previous daemon left (adoption);
    # later ones with what this rollout applied last.
    backend = RecordingBackend()
    conf = cfg()
    loaded = loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf)))
    left = backend.specs(loaded)
    backend.current_specs = lambda loaded: {**left, "infer@1": "another definition"}  # type: ignore[method-assign]
    rollout = Rollout(backend, None, Supervisor(backend, FakeProc(), None, wall=lambda: 0.0))  # type: ignore[arg-type]
    diff, specs = rollout.sync(loaded)
    assert (diff.unchanged, diff.changed, diff.added, diff.removed) == (("infer@0", "infer@2"), ("infer@1",), (), ())
    rollout.specs = specs  # what apply keeps
    diff, _ = rollout.sync(loaded)
    assert (diff.unchanged, diff.changed) == (("infer@0", "infer@1", "infer@2"), ())
