"""Bringing the running set to a plan: stop what went, start what came, adopt what runs,
and restart what changed, one at a time behind a front door."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from numad_infer.backends.base import Backend
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.host.procfs import ProcReader
from numad_infer.lifecycle.states import IN_TRANSITION, State, Supervision
from numad_infer.lifecycle.surge import Phase
from numad_infer.plan.model import Instance, PlanDiff, diff_plans
from numad_infer.supervision.instance import PromptTally, Runtime
from numad_infer.supervision.supervisor import Supervisor, isolated
from numad_infer.validate.loaded import Loaded

log = logging.getLogger(__name__)


@dataclass
class Retiring:
    """An instance no longer planned that still finishes the requests it has."""
    runtime: Runtime
    since: float
    timeout_s: float


class Rollout:
    """Keeps what it needs to roll, not the configuration: the plan, its settings and the
    engine come with the applied `Loaded` each call is handed."""

    def __init__(self, backend: Backend, frontdoor: Frontdoor | None, supervisor: Supervisor) -> None:
        self.backend, self.frontdoor, self.supervisor = backend, frontdoor, supervisor
        # The applied instances' definitions (what the next plan is compared with); None
        # until a plan is applied: then it is compared with what a previous daemon left.
        self.specs: dict[str, str] | None = None
        self.rolling: list[str] = []  # definition changed, restart still to come (one at a time)
        self.rolled: list[str] = []  # restarted by the current rollout: must be healthy before the next
        self.why = "definition changed"  # what the rollout under way is for, in its log lines
        self._stopped_said = False  # the rollout's stop was said in the journal once
        self.retiring: dict[str, Retiring] = {}

    def sync(self, loaded: Loaded) -> tuple[PlanDiff, dict[str, str]]:
        """The difference to the plan, with the definitions written: if they cannot be (or
        systemd cannot reload them), this raises before anything running was touched."""
        new_specs = self.backend.specs(loaded)
        old_specs = self.specs if self.specs is not None else self.backend.current_specs(loaded)
        diff = diff_plans(old_specs, new_specs)
        self.backend.sync(loaded)
        return diff, new_specs

    def apply(self, loaded: Loaded, diff: PlanDiff, specs: dict[str, str], runtimes: dict[str, Runtime],
              holds: dict[str, str], now: float, why: str = "definition changed") -> None:
        """Bring the running set to `loaded`'s plan (`diff`, `specs`: what `sync` returned for it)."""
        plan, drain_timeout_s = loaded.plan, loaded.config.frontend.drain_timeout_s
        for name in [n for n in self.retiring if n in {i.name for i in plan.instances}]:
            # Planned again while it still finished its requests: the new one needs its port.
            isolated(name, "stop", functools.partial(self.backend.stop, name))
            del self.retiring[name]
        for name in diff.removed:
            self._remove(name, runtimes.pop(name, None), now, drain_timeout_s)
        self.specs = specs
        try:
            running = {name: seen.pid for name, seen in self.backend.observe([i.name for i in plan.instances]).items()}
        except Exception as exc:  # unknown: start (a no-op on a running unit); monitoring adopts the PID later
            log.error("cannot read instance states before starting them: %s", exc)
            running = {}
        for instance in plan.instances:
            self._bring_up(instance, runtimes, instance.name in diff.changed, instance.name in holds,
                           running.get(instance.name), now)
        self.rolling = [name for name in self.rolling if name in runtimes]
        if diff.changed:  # a new rollout; one still under way continues with the new definition
            self.rolled, self._stopped_said, self.why = [], False, why
        self._retry_failed_surges(runtimes)
        self.roll(loaded, runtimes, holds, now)

    def _bring_up(self, instance: Instance, runtimes: dict[str, Runtime], changed: bool, held: bool,
                  already: int | None, now: float) -> None:
        """Start (or adopt) one instance of the plan; a changed one waits for its turn to restart."""
        runtime = runtimes.get(instance.name)
        if runtime is None or changed:
            # Same process until the restart (or the drain before it) replaces it.
            # Its last probe (may its slots be saved before the restart) and its prompt tally stay too.
            runtime = runtimes[instance.name] = Runtime(
                instance, supervision=runtime.supervision if runtime else Supervision(name=instance.name),
                pid=runtime.pid if runtime else None, last_probe=runtime.last_probe if runtime else None,
                prompt=runtime.prompt if runtime else PromptTally(),
                # A surge under way (surge.py) goes on: its copy still serves for this instance.
                cover=runtime.cover if runtime else None, copy=runtime.copy if runtime else None)
        runtime.instance = instance
        runtime.supervision.on_reload()
        if changed:
            if instance.name not in self.rolling:
                self.rolling.append(instance.name)
            return
        if held:
            return  # stays stopped until released (monitor starts it then)
        isolated(instance.name, "start", lambda: self.backend.start(instance))
        sup = runtime.supervision
        if already is not None:
            if runtime.pid is None:
                log.info("%s: adopted running pid %d", instance.name, already)
            runtime.pid = already
            if sup.state == State.STOPPED:
                # Adopted: give it the grace period, the first good probe makes it healthy.
                sup.on_started(now, f"adopted running pid {already}")  # STOPPED -> STARTING
        elif sup.state == State.STOPPED:
            sup.on_started(now)  # STOPPED -> STARTING

    def _remove(self, name: str, runtime: Runtime | None, now: float, drain_timeout_s: float) -> None:
        """An instance the new plan drops (a reload, a CPU or cpuset change). Behind a front
        door it leaves the rotation with this pass's HAProxy reload and is stopped once the
        requests it has are answered (`retire`): a dropped node loses no request in flight."""
        serving = runtime is not None and runtime.pid is not None and runtime.supervision.state == State.HEALTHY
        if self.frontdoor is None or not self.frontdoor.listen or not serving or drain_timeout_s <= 0:
            isolated(name, "stop", lambda: self.backend.stop(name))
            return
        assert runtime is not None
        log.info("%s: no longer planned: out of rotation; stopping it once its requests are answered (at most %gs)",
                 name, drain_timeout_s)
        self.retiring[name] = Retiring(runtime, now, drain_timeout_s)

    def retire(self, proc: ProcReader, now: float) -> None:
        """Stop the instances no longer planned whose clients are gone, or whose time is up."""
        for name, leaving in list(self.retiring.items()):
            # By its process: only connections its own listener accepted count (a local
            # user's on the same port at another address would hold it up to the timeout).
            pid = leaving.runtime.pid
            open_now = 0 if pid is None else proc.open_connections(leaving.runtime.instance.port, pid)
            if open_now and now - leaving.since < leaving.timeout_s:
                continue
            if open_now:
                log.warning("%s: %d connection(s) still open after %gs: stopping it anyway", name, open_now,
                            leaving.timeout_s)
            else:
                log.info("%s: its requests are answered: stopping it", name)
            isolated(name, "stop", functools.partial(self.backend.stop, name))
            del self.retiring[name]

    def roll(self, loaded: Loaded, runtimes: dict[str, Runtime], holds: dict[str, str], now: float) -> None:
        """Restart instances whose definition changed: behind a front door one at a time, so
        the others keep serving; without one, all at once (nothing routes around them).
        `loaded`: the applied value, whose definition they restart on.

        The next one goes only once every instance restarted so far is healthy on the new
        definition: one that does not come up (a bad extra_args, a model the engine cannot
        load) stops the rollout there, with the others still serving on the old one.
        """
        while self.rolling:
            if self.frontdoor is not None and self.frontdoor.listen and not self._may_go_on(runtimes):
                return
            if self.rolling[0] in holds:
                return  # held: its restart waits for the release (it starts on the new definition then)
            name = self.rolling.pop(0)
            self.rolled.append(name)
            log.info("%s: %s: restarting", name, self.why)
            self.supervisor.restart(loaded, runtimes[name], now, self.why, counted=False)

    def request(self, names: list[str], runtimes: dict[str, Runtime], holds: dict[str, str]) -> str | None:
        """`numa-infer restart`: roll `names` (all instances when empty) as a changed
        definition is rolled, one at a time behind the front door. The reason it is refused
        (None when accepted): a rollout already under way is never cut into, since its
        order (the next only once the last is healthy) is what keeps requests served."""
        if self.rolling:
            return (f"a rolling restart is under way ({', '.join(self.rolling)} still to restart, after a reload or "
                    "a new model file): try again once `numa-infer status` shows it over")
        wanted = names or list(runtimes)
        unknown = [n for n in wanted if n not in runtimes]
        if unknown:
            return f"no instance named {', '.join(unknown)}; the instances are {', '.join(runtimes) or 'none'}"
        held = [f"{n} (held by {holds[n]})" for n in wanted if n in holds]
        if held:
            return f"{', '.join(held)}: held stopped; it starts on its own once the hold is released"
        self.rolling, self.rolled, self._stopped_said = list(dict.fromkeys(wanted)), [], False
        if self.supervisor.surges is not None:
            for name in self.rolling:
                self.supervisor.surges.failed.pop(name, None)
        self.why = "restart requested"
        log.info("restart requested: %s, one at a time", ", ".join(self.rolling))
        return None

    def left(self, names: tuple[str, ...], runtimes: dict[str, Runtime]) -> tuple[str, ...]:
        """Which of `names` are not yet restarted and healthy again."""
        return tuple(n for n in names if n in runtimes and (
            n in self.rolling or runtimes[n].supervision.state != State.HEALTHY or n in set().union(*self._surging())))

    def _retry_failed_surges(self, runtimes: dict[str, Runtime]) -> None:
        """Each reload (the same file too) restarts again the instances whose surge failed:
        they still serve on their old definition (surge.py)."""
        surges = self.supervisor.surges
        if surges is None:
            return
        for name in list(surges.failed):
            del surges.failed[name]
            if name in runtimes and name not in self.rolling:
                self.rolling.append(name)

    def _surging(self) -> tuple[set[str], set[str]]:
        """Instances whose restart waits for its copy to serve (surge.py), and those whose copy
        never did (so they were not restarted: they serve on the old definition)."""
        surges = self.supervisor.surges
        if surges is None:
            return set(), set()
        return {n for n, s in surges.active.items() if s.phase in (Phase.STARTING, Phase.JOINING)}, set(surges.failed)

    def _may_go_on(self, runtimes: dict[str, Runtime]) -> bool:
        if any(rt.supervision.state in IN_TRANSITION for rt in runtimes.values()):
            return False
        waiting, failed = self._surging()
        if waiting:  # a copy starting (of this roll-out or the last): one at a time, for memory's sake
            return False
        stuck = [n for n in self.rolled if n in runtimes and (runtimes[n].supervision.state != State.HEALTHY
                                                              or n in failed)]
        if stuck and not self._stopped_said:
            log.error("rolling restart stopped: %s not healthy on the new definition; %s keep the old one "
                      "until it is (or until a reload fixes the configuration)",
                      ", ".join(stuck), ", ".join(self.rolling))
            self._stopped_said = True
        return not stuck
