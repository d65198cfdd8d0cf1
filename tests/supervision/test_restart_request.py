"""`numa-infer restart`: the request file the daemon takes (only its own user's regular
file, acted on once), and the rollout it starts over fakes (tests/fakes.py): one at a
time behind the front door, refused while another roll is under way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from numad_infer.frontdoor.haproxy import AdminState
from numad_infer.lifecycle.states import State
from numad_infer.plan.placement import make_plan
from numad_infer.supervision import restart_request
from numad_infer.supervision.reconcile import Reconciler
from tests.fakes import FakeFrontdoor, FakeProc, RecordingBackend, answering_probe, cfg, loaded_for, three_nodes


def running_fleet() -> tuple[Reconciler, RecordingBackend, FakeFrontdoor]:
    backend, front = RecordingBackend(), FakeFrontdoor()
    rec = Reconciler(backend, FakeProc(), frontdoor=front, probe=answering_probe)
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 0.0)
    rec.monitor(0.5)
    backend.calls.clear()
    return rec, backend, front


def test_a_request_is_read_once_and_removed(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    sent = restart_request.write(state, ("infer@1",))
    assert oct(restart_request.request_path(state).stat().st_mode & 0o777) == "0o600"
    taken = restart_request.take(state)
    assert taken == sent and taken.instances == ("infer@1",)
    assert restart_request.take(state) is None


@pytest.mark.parametrize("plant", ["link", "fifo", "garbage", "wrong shape"])
def test_what_is_not_a_request_is_reported_and_removed_never_acted_on(tmp_path: Path, plant: str) -> None:
    state = tmp_path / "state.json"
    path = restart_request.request_path(state)
    if plant == "link":
        target = tmp_path / "elsewhere"
        target.write_text('{"id": "x", "instances": []}')
        path.symlink_to(target)
    elif plant == "fifo":
        os.mkfifo(path)  # opened without waiting for a writer (O_NONBLOCK)
    elif plant == "garbage":
        path.write_text("not json")
    else:
        path.write_text('{"id": 7, "instances": "all"}')
    said = restart_request.take(state)
    assert isinstance(said, str) and str(path) in said
    assert not path.exists() and not path.is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant a file owned by another user")
def test_another_users_request_is_ignored(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    restart_request.write(state, ())
    os.chown(restart_request.request_path(state), 65534, 65534)
    said = restart_request.take(state)
    assert isinstance(said, str) and "not the daemon's user" in said


def test_a_restart_rolls_the_instances_one_at_a_time_and_reports_what_is_left() -> None:
    rec, backend, _ = running_fleet()
    assert rec.rollout.request([], rec.runtimes, rec.holds) is None
    everyone = ("infer@0", "infer@1", "infer@2")
    assert rec.rollout.left(everyone, rec.runtimes) == everyone
    rec.rollout.roll(rec.runtimes, rec.holds, 1.0)
    assert backend.calls == [("restart", "infer@0")]
    rec.monitor(2.0)  # infer@0 answers again: the next goes
    assert backend.calls == [("restart", "infer@0"), ("restart", "infer@1")]
    assert rec.rollout.left(everyone, rec.runtimes) == ("infer@1", "infer@2")
    rec.monitor(3.0)
    rec.monitor(4.0)
    assert [c for c in backend.calls if c[0] == "restart"] == [("restart", n) for n in everyone]
    assert rec.rollout.left(everyone, rec.runtimes) == ()
    assert all(rt.supervision.state == State.HEALTHY for rt in rec.runtimes.values())
    assert all(rt.supervision.restarts == 0 for rt in rec.runtimes.values())  # asked for, not repairs


def test_a_restart_drains_an_instance_with_requests_first() -> None:
    rec, backend, front = running_fleet()
    front.in_flight_by["infer@1"] = 3
    assert rec.rollout.request(["infer@1"], rec.runtimes, rec.holds) is None
    rec.rollout.roll(rec.runtimes, rec.holds, 1.0)
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
    rec.apply(loaded_for(cfg(), make_plan(cfg(), three_nodes())), 1.0)
    new = cfg('[server]\nextra_args = ["--batch-size", "64"]')
    rec.apply(loaded_for(new, make_plan(new, three_nodes())), 1.0)
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
