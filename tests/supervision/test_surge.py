"""Surge or hold for a planned restart of a model's only instance (supervision/surge.py, issue 40).

The rule (`choose`) and the phases' table are tests/lifecycle/test_surge.py's; here the
reconcile loop over a stand-in HAProxy that keeps its servers' states as the runtime API
would, and a recording backend: a copy starts, joins,
serves while the instance restarts, then leaves; a copy that never becomes healthy is
stopped and the instance keeps serving; a copy that does not fit is not tried. The real
HAProxy and llama-server run it in tests/e2e/test_frontdoor.py."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from numad_infer.frontdoor.haproxy import AdminState, BackendStat, ServerStat
from numad_infer.lifecycle.states import State
from numad_infer.lifecycle.surge import MARGIN_BYTES
from numad_infer.plan.model import Instance
from numad_infer.plan.placement import make_plan
from numad_infer.supervision.health import ProbeResult
from numad_infer.supervision.reconcile import Reconciler
from tests.fakes import FakeProc, RecordingBackend, cfg, loaded_for, served_of, three_nodes

GIB = 1 << 30


class Api:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.answer = ""  # HAProxy's answer to `set server ... addr`: "" as for a change

    def command(self, line: str) -> str:
        self.lines.append(line)
        return self.answer


@dataclass
class SpareDoor:
    """HAProxy's view as the daemon reads it: one backend, the instance's server and the
    spare; states set through the runtime API land in it, as they would in HAProxy (whose
    check passes at once here)."""
    listen: str = "127.0.0.1:8000"
    backends: dict[str, str] = field(default_factory=lambda: {"": "instances"})
    api: Api = field(default_factory=Api)
    served_alone: list[bool] = field(default_factory=list)  # after each change: is any server in rotation
    copy_answers: bool = True  # does a copy's probe pass

    def __post_init__(self) -> None:
        self.stats = BackendStat(servers={"infer-0": ServerStat("infer-0", "UP", 0, 0, 0),
                                          "surge-instances": ServerStat("surge-instances", "MAINT", 0, 0, 0)},
                                  queued=0, in_flight=0)
        self.model_stats = {"": self.stats}

    passes: list[str] | None = None

    def observe(self) -> None:
        """The next read: the checks of servers just put in rotation have passed."""
        for name in self.passes or []:
            self.stats.servers[name] = replace(self.stats.servers[name], check="L7OK")
        self.passes = []

    def in_flight(self, instance: Instance) -> int:
        return 0

    def set_state(self, instance: Instance, state: AdminState) -> None:
        self.set_server("instances", instance.name.replace("@", "-"), state)

    def set_server(self, backend: str | None, name: str, state: AdminState) -> bool:
        now = self.stats.servers[name]
        self.stats.servers[name] = ServerStat(name, {AdminState.READY: "UP", AdminState.DRAIN: "DRAIN",
                                                     AdminState.MAINT: "MAINT"}[state], 0, 0, now.served,
                                              "INI" if now.status == "MAINT" else now.check)
        if state == AdminState.READY and self.passes is not None:
            self.passes.append(name)  # HAProxy's first check of it comes with the next read
        self.served_alone.append(any(s.status == "UP" for s in self.stats.servers.values()))
        return True


@dataclass
class CopyingBackend(RecordingBackend):
    surge_refusal: str | None = None

    def start_copy(self, copy: Instance) -> None:
        self.calls.append(("start_copy", f"{copy.name}:{copy.port}"))
        self.running[copy.name] = self.next_pid = self.next_pid + 1


class RoomyProc(FakeProc):
    def __init__(self, room: int | None) -> None:
        super().__init__()
        self.room = room

    def memory_room(self, nodes: tuple[int, ...], cgroup: str | None = None) -> int | None:
        return self.room


def one_instance(room: int | None, copy_answers: bool = True) -> tuple[Reconciler, CopyingBackend, SpareDoor]:
    """One instance healthy behind the stand-in HAProxy; `copy_answers`: whether a copy's probe passes."""
    config = cfg("[placement]\nnodes = [0]\n")
    loaded = loaded_for(config, make_plan(config, three_nodes(), served=served_of(config)))
    backend, door = CopyingBackend(), SpareDoor()
    (port,) = [i.port for i in loaded.plan.instances]

    door.copy_answers = copy_answers

    def probe(host: str, p: int, timeout: float, path: str) -> ProbeResult:
        ok = door.copy_answers or p == port
        return ProbeResult(ok, 0.001, "" if ok else "HTTP 503")

    rec = Reconciler(backend, RoomyProc(room), frontdoor=door, probe=probe)  # type: ignore[arg-type]
    rec.apply(loaded, 0.0)
    for t in (1.0, 2.0):
        rec.monitor(t)
    assert rec.runtimes["infer@0"].supervision.state == State.HEALTHY
    backend.calls.clear()
    return rec, backend, door


