"""Surge or hold: how a planned restart of a model's only instance in rotation keeps the model
served.

- **Surge**: where the instance's memory nodes have room for a second copy, a copy on the
  new definition starts beside it: the same CPUs and memory nodes, another port. Once its
  own probe passes, the model's spare server in HAProxy (haproxy_config.surge_server) is
  pointed at it and put in rotation; once HAProxy's check marks it UP, the instance drains
  and restarts as any other; once the instance is back in rotation, the copy drains and
  stops. No request waits for the restart; the two share the cores for the overlap.
- **Hold**: where a copy does not fit (or the backend starts none), requests for the model
  wait for the instance (frontdoor/hold.py), at most `frontend.queue_timeout_s`.

The choice is made per restart and said in the journal and in `status` (Runtime.cover).
Only a restart made on purpose (a roll-out, `numa-infer restart`, a reload that changes the
instance) surges; a repair (a crash, a hang, drift) holds: the instance is not serving then,
and a copy on the same definition would likely fail the same way.

A copy that exits, or is not in rotation within `monitor.startup_grace_s`, is stopped: the
instance is not restarted and keeps serving on its old definition, the roll-out stops there
(`Surges.failed`, read by rollout.py) and status says why. The next reload (of the same
file too) tries again.

What ends a surge early: its instance held (`numa-infer tune` measures the node: the copy
would disturb it), dropped from the plan, or the front door turned off (the restart then
goes at once). A repair of the instance meanwhile (it crashed) is not absorbed: it goes
as any repair, and the copy covers it; the planned restart is then already made.
Each pass, a spare with no surge under way for its model is kept out of rotation (a
daemon restarted mid-surge, a state file that HAProxy read back).

The rules are pure, in lifecycle/surge.py: the choice (`choose`) and a surge's phases with
the moves between them (`Surge.change_phase`); this module carries them out against the
backend and the front door.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import replace

from numad_infer.backends.base import Backend
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.frontdoor.haproxy import AdminState, BackendStat
from numad_infer.frontdoor.haproxy_config import server_name
from numad_infer.frontdoor.spare import point_spare, spare_stat, spare_state
from numad_infer.host.procfs import ProcReader
from numad_infer.lifecycle.states import State, TransitionError
from numad_infer.lifecycle.surge import Cover, CoverKind, Phase, Surge, choose
from numad_infer.supervision.health import ProbeResult
from numad_infer.supervision.instance import Runtime
from numad_infer.validate.loaded import Loaded

log = logging.getLogger(__name__)

COPY_SUFFIX = "-surge"


def others_in_rotation(stat: BackendStat | None, server: str) -> int | None:
    """How many servers of a model's backend other than `server` HAProxy would send a
    request to, as last read (None: not read). 0: taking `server` out holds the model."""
    if stat is None:
        return None
    return sum(1 for name, s in stat.servers.items()
               if name != server and s.in_rotation)


def free_port(host: str) -> int:
    """A port nothing listens on now at server.host, where the copy listens (the kernel's
    pick of an ephemeral one; the copy binds it a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe_socket:
        probe_socket.bind((host, 0))
        return int(probe_socket.getsockname()[1])


class Surges:
    """The surges under way, by instance name; the supervisor starts them and steps them each pass."""

    def __init__(self, backend: Backend, frontdoor: Frontdoor, proc: ProcReader,
                 probe: Callable[[str, int, float, str], ProbeResult]) -> None:
        self.backend, self.frontdoor, self.proc, self.probe = backend, frontdoor, proc, probe
        self.active: dict[str, Surge] = {}
        self.failed: dict[str, str] = {}  # instance -> why its copy never served (the roll-out stops there)

    def first(self, loaded: Loaded, rt: Runtime, now: float, reason: str, counted: bool) -> bool:
        """Where `rt` is the only instance of its model in rotation, how its restart keeps the
        model served: a surge or a hold, chosen and said in the journal and status. True: a
        copy is starting, and `step` asks for the restart once the copy serves."""
        if not self.frontdoor.listen:
            return False
        stat = self.frontdoor.model_stats.get(rt.instance.model)
        if others_in_rotation(stat, server_name(rt.instance.name)) != 0:
            return False  # the others serve meanwhile (or HAProxy's view is unknown this pass)
        under_way = self.active.get(rt.instance.name)
        if under_way is not None and under_way.phase in (Phase.STARTING, Phase.JOINING):
            return not counted  # a repair goes now (the instance is not serving); its copy covers it later
        cover = self.cover(loaded, rt, counted) if under_way is None else Cover(
            CoverKind.HOLD, "the copy of its last restart is leaving")
        if cover.kind == CoverKind.SURGE and self.begin(loaded, rt, now, reason, cover.describe()):
            return True
        if cover.kind == CoverKind.SURGE:
            cover = Cover(CoverKind.HOLD, "its copy could not be started")
        rt.cover = cover.describe()
        log.info("%s: the only instance of its model in rotation: %s; while it restarts, requests for the model wait "
                 "for it (up to frontend.queue_timeout_s = %gs), then 503", rt.instance.name, cover.describe(),
                 loaded.config.frontend.queue_timeout_s)
        return False

    def cover(self, loaded: Loaded, rt: Runtime, counted: bool) -> Cover:
        inst = rt.instance
        nodes = ",".join(str(n) for n in inst.mems)
        room = self.proc.memory_room(inst.mems, self.backend.copy_cgroup)
        return choose(counted, self.backend.surge_refusal, loaded.memory_of(inst.model).bytes, room, nodes,
                      loaded.config.frontend.surge)

    def begin(self, loaded: Loaded, rt: Runtime, now: float, reason: str, said: str) -> bool:
        """Start a copy of `rt`'s instance on its applied definition; False when none could be started."""
        self.failed.pop(rt.instance.name, None)
        if rt.instance.name in self.active:
            return True
        try:
            copy = replace(rt.instance, name=rt.instance.name + COPY_SUFFIX, port=free_port(loaded.config.server.host))
            self.backend.start_copy(copy)
        except Exception as exc:  # no copy: the restart holds instead
            log.error("%s: cannot start a second copy for the restart: %s", rt.instance.name, exc)
            return False
        self.active[rt.instance.name] = Surge(rt.instance.name, copy, reason, Phase.STARTING, now, said, rt.pid)
        rt.copy = copy.name
        _show(rt, self.active[rt.instance.name])
        log.info("%s: %s: surge: %s started on port %d, the same CPUs; the instance restarts once it serves",
                 rt.instance.name, reason, copy.name, copy.port)
        return True

    def step(self, loaded: Loaded, runtimes: dict[str, Runtime], now: float) -> list[tuple[str, str]]:
        """One pass over the surges under way; returns the (instance, reason) restarts that
        may go now (their copy serves)."""
        go: list[tuple[str, str]] = []
        for name, surge in list(self.active.items()):
            rt = runtimes.get(name)
            try:
                if self._step_one(loaded, rt, surge, now):
                    go.append((name, surge.reason))
            except TransitionError as exc:  # a bug: logged for this surge, the others go on
                log.error("%s", exc)
            if rt is not None and name in self.active:
                _show(rt, surge)
        self._sweep_spares()
        return go

    def _step_one(self, loaded: Loaded, rt: Runtime | None, surge: Surge, now: float) -> bool:
        """One surge one step on; True: its instance's restart may go now."""
        if rt is None:
            self._end(None, surge, "its instance is no longer planned")
        elif rt.supervision.state == State.HELD or (rt.supervision.drain is not None
                                                    and rt.supervision.drain.hold_by is not None):
            self._end(rt, surge, "its instance is held: the copy would disturb what the holder measures")
        elif not self.frontdoor.listen:
            go = surge.phase in (Phase.STARTING, Phase.JOINING) and rt.pid == surge.pid
            self._end(rt, surge, "the front door is off")
            return go  # no front door to cover: the restart goes now
        elif surge.phase == Phase.STARTING:
            self._starting(loaded, rt, surge, now)
        elif surge.phase == Phase.JOINING:
            return self._joining(loaded, rt, surge, now)
        elif surge.phase == Phase.SERVING:
            self._serving(loaded, rt, surge, now)
        else:
            self._leaving(loaded, rt, surge, now)
        return False

    def _sweep_spares(self) -> None:
        """Out of rotation, every spare whose model has no surge under way: one left READY
        (a daemon restarted mid-surge, a stop that HAProxy did not answer) points at a port
        that anything may take next."""
        if self.frontdoor.stats is None:
            return
        surging = {s.copy.model for s in self.active.values()}
        for model in self.frontdoor.backends:
            spare = spare_stat(self.frontdoor, model)
            if model not in surging and spare is not None and spare.admin != AdminState.MAINT:
                spare_state(self.frontdoor, model, AdminState.MAINT)

    def _alive(self, surge: Surge) -> tuple[int | None, bool, str]:
        """The copy's process, whether it runs or is being started (systemd), and its state in words."""
        seen = self.backend.observe([surge.copy.name])[surge.copy.name]
        return seen.pid, seen.pid is not None or seen.pending, seen.description

    def _starting(self, loaded: Loaded, rt: Runtime, surge: Surge, now: float) -> None:
        cfg = loaded.config
        pid, alive, description = self._alive(surge)
        if not alive:
            self._fail(rt, surge, f"its copy exited before it served ({description})")
            return
        if pid is None:
            result = ProbeResult(False, 0.0, description)
        else:
            owner = self.proc.port_owner(cfg.server.host, surge.copy.port, pid)
            result = self.probe(cfg.server.host, surge.copy.port, cfg.tuning.probe_timeout_s,
                                loaded.engine.liveness_path) if owner.ours else ProbeResult(False, 0.0, owner.detail)
        if result.ok and point_spare(self.frontdoor, rt.instance.model, cfg.server.host, surge.copy.port):
            surge.change_phase(Phase.JOINING, now, "its probe passed, the spare points at it")  # STARTING -> JOINING
        elif now - surge.since > cfg.monitor.startup_grace_s:  # whatever held it: never a surge without end
            why = result.error if not result.ok else "the front door did not take its spare server"
            self._fail(rt, surge, f"its copy was not healthy within monitor.startup_grace_s = "
                                  f"{cfg.monitor.startup_grace_s:g}s ({why})")

    def _joining(self, loaded: Loaded, rt: Runtime, surge: Surge, now: float) -> bool:
        cfg = loaded.config
        spare = spare_stat(self.frontdoor, rt.instance.model)
        # UP with a check that passed: a server leaving maintenance is UP before its first one.
        if spare is not None and spare.in_rotation and spare.check not in ("", "INI"):
            surge.change_phase(Phase.SERVING, now, "HAProxy's check marked it UP")  # JOINING -> SERVING
            if rt.pid != surge.pid or rt.supervision.state != State.HEALTHY:
                # Repaired (or being repaired) meanwhile, on the applied definition: the copy covers that.
                log.info("%s: surge: %s is in rotation while the instance is repaired", rt.instance.name,
                         surge.copy.name)
                return False
            log.info("%s: surge: %s is in rotation: the instance drains and restarts", rt.instance.name,
                     surge.copy.name)
            return True
        if not self._alive(surge)[1]:
            self._fail(rt, surge, "its copy exited before HAProxy's check passed")
        elif now - surge.since > cfg.monitor.startup_grace_s:
            self._fail(rt, surge, f"HAProxy's check of its copy did not pass within monitor.startup_grace_s = "
                                  f"{cfg.monitor.startup_grace_s:g}s")
        else:
            point_spare(self.frontdoor, rt.instance.model, cfg.server.host, surge.copy.port)  # again after a reload
        return False

    def _serving(self, loaded: Loaded, rt: Runtime, surge: Surge, now: float) -> None:
        stat = None if self.frontdoor.stats is None else self.frontdoor.stats.servers.get(
            server_name(rt.instance.name))
        back = rt.supervision.state == State.HEALTHY and stat is not None and stat.in_rotation
        if not self._alive(surge)[1]:
            log.error("%s: surge: its copy exited while the instance restarted: requests wait for the instance "
                      "(hold)", rt.instance.name)
            self._end(rt, surge, "its copy exited")
            rt.cover = f"{surge.said} (its copy exited while the instance restarted: held)"
        elif back:
            spare_state(self.frontdoor, rt.instance.model, AdminState.DRAIN)
            surge.change_phase(Phase.LEAVING, now, "the instance serves again")  # SERVING -> LEAVING
            log.info("%s: surge: the instance serves again: %s drains, then stops", rt.instance.name,
                     surge.copy.name)
        else:
            point_spare(self.frontdoor, rt.instance.model, loaded.config.server.host, surge.copy.port)

    def _leaving(self, loaded: Loaded, rt: Runtime, surge: Surge, now: float) -> None:
        spare = spare_stat(self.frontdoor, surge.copy.model)
        busy = None if spare is None else spare.in_flight + spare.queued  # None: not read, so maybe busy
        if busy != 0 and now - surge.since < loaded.config.frontend.drain_timeout_s:
            return
        self._end(rt, surge, "its requests are answered" if busy == 0 else
                  "frontend.drain_timeout_s is over")
        rt.cover = f"{surge.said} (done: the instance serves again, its copy stopped)"

    def _fail(self, rt: Runtime, surge: Surge, why: str) -> None:
        log.error("%s: surge failed: %s; the instance is not restarted and keeps serving on its old definition",
                  rt.instance.name, why)
        self.failed[rt.instance.name] = f"surge failed: {why}; not restarted, it serves on its old definition"
        rt.cover = self.failed[rt.instance.name]
        self._end(rt, surge, why)

    def _end(self, rt: Runtime | None, surge: Surge, why: str) -> None:
        if rt is not None:
            rt.copy = None
        spare_state(self.frontdoor, surge.copy.model, AdminState.MAINT)
        try:
            self.backend.stop(surge.copy.name)
        except Exception as exc:
            log.error("%s: cannot stop it: %s", surge.copy.name, exc)
        del self.active[surge.instance]
        log.info("%s: surge over: %s stopped (%s)", surge.instance, surge.copy.name, why)


def _show(rt: Runtime, surge: Surge) -> None:
    rt.cover = f"{surge.said} ({surge.copy.name} on port {surge.copy.port}: {surge.phase.value})"
