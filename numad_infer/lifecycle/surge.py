"""A surge's rules, pure (supervision/surge.py carries them out): surge or hold for a
restart of a model's only instance in rotation (`choose`), and a surge's phases with the
moves between them.

Every phase change goes through `Surge.change_phase`, which refuses a move that
`PHASE_ENTERED_FROM` does not list (TransitionError, as states.py's `change_state`) and
logs the others (instance, from, to, why); each call site names its move in a
`# FROM -> TO` comment. A surge begins in STARTING and ends by leaving `Surges.active`
from any phase: neither is a move.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum

from numad_infer.lifecycle.states import TransitionError
from numad_infer.plan.model import Instance

log = logging.getLogger(__name__)

# Room kept free beside the copy: the estimate is the planner's, and a node filled to the
# last page swaps or meets the OOM killer (its kernel and other processes take memory too).
MARGIN_BYTES = 512 << 20


class CoverKind(str, Enum):
    SURGE = "surge"
    HOLD = "hold"


@dataclass(frozen=True)
class Cover:
    """How one restart keeps its model served, and why that way, as the journal and status say it."""
    kind: CoverKind
    why: str

    def describe(self) -> str:
        return f"{self.kind.value}: {self.why}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"  # a small model's need is not "0.0 GiB"


def choose(counted: bool, refusal: str | None, need: int, room: int | None, nodes: str, wanted: bool = True) -> Cover:
    """Surge or hold for a restart of a model's only instance in rotation.
    `counted`: a repair; `refusal`: why the backend starts no copy; `need`: what one
    instance holds (the planner's estimate); `room`: what its nodes can give now (None:
    unknown); `wanted`: frontend.surge."""
    if not wanted:
        return Cover(CoverKind.HOLD, "frontend.surge = false")
    if counted:
        return Cover(CoverKind.HOLD, "a repair: the instance is not serving, a copy on the same definition would not "
                                     "either")
    if refusal is not None:
        return Cover(CoverKind.HOLD, refusal)
    if room is None:
        return Cover(CoverKind.HOLD, f"the free memory of node(s) {nodes} cannot be read: no second copy is tried")
    if room < need + MARGIN_BYTES:
        return Cover(CoverKind.HOLD, f"a second copy does not fit: it needs {_gib(need)} and a margin of "
                                     f"{_gib(MARGIN_BYTES)}, {_gib(room)} is free for it on node(s) {nodes} "
                                     "(within any cgroup memory limit)")
    return Cover(CoverKind.SURGE, f"a second copy fits ({_gib(need)} of the {_gib(room)} free on node(s) {nodes}): "
                                  "it serves while the instance restarts")


class Phase(str, Enum):
    """A surge's phases, in order: STARTING -> JOINING -> SERVING -> LEAVING."""

    STARTING = "starting"  # the copy's process runs; its own probe has not passed yet
    JOINING = "joining"  # the spare server points at it; HAProxy's check has not marked it UP yet
    SERVING = "serving"  # in rotation: the instance drains and restarts behind it
    LEAVING = "leaving"  # the instance is back: the copy drains out of rotation, then stops


# Each phase and the phases it may be entered from. Unlike an instance's state, staying is
# not a move: a phase's start (`Surge.since`) is what its deadline counts from.
PHASE_ENTERED_FROM: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset(),  # where a surge begins (Surges.begin), never entered again
    Phase.JOINING: frozenset({Phase.STARTING}),  # the copy's probe passed, the spare points at it
    Phase.SERVING: frozenset({Phase.JOINING}),  # HAProxy's check marked the spare UP
    Phase.LEAVING: frozenset({Phase.SERVING}),  # the instance serves again
}


def is_legal_phase(current: Phase, to: Phase) -> bool:
    return current in PHASE_ENTERED_FROM[to]


@dataclass
class Surge:
    instance: str
    copy: Instance
    reason: str  # the restart's, as the journal says it
    phase: Phase
    since: float  # when this phase began
    said: str  # the choice in words (Cover.describe), which status shows with the phase
    pid: int | None = None  # the instance's process when the surge began: restarted once, not twice

    def change_phase(self, to: Phase, now: float, why: str) -> None:
        """The one place a phase changes: refused when the table forbids it (TransitionError,
        nothing changed), else logged, with the reason."""
        if not is_legal_phase(self.phase, to):
            raise TransitionError(f"{self.instance}: surge {self.phase.value} -> {to.value} is not a legal move "
                                  f"({why}); left {self.phase.value}")
        log.debug("%s: surge %s -> %s (%s)", self.instance, self.phase.value, to.value, why)
        self.phase, self.since = to, now