def test_a_copy_serves_while_the_only_instance_restarts_then_leaves() -> None:
    rec, backend, door = one_instance(room=8 * GIB)
    assert rec.rollout.request(["infer@0"], rec.runtimes, rec.holds) is None
    rec.roll(3.0)
    assert [c[0] for c in backend.calls] == ["start_copy"]  # not restarted yet: its copy starts first
    rt = rec.runtimes["infer@0"]
    assert rt.cover is not None and rt.cover.startswith("surge: a second copy fits") and "starting" in rt.cover
    assert rt.copy == "infer@0-surge"
    assert rec.rollout.left(("infer@0",), rec.runtimes) == ("infer@0",)
    for t in range(4, 12):
        rec.monitor(float(t))
    kinds = [c[0] for c in backend.calls]
    assert kinds == ["start_copy", "restart", "stop"], backend.calls
    assert backend.calls[2] == ("stop", "infer@0-surge")
    port = int(backend.calls[0][1].split(":")[1])
    assert f"set server instances/surge-instances addr 127.0.0.1 port {port}" in door.api.lines
    assert all(door.served_alone), "a moment with no server in rotation: requests would have waited"
    assert door.stats.servers["surge-instances"].status == "MAINT"
    assert rt.supervision.state == State.HEALTHY and not rec.supervisor.surges.active  # type: ignore[union-attr]
    assert rt.cover.endswith("(done: the instance serves again, its copy stopped)"), rt.cover
    assert rt.copy is None
    assert rec.rollout.left(("infer@0",), rec.runtimes) == ()


def test_a_copy_that_never_becomes_healthy_is_stopped_and_the_instance_keeps_serving() -> None:
    rec, backend, door = one_instance(room=8 * GIB, copy_answers=False)
    assert rec.rollout.request(["infer@0"], rec.runtimes, rec.holds) is None
    rec.roll(3.0)
    grace = rec.loaded.config.monitor.startup_grace_s  # type: ignore[union-attr]
    for t in (4.0, 5.0, 3.0 + grace + 1, 3.0 + grace + 2):
        rec.monitor(t)
    assert backend.calls == [backend.calls[0], ("stop", "infer@0-surge")], backend.calls  # never restarted
    rt = rec.runtimes["infer@0"]
    assert rt.supervision.state == State.HEALTHY and door.stats.servers["infer-0"].status == "UP"
    assert rt.cover is not None and rt.cover.startswith("surge failed: its copy was not healthy within "
                                                        "monitor.startup_grace_s"), rt.cover
    assert rec.rollout.left(("infer@0",), rec.runtimes) == ("infer@0",)  # `restart` does not say it done
    # The next reload, of the same file, tries again: this time the copy serves.
    door.copy_answers = True
    rec.apply(rec.loaded, 3.0 + grace + 3)  # type: ignore[arg-type]
    for t in range(5, 15):
        rec.monitor(3.0 + grace + t)
    assert [c[0] for c in backend.calls][2:] == ["start_copy", "restart", "stop"], backend.calls
    assert rt.cover.endswith("its copy stopped)") and rec.rollout.left(("infer@0",), rec.runtimes) == ()


def test_a_surge_whose_spare_haproxy_refuses_ends_at_the_grace_period() -> None:
    """The copy answers but HAProxy never takes the spare (a config without it still running):
    the surge ends within startup_grace_s, never left running for good."""
    rec, backend, door = one_instance(room=8 * GIB)
    door.api.answer = "No such server."
    assert rec.rollout.request(["infer@0"], rec.runtimes, rec.holds) is None
    rec.roll(3.0)
    grace = rec.loaded.config.monitor.startup_grace_s  # type: ignore[union-attr]
    for t in (4.0, 5.0, 3.0 + grace + 1):
        rec.monitor(t)
    assert [c[0] for c in backend.calls] == ["start_copy", "stop"] and not rec.supervisor.surges.active  # type: ignore[union-attr]
    assert "the front door did not take its spare server" in (rec.runtimes["infer@0"].cover or "")


def test_a_hold_during_a_surge_stops_the_copy_and_makes_no_restart() -> None:
    """`numa-infer tune` holds the node while the copy starts: the copy would disturb the
    measurement; the instance is stopped for the hold, not restarted by the surge."""
    rec, backend, door = one_instance(room=8 * GIB)
    assert rec.rollout.request(["infer@0"], rec.runtimes, rec.holds) is None
    rec.roll(3.0)
    rec.holds = {"infer@0": "numa-infer tune"}
    for t in range(4, 9):
        rec.monitor(float(t))
    assert [c[0] for c in backend.calls] == ["start_copy", "stop", "stop"], backend.calls
    assert ("stop", "infer@0-surge") in backend.calls and ("stop", "infer@0") in backend.calls
    assert rec.runtimes["infer@0"].supervision.state == State.HELD and not rec.supervisor.surges.active  # type: ignore[union-attr]


def test_a_copy_that_does_not_fit_is_not_tried_the_restart_holds() -> None:
    rec, backend, door = one_instance(room=MARGIN_BYTES // 2)
    assert rec.rollout.request(["infer@0"], rec.runtimes, rec.holds) is None
    rec.roll(3.0)
    rec.monitor(4.0)  # drained (nothing in flight), then restarted
    assert [c[0] for c in backend.calls] == ["restart"]
    rt = rec.runtimes["infer@0"]
    assert rt.cover is not None and rt.cover.startswith("hold: a second copy does not fit"), rt.cover
    assert door.stats.servers["surge-instances"].status == "MAINT"


def test_a_model_whose_only_instance_restarts_behind_its_copy_is_served() -> None:
    """status tells the truth during a surge: the copy in rotation serves the model, no hold is said."""
    from numad_infer.status.records import InstanceStatus, model_health
    restarting = InstanceStatus("infer@0", 0, (0,), (0,), 1, 8080, None, State.RESTARTING, rotation="MAINT")
    assert model_health((restarting,), frontdoor=True, hold_s=30) == (
        False, "no instance in rotation (1 restarting); its requests wait up to 30s for one (hold), then 503")
    for copy, served in (("UP", True), ("DOWN", False), ("MAINT", False)):
        healthy, _ = model_health((replace(restarting, copy_rotation=copy),), frontdoor=True, hold_s=30)
        assert healthy is served, copy
