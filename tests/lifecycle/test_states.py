"""The lifecycle as a state machine: one logged transition, and the pure rules that pick
each pass's step for an instance, tested without a backend."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from numad_infer.config.schema import MonitorSection
from numad_infer.config.tuning import TuningSection
from numad_infer.lifecycle.states import (
    ENTERED_FROM,
    Drain,
    Seen,
    State,
    Step,
    Supervision,
    TransitionError,
    drain_first,
    drain_over,
    is_legal,
    next_step,
)

MON = MonitorSection(startup_grace_s=10, max_restarts=3, restart_window_s=100).tuned(
    TuningSection(unhealthy_after=3, restart_backoff_s=2))
PACKAGE = Path(__file__).resolve().parents[2] / "numad_infer"


def transitions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "numad_infer.lifecycle.states"]


def test_every_state_change_is_logged_once_with_instance_from_to_and_why(caplog) -> None:
    caplog.set_level(logging.INFO, logger="numad_infer.lifecycle.states")
    sup = Supervision(name="infer@3")
    sup.on_started(0.0)
    sup.on_probe(True, 1.0, MON)
    sup.on_probe(True, 2.0, MON)  # still healthy: no move, nothing to log
    sup.on_restart(3.0, MON, "2 failed probes: refused")
    assert transitions(caplog) == [
        "infer@3: stopped -> starting (started)",
        "infer@3: starting -> healthy (probe answered)",
        "infer@3: healthy -> restarting (2 failed probes: refused)",
    ]


def test_the_lifecycle_state_is_assigned_only_in_change_state() -> None:
    # The choke point holds only if nothing else writes `.state` of a Supervision: every
    # module of the reconcile loop (supervision/), and every method of states.py but change_state.
    loop = [*sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "supervision").glob("*.py")),
            "lifecycle/states.py"]
    assert "supervision/reconcile.py" in loop
    writers = []
    for name in loop:
        tree = ast.parse((PACKAGE / name).read_text())
        for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            for node in ast.walk(func):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                    node, (ast.AugAssign, ast.AnnAssign)) else []
                for target in targets:
                    elts = target.elts if isinstance(target, ast.Tuple) else [target]
                    if any(isinstance(e, ast.Attribute) and e.attr == "state" for e in elts):
                        writers.append(f"{name}:{func.name}")
    assert writers == ["lifecycle/states.py:change_state"]


def test_a_hold_drain_carries_its_holder_as_a_field_and_ends_in_held() -> None:
    sup = Supervision(name="infer@1")
    sup.on_started(0.0)
    sup.on_probe(True, 1.0, MON)
    sup.on_drain(2.0, 30.0, "held by numa-infer tune (pid 7)", counted=False, hold_by="numa-infer tune (pid 7)")
    assert sup.drain == Drain(32.0, "held by numa-infer tune (pid 7)", False, "numa-infer tune (pid 7)")
    sup.on_held("numa-infer tune (pid 7)")
    assert (sup.state, sup.held_by, sup.drain) == (State.HELD, "numa-infer tune (pid 7)", None)
    sup.on_released(9.0)
    assert (sup.state, sup.held_by, sup.last_error) == (State.STARTING, None, "")


def test_a_reload_clears_failed_with_a_fresh_budget_and_keeps_the_restart_count() -> None:
    sup = Supervision(restarts=5, restart_times=[1.0, 2.0, 3.0], next_restart_at=50.0)
    sup.on_failed("3 restarts within 100s")
    sup.on_reload()
    assert (sup.state, sup.restarts, sup.restart_times, sup.next_restart_at, sup.last_error) == (
        State.STOPPED, 5, [], 0.0, "")


def test_a_reload_leaves_an_instance_that_did_not_fail_as_it_is() -> None:
    sup = Supervision(restart_times=[1.0], next_restart_at=5.0)
    sup.on_started(0.0)
    sup.on_reload()
    assert (sup.state, sup.restart_times, sup.next_restart_at) == (State.STARTING, [1.0], 5.0)


# -- next_step: which rule wins -------------------------------------------------------------------

def supervision(state: State, hold_by: str | None = None) -> Supervision:
    sup = Supervision(state=state)
    if state == State.DRAINING:
        sup.drain = Drain(10.0, "why", False, hold_by)
    return sup


UP, GONE, COMING = (True, False), (False, False), (False, True)


@pytest.mark.parametrize("state, hold_by, held, process, step", [
    pytest.param(State.HEALTHY, None, "tune", UP, Step.HOLD, id="a new hold takes a healthy instance"),
    pytest.param(State.FAILED, None, "tune", GONE, Step.HOLD, id="a hold outranks failed"),
    pytest.param(State.DRAINING, None, "tune", UP, Step.HOLD, id="a hold outranks a drain for a restart"),
    pytest.param(State.DRAINING, "tune", "tune", UP, Step.DRAIN, id="a drain for a hold goes on while held"),
    pytest.param(State.HELD, None, "tune", GONE, Step.KEEP_HELD, id="a held instance stays stopped"),
    pytest.param(State.HELD, None, "tune", UP, Step.KEEP_HELD, id="a held instance started by another is kept held"),
    pytest.param(State.HELD, None, None, GONE, Step.RELEASE, id="a released hold starts it again"),
    pytest.param(State.DRAINING, "tune", None, UP, Step.RESUME, id="a hold released during its drain resumes"),
    pytest.param(State.FAILED, None, None, GONE, Step.LEAVE, id="failed is left alone though not running"),
    pytest.param(State.FAILED, None, None, UP, Step.LEAVE, id="failed is left alone though running"),
    pytest.param(State.STARTING, None, None, COMING, Step.WAIT, id="a process coming up is waited for"),
    pytest.param(State.EXITED, None, None, GONE, Step.RESTART_GONE, id="gone with nothing coming is restarted"),
    pytest.param(State.DRAINING, None, None, GONE, Step.RESTART_GONE, id="a drain whose process died restarts it"),
    pytest.param(State.DRAINING, None, None, UP, Step.DRAIN, id="a drain for a restart goes on"),
    pytest.param(State.HEALTHY, None, None, UP, Step.PROBE, id="a running instance is probed"),
    pytest.param(State.BACKOFF, None, None, UP, Step.PROBE, id="backing off is still probed"),
])
def test_next_step_priority(state: State, hold_by: str | None, held: str | None, process: tuple[bool, bool],
                            step: Step) -> None:
    running, pending = process
    assert next_step(supervision(state, hold_by), Seen(held, running, pending)) == step


# -- drains ------------------------------------------------------------------------------------------

def test_a_restart_drains_only_with_requests_in_flight_and_a_drain_timeout() -> None:
    assert drain_first(busy=2, drain_timeout_s=30)
    assert not drain_first(busy=0, drain_timeout_s=30)
    # 0 at the last pass, but still in rotation: a request may have come since (a pass old)
    assert drain_first(busy=0, drain_timeout_s=30, serving=True)
    assert not drain_first(busy=None, drain_timeout_s=30, serving=True)  # not in the front door
    assert not drain_first(busy=0, drain_timeout_s=0, serving=True)
    assert not drain_first(busy=0, drain_timeout_s=30, counted=True, progress=False, serving=True)
    assert not drain_first(busy=None, drain_timeout_s=30)  # no front door
    assert not drain_first(busy=2, drain_timeout_s=0)


def test_a_repair_drains_only_a_process_that_makes_progress() -> None:
    assert drain_first(busy=1, drain_timeout_s=30, counted=True, progress=True)
    assert not drain_first(busy=1, drain_timeout_s=30, counted=True, progress=False)
    assert not drain_first(busy=1, drain_timeout_s=30, counted=True, progress=None)
    assert drain_first(busy=1, drain_timeout_s=30, counted=False, progress=False)  # a definition change waits


def test_a_drain_ends_when_drained_at_its_deadline_or_when_a_repair_stalls() -> None:
    change, repair = Drain(10.0, "definition changed", False), Drain(10.0, "failed probes", True)
    assert drain_over(change, 2, 5.0, True) is None
    assert drain_over(change, 0, 5.0, True) == "drained"
    assert drain_over(change, 2, 10.0, True) == "2 request(s) still running at the drain deadline"
    assert drain_over(change, 2, 5.0, False) is None  # a definition change waits out a slow request
    assert drain_over(repair, 2, 5.0, False) == "2 request(s) in flight but no progress"


# -- the table of moves --------------------------------------------------------------------------------

SUPERVISED = [s for s in State if s != State.UNSUPERVISED]


@pytest.mark.parametrize("current", list(State))
@pytest.mark.parametrize("to", list(State))
def test_change_state_makes_every_move_the_table_lists_and_refuses_every_other(current: State, to: State) -> None:
    sup = Supervision(name="infer@0")
    sup.state = current  # set up directly: the move under test is the one below
    if is_legal(current, to):
        sup.change_state(to, "test")
        assert sup.state == to
    else:
        with pytest.raises(TransitionError, match=rf"infer@0: {current.value} -> {to.value} is not a legal move"):
            sup.change_state(to, "test")
        assert sup.state == current  # nothing half-done


def test_the_table_names_every_state_and_refuses_what_no_caller_may_do() -> None:
    assert set(ENTERED_FROM) == set(State)
    assert all(is_legal(s, s) for s in SUPERVISED)  # staying is always allowed
    assert not any(is_legal(s, State.UNSUPERVISED) for s in State)  # status's word only
    assert not is_legal(State.FAILED, State.STARTING)  # only a reload clears FAILED
    assert is_legal(State.FAILED, State.STOPPED)
    assert not any(is_legal(s, State.HEALTHY) for s in (State.STOPPED, State.EXITED, State.HELD, State.FAILED,
                                                        State.DRAINING))
    assert not is_legal(State.HELD, State.DRAINING) and not is_legal(State.RESTARTING, State.EXITED)


@pytest.mark.parametrize("current", SUPERVISED)
def test_every_event_from_every_state_keeps_to_the_table(current: State) -> None:
    """The methods' own guards never ask for a move the table refuses, except three that no
    caller makes: a start of a FAILED instance (a reload goes through STOPPED first), and a
    drain or a restart decision for a HELD one (`next_step` keeps or releases it first)."""
    events = {
        "started": lambda s: s.on_started(10.0), "stopped": lambda s: s.on_stopped(), "reload": lambda s: s.on_reload(),
        "exit": lambda s: s.on_exit(), "new pid": lambda s: s.on_new_pid(True, 10.0),
        "probe ok": lambda s: s.on_probe(True, 100.0, MON), "probe failed": lambda s: s.on_probe(False, 100.0, MON),
        "restart decision": lambda s: s.restart_decision(10.0, MON),
        "restart": lambda s: s.on_restart(10.0, MON), "drain": lambda s: s.on_drain(10.0, 5.0, "test", True),
        "held": lambda s: s.on_held("tune"), "failed": lambda s: s.on_failed("test"),
    }
    refused = []
    for name, event in events.items():
        sup = Supervision(name="infer@0", started_at=0.0, next_restart_at=50.0)
        sup.state = current
        try:
            event(sup)
        except TransitionError:
            refused.append(name)
    expected = {State.FAILED: ["started"], State.HELD: ["restart decision", "drain"]}.get(current, [])
    assert refused == expected
