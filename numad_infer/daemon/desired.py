"""The plan the daemon runs, and how it got there: load it through the one pipeline, apply
it, reload it on SIGHUP, re-plan when the machine changes; and the bookkeeping that status
reports (generation, the last reload's result, warnings)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from numad_infer.backends.base import Backend
from numad_infer.config.models import ServedModel
from numad_infer.config.schema import Config
from numad_infer.engines import Engine
from numad_infer.errors import NumaInferError
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.frontdoor.haproxy_config import Paths
from numad_infer.host.identity import BackendKind
from numad_infer.plan.model import Placed, PlanDiff
from numad_infer.status import metrics
from numad_infer.status.records import ReloadResult
from numad_infer.status.statefile import read_status
from numad_infer.supervision import holds
from numad_infer.supervision.reconcile import Reconciler
from numad_infer.topology.cgroup_limits import Allowed
from numad_infer.topology.sysfs import SysfsReader
from numad_infer.util.cpuset import format_list
from numad_infer.validate import pipeline
from numad_infer.validate.loaded import Loaded

log = logging.getLogger(__name__)

# A file being copied changes size and modification time with every write: a changed model
# or engine is rolled out once it has held still this long (and passes the pipeline, which
# refuses a GGUF file shorter than its tensor table).
SETTLE_S = 5.0
ARTIFACTS_CHANGED = "model or engine changed"
ARTIFACTS_CHECK = "model or engine check"
# The files are the applied ones again (a bad file moved over the model, then the original
# moved back): what refused the one in between is re-validated, and cleared when it passes.
ARTIFACTS_RESTORED = "model or engine back as loaded"


class Validation(Protocol):
    """What the re-plan reads through the pipeline: a seam, so a test can stand in for the
    machine (the model file, the cgroup) without patching the module."""

    def load(self, source: str, kind: BackendKind, sysfs: SysfsReader, running: Sequence[Placed],
             frontdoor: Paths) -> Loaded: ...
    def allowed(self, kind: BackendKind) -> Allowed: ...
    def artifacts(self, served: tuple[ServedModel, ...], engine: Engine) -> str: ...


class Pipeline:
    """The real one: validate/pipeline.py."""

    def load(self, source: str, kind: BackendKind, sysfs: SysfsReader, running: Sequence[Placed],
             frontdoor: Paths) -> Loaded:
        return pipeline.load(source, kind, sysfs, running=running, frontdoor=frontdoor)

    def allowed(self, kind: BackendKind) -> Allowed:
        return pipeline.read_allowed(kind)

    def artifacts(self, served: tuple[ServedModel, ...], engine: Engine) -> str:
        return pipeline.current_artifacts(served, engine)


class PlanState:
    def __init__(self, config_path: str, sysfs: SysfsReader, backend: Backend, reconciler: Reconciler,
                 frontdoor: Frontdoor, endpoint: metrics.Endpoint, state_file: Path,
                 validation: Validation | None = None) -> None:
        self.config_path, self.sysfs, self.backend = config_path, sysfs, backend
        self.validation: Validation = validation or Pipeline()
        self.reconciler, self.frontdoor, self.endpoint, self.state_file = reconciler, frontdoor, endpoint, state_file
        self.online: frozenset[int] | None = None  # the CPUs it was planned on
        self.allowed: Allowed | None = None  # what the instances' cgroup allowed then
        self.generation = 0  # bumped by every start and reload, done or refused (`numa-infer reload` waits on it)
        self.last_reload: ReloadResult | None = None
        self.warnings: tuple[str, ...] = ()
        self._changed: tuple[str, float] | None = None  # artifacts seen changed, and since when
        self._refused: str | None = None  # artifacts the pipeline refused: tried again only when they change
        self._failing: dict[str, str] = {}  # re-plan steps that raised at the last pass, and what

    @property
    def loaded(self) -> Loaded | None:
        """The configuration running now: the reconciler's applied value (Reconciler.apply),
        read there, never kept a second time here."""
        return self.reconciler.loaded

    @property
    def config(self) -> Config | None:
        return None if self.loaded is None else self.loaded.config

    def load(self) -> Loaded:
        """The pipeline every command uses (validate/pipeline.py); refused there, nothing changes here."""
        running = self.loaded.plan.instances if self.loaded is not None else self._left_running()
        return self.validation.load(self.config_path, self.backend.kind, self.sysfs, running, self.frontdoor.paths)

    def _left_running(self) -> Sequence[Placed]:
        """At start: the instances the last daemon ran, as its state file says (kept across
        a daemon restart; a reboot empties /run). With `[[models]]`, where they still fit,
        they keep their cores and ports, so the instances a restarted daemon adopts are not
        restarted because a reload before it had removed a model."""
        try:
            left = read_status(self.state_file)
        except NumaInferError:  # not a state file of ours: nothing to keep, and the start says so later
            return ()
        return () if left is None else left.instances

    def apply(self, loaded: Loaded, why: str) -> bool:
        """Bring everything to the plan; False (reported like a refused reload) if the unit
        definitions could not be written, with the running instances left alone."""
        self.online, self.allowed = loaded.topology.online_cpus, loaded.allowed
        try:
            self.read_holds()
            # Restarts say why in the journal: a new model file, or a new definition.
            result = self.reconciler.apply(loaded, time.monotonic(),
                                           why if why == ARTIFACTS_CHANGED else "definition changed")
        except (NumaInferError, OSError) as exc:
            log.error("%s failed, still running the previous configuration: cannot apply the plan: %s", why, exc)
            self.last_reload = ReloadResult(time.time(), False, why, f"cannot apply the plan: {exc}")
            return False
        refused, door = None, False
        try:
            door = self.frontdoor.apply(loaded.config, loaded.plan, loaded.served, loaded.haproxy_cfg)
        except NumaInferError as exc:
            self.frontdoor.error = refused = str(exc)
            log.error("front door: %s", exc)
        self.endpoint.listen_on(loaded.config.metrics.listen)
        self.warnings = loaded.warnings
        for warning in self.warnings:
            log.warning("%s", warning)
        log.info("%s: %d instance(s): %s", why, len(loaded.plan.instances),
                 change_summary(result, door and why != "start"))  # at the start HAProxy starts: no news
        # A front door that refused the plan is said as the reload's failure: the instances run
        # the new plan, but clients still reach the old one's front door (or none).
        self.last_reload = ReloadResult(time.time(), refused is None, why,
                                        None if refused is None else f"the front door refused the plan: {refused}",
                                        result.added, result.changed, result.removed, result.unchanged,
                                        door and why != "start")
        return True

    def read_holds(self) -> None:
        self.reconciler.holds = {h.instance: f"{h.by} (pid {h.pid})"
                                 for h in holds.active(holds.hold_dir(self.state_file)).values()}

    def reload(self) -> None:
        log.info("reloading %s", self.config_path)
        loaded = self._load("reload", "reload failed, still running the previous configuration")
        if loaded is not None:
            self.apply(loaded, "reload")
        self.generation += 1

    def _load(self, why: str, failed: str) -> Loaded | None:
        """The pipeline's verdict for a reload or a re-plan, or None: refused, or failed on
        a bug, the running plan is kept untouched and the refusal recorded as a refused
        reload (`failed`: how the log says so)."""
        try:
            return self.load()
        except Exception as exc:  # deliberately broad: a bug in loading must not end a running fleet
            self.refused(why, failed, exc)
            return None

    def refused(self, why: str, failed: str, exc: Exception, logged: bool = True) -> None:
        """Say why everywhere an operator looks: status's last reload, and the log (`logged`),
        with the traceback of a bug: an error no NumaInferError explains."""
        error = _error_text(exc)
        if logged:
            log.error("%s: %s", failed, error, exc_info=None if isinstance(exc, NumaInferError) else exc)
        self.last_reload = ReloadResult(time.time(), False, why, error)

    def replan(self, now: float) -> None:
        """A pass's re-plan: the machine (check_machine), then the model and engine files
        (check_artifacts). Whatever goes wrong in one is a refused re-plan, reported as a
        refused reload is, and the running instances stay as they are."""
        steps = (("machine check", self.check_machine), (ARTIFACTS_CHECK, lambda: self.check_artifacts(now)))
        for why, step in steps:
            try:
                step()
            except Exception as exc:  # deliberately broad: a bug in a re-plan must not stop supervising the instances
                # Logged once, not at every pass while it keeps failing the same way; status shows it throughout.
                repeated = self._failing.get(why) == _error_text(exc)
                self._failing[why] = _error_text(exc)
                self.refused(why, f"{why} failed, still running the previous plan", exc, logged=not repeated)
            else:
                self._failing.pop(why, None)

    def check_artifacts(self, now: float) -> None:
        """The model file or the engine program at the configured path is another one than
        the instances loaded (moved into place, or written over): once it has held still for
        SETTLE_S and passed the pipeline, the instances are rolled onto it, one at a time
        behind the front door and drained first, as a reload that changes them is."""
        if self.loaded is None:
            return
        seen = self.validation.artifacts(self.loaded.served, self.loaded.engine)
        if seen == self.loaded.artifacts:
            self._changed = None
            if self._artifacts_refused() and seen != self._refused:
                self._revalidate(seen)
            return
        if self._changed is None or self._changed[0] != seen:
            if self._changed is None:
                self._refused = None  # a new change: even a file refused before is judged again
                log.info("the model file or the engine changed (%s): rolling it out once it holds still for %gs",
                         seen, SETTLE_S)
            self._changed = (seen, now)
            return
        if now - self._changed[1] < SETTLE_S or seen == self._refused:
            return
        loaded = self._load(ARTIFACTS_CHANGED, "the model file or the engine changed but cannot be rolled "
                            "out, the instances keep what they loaded")
        if loaded is None:
            self._refused = seen
            return
        self._changed = None
        self.apply(loaded, ARTIFACTS_CHANGED)
        self.generation += 1

    def _artifacts_refused(self) -> bool:
        """The error status shows is one the model or engine files caused (refused, or
        unreadable): the applied files being back does not by itself say it is over."""
        last = self.last_reload
        return last is not None and not last.ok and last.why in (ARTIFACTS_CHANGED, ARTIFACTS_CHECK)

    def _revalidate(self, seen: str) -> None:
        """The files are the applied ones again: the pipeline judges them once more, and
        where it passes, the error is cleared (nothing restarts: they are what runs)."""
        loaded = self._load(ARTIFACTS_CHANGED, "the model file or the engine is back as loaded but still refused")
        if loaded is None:
            self._refused = seen  # said once, not at every pass
            return
        log.info("the model file or the engine is back as the instances loaded it (%s): the error is cleared", seen)
        self.apply(loaded, ARTIFACTS_RESTORED)
        self.generation += 1

    def check_machine(self) -> None:
        """CPUs went on or offline, or the instances' cgroup now allows other CPUs, memory
        nodes or CPU time (the kubelet, an NRI plugin, `podman update`, `systemctl
        set-property`): a new plan, never drift to fight. Only the instances whose placement
        changed restart, drained first."""
        online = self.sysfs.online_cpus()
        allowed = self.validation.allowed(self.backend.kind)
        hotplug = online is not None and self.online is not None and online != self.online
        narrowed = self.allowed is not None and allowed != self.allowed
        if not hotplug and not narrowed:
            return
        if hotplug:
            assert online is not None and self.online is not None
            gone, came = self.online - online, online - self.online
            log.warning("CPUs changed: %s%s; re-planning", f"offline {format_list(gone)} " if gone else "",
                        f"online {format_list(came)}" if came else "")
        if narrowed:
            assert self.allowed is not None
            log.warning("what the instances may use changed: %s, was %s; a new plan (not drift): re-planning",
                        allowed.describe(), self.allowed.describe())
        why = "cpu hotplug" if hotplug else "allowed set change"
        loaded = self._load(why, "the machine changed and the configuration no longer fits")
        if loaded is None:
            self.online, self.allowed = online, allowed  # said once, not at every pass
            return
        self.apply(loaded, why)


def _error_text(exc: Exception) -> str:
    return str(exc) if isinstance(exc, NumaInferError) else f"internal error: {type(exc).__name__}: {exc}"


def change_summary(result: PlanDiff, frontdoor_reloaded: bool) -> str:
    """What an apply changed, for the log: the instances added, changed and removed; and when
    none was but HAProxy was reloaded (tenants, their keys or the routing changed), that,
    rather than `added none, changed none, removed none` as if nothing had happened."""
    door = "front door: tenants, keys or routing changed, HAProxy reloaded"
    if not (result.added or result.changed or result.removed):
        kept = f"no instance changed (unchanged {_names(result.unchanged)})"
        return f"{kept}; {door}" if frontdoor_reloaded else kept
    text = (f"added {_names(result.added)}, changed {_names(result.changed)}, removed {_names(result.removed)}, "
            f"unchanged {_names(result.unchanged)}")
    return f"{text}; {door}" if frontdoor_reloaded else text


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(names) if names else "none"
