"""A surge's pure rules (numad_infer/lifecycle/surge.py): surge or hold (`choose`) on a table,
and the phases' table walked as states.py's is: every listed move made, every other refused."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from numad_infer.lifecycle.states import TransitionError
from numad_infer.lifecycle.surge import (
    MARGIN_BYTES,
    PHASE_ENTERED_FROM,
    CoverKind,
    Phase,
    Surge,
    choose,
    is_legal_phase,
)
from numad_infer.plan.model import Instance, Policy

GIB = 1 << 30
PACKAGE = Path(__file__).resolve().parents[2] / "numad_infer"


@pytest.mark.parametrize(("counted", "refusal", "room", "kind", "words"), [
    (False, None, 8 * GIB, CoverKind.SURGE, "a second copy fits (2.0 GiB of the 8.0 GiB free on node(s) 0)"),
    (False, None, 2 * GIB + MARGIN_BYTES - 1, CoverKind.HOLD,
     "a second copy does not fit: it needs 2.0 GiB and a margin of 512 MiB, 2.5 GiB is free for it on node(s) 0 (within any cgroup memory limit)"),
    (False, None, None, CoverKind.HOLD, "cannot be read"),
    (False, "the systemd backend starts no second copy", 8 * GIB, CoverKind.HOLD, "systemd backend"),
    (True, None, 8 * GIB, CoverKind.HOLD, "a repair"),
    (False, None, 8 * GIB, None, "frontend.surge = false"),
])
def test_a_copy_is_tried_only_for_a_planned_restart_that_fits(counted: bool, refusal: str | None, room: int | None,
                                                              kind: CoverKind | None, words: str) -> None:
    cover = choose(counted, refusal, 2 * GIB, room, "0", wanted=kind is not None)
    kind = kind or CoverKind.HOLD
    assert cover.kind == kind and words in cover.why, cover


def surge(phase: Phase) -> Surge:
    copy = Instance("infer@0-surge", 0, (0,), ((0,),), (0,), Policy.BIND, 1, 9000)
    return Surge("infer@0", copy, "a roll-out", phase, 1.0, "surge: fits")


# Every allowed move, in the order a surge makes them; nothing else.
ALLOWED = {(Phase.STARTING, Phase.JOINING), (Phase.JOINING, Phase.SERVING), (Phase.SERVING, Phase.LEAVING)}


def test_the_phases_table_lists_exactly_the_moves_a_surge_makes() -> None:
    assert set(PHASE_ENTERED_FROM) == set(Phase)
    assert {(f, t) for t, froms in PHASE_ENTERED_FROM.items() for f in froms} == ALLOWED


@pytest.mark.parametrize("current", list(Phase))
@pytest.mark.parametrize("to", list(Phase))
def test_change_phase_makes_every_move_the_table_lists_and_refuses_every_other(current: Phase, to: Phase,
                                                                               caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="numad_infer.lifecycle.surge")
    one = surge(current)
    if (current, to) in ALLOWED:
        assert is_legal_phase(current, to)
        one.change_phase(to, 5.0, "why")
        assert (one.phase, one.since) == (to, 5.0)  # the phase's deadline counts from the move
        assert [r.getMessage() for r in caplog.records] == [
            f"infer@0: surge {current.value} -> {to.value} (why)"]
    else:
        assert not is_legal_phase(current, to)
        with pytest.raises(TransitionError, match=f"surge {current.value} -> {to.value} is not a legal move"):
            one.change_phase(to, 5.0, "why")
        assert (one.phase, one.since) == (current, 1.0)  # refused: nothing changed


def test_a_refused_move_says_instance_from_to_and_why() -> None:
    one = surge(Phase.STARTING)
    with pytest.raises(TransitionError) as refused:
        one.change_phase(Phase.SERVING, 5.0, "skipped the join")
    assert str(refused.value) == ("infer@0: surge starting -> serving is not a legal move (skipped the join); left "
                                  "starting")


def test_no_code_sets_a_surges_phase_but_change_phase() -> None:
    """`surge.phase = ...` anywhere else would bypass the table."""
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        assert not (isinstance(leaf, ast.Attribute) and leaf.attr == "phase"
                                    and not (isinstance(leaf.value, ast.Name) and leaf.value.id == "self"
                                             and path.name == "surge.py" and path.parent.name == "lifecycle")), (
                            f"{path}:{node.lineno} sets a surge's phase outside Surge.change_phase")
