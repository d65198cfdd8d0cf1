"""The systemd backend: instances as template units driven through systemctl, and HAProxy
as numa-infer-frontdoor.service, whose listening socket the daemon holds and hands out
(systemd holding it while the daemon is away: portunit.py)."""

from __future__ import annotations

import contextlib
import grp
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from numad_infer.backends.base import Observation
from numad_infer.backends.portunit import PortUnit
from numad_infer.config.apikey import fingerprint
from numad_infer.config.defaults import FRONTDOOR_USER, SLOTS_DIR
from numad_infer.config.schema import Config
from numad_infer.engines.launch import launch_of
from numad_infer.engines.slot_cache import make_slot_directory
from numad_infer.frontdoor.control import FrontdoorRunner
from numad_infer.frontdoor.listener import Handout, HeldListener, Store
from numad_infer.host.identity import CREATE_USERS, BackendKind, frontdoor_runs_as
from numad_infer.plan.model import Instance
from numad_infer.systemd.systemctl import Systemctl, SystemctlError
from numad_infer.systemd.unitdir import managed_files, write_units
from numad_infer.systemd.unitnames import (
    DAEMON_UNIT,
    DROPIN_NAME,
    FRONTDOOR_UNIT,
    dropin,
    name_of_dropin,
    template_of,
    template_unit,
    unit,
)
from numad_infer.topology.cgroups import INSTANCE_SLICE
from numad_infer.units.render import FRONTDOOR_HANDOUT, FRONTDOOR_RUN_DIR, FRONTDOOR_SOCKET, render_dropin
from numad_infer.validate.loaded import Loaded

log = logging.getLogger(__name__)

# Job types that bring the daemon back (systemctl restart, try-restart, reload-or-restart).
RESTART_JOBS = ("restart", "try-restart", "reload-or-restart")


def _gid(group: str | None) -> int | None:
    try:
        return None if group is None else grp.getgrnam(group).gr_gid
    except KeyError:  # gone since validation: the units' starts will say
        return None


class SystemdBackend:
    name = "systemd"
    kind = BackendKind.SYSTEMD
    instance_cgroups = True
    surge_refusal: str | None = None  # starts copies for a surge (start_copy)
    copy_cgroup: str | None = INSTANCE_SLICE  # a copy's unit starts there, as the instances' do

    def __init__(self, systemctl: Systemctl | None = None, daemon_unit: str = DAEMON_UNIT,
                 handout: FrontdoorHandout | None = None, slots_dir: Path = Path(SLOTS_DIR)) -> None:
        self.systemctl = systemctl or Systemctl()
        self.daemon_unit = daemon_unit
        self.handout = handout  # None: no front door socket to hand out (a command, a test)
        # Prompt caches kept across restarts (supervision/slot_keeper.py), where the units
        # were rendered to keep them (Loaded.slots_group): one directory an instance, root's
        # and the group's, mode 770. Not a StateDirectory= of each unit: that is its
        # DynamicUser's, mode 700, and the daemon (root without CAP_DAC_*, its unit's
        # bounding set) could not read, check or remove the files there.
        self.slots_dir: Path | None = slots_dir
        self.slots_gid: int | None = None  # the group's, from the last sync; None: none kept
        # The units as last synced, and the copies started for a surge beside them (start_copy).
        self.loaded: Loaded | None = None
        self.copies: dict[str, Instance] = {}

    def specs(self, loaded: Loaded) -> dict[str, str]:
        files = loaded.units
        template = files[template_unit(loaded.config.systemd.template)]
        # A template change (mlock, hardening) changes every instance; so does a new API key,
        # which is not in the unit text (a credential is read at start).
        key = fingerprint(loaded.api_key)
        return {i.name: template + files[dropin(i.name)] + key + loaded.artifacts_of(i.name)
                for i in loaded.plan.instances}

    def current_specs(self, loaded: Loaded) -> dict[str, str]:
        """Specs of the units on disk: what a previous daemon left running (adoption), with
        the key as validated (the running instances read theirs from the same file)."""
        unit_dir = Path(loaded.config.systemd.unit_dir)
        # The model and engine as they are now: a daemon restarted after the model was
        # replaced adopts the running instances (a reload or the next change rolls them).
        key = fingerprint(loaded.api_key)
        specs: dict[str, str] = {}
        for rel in managed_files(unit_dir):
            if rel.endswith(DROPIN_NAME):
                name = name_of_dropin(rel)
                template_path = unit_dir / template_unit(template_of(name))
                try:
                    specs[name] = (template_path.read_text() + (unit_dir / rel).read_text() + key
                                  + loaded.artifacts_of(name))
                except OSError:
                    specs[name] = ""
        return specs

    def sync(self, loaded: Loaded) -> bool:
        if loaded.config.frontend.enabled and loaded.frontdoor_user is None:
            log.warning("front door: user %s does not exist on this host: haproxy runs as root with no capability; %s",
                        FRONTDOOR_USER, CREATE_USERS)
        self.slots_gid = _gid(loaded.slots_group)
        self.loaded = loaded
        result = write_units(Path(loaded.config.systemd.unit_dir), self._files(loaded))
        port = self.handout.port if self.handout is not None else None
        # Before the front door binds a new frontend.listen: the reload makes systemd let go
        # of the unit's socket on the old address.
        port_changed = port is not None and port.sync(loaded.config)
        if result.changed:
            log.info("units: wrote %s, removed %s; systemctl daemon-reload",
                     ", ".join(result.written) or "nothing", ", ".join(result.removed) or "nothing")
        if result.changed or port_changed:
            self.systemctl.daemon_reload()
        return result.changed

    def start(self, instance: Instance) -> None:
        self._slot_directory(instance.name)
        self.systemctl.start(instance.unit)

    def start_copy(self, copy: Instance) -> None:
        """A copy of one of the plan's instances for a surge (supervision/surge.py): a unit of
        the same template (the same sandbox, user and key), with a drop-in rendered as the
        instance's but for its name and port, and no saved prompt cache (it lives for one
        restart). The drop-in goes when the copy stops."""
        if self.loaded is None:
            raise ValueError(f"{copy.name}: the systemd backend was given no configuration (sync) to start it")
        loaded = self.loaded
        self.copies[copy.name] = copy
        write_units(Path(loaded.config.systemd.unit_dir), self._files(loaded))
        self.systemctl.daemon_reload()
        self.systemctl.start(copy.unit)

    def _files(self, loaded: Loaded) -> dict[str, str]:
        """The units of the plan, and the drop-ins of the copies running beside it."""
        files = dict(loaded.units)
        for name, copy in list(self.copies.items()):  # stop_all stops copies from several threads
            with contextlib.suppress(KeyError):  # a model no longer served: its copy's drop-in goes
                served = loaded.model(copy.model).served
                files[dropin(name)] = render_dropin(copy, launch_of(loaded.engine, served, copy))
        return files

    def stop(self, name: str) -> None:
        self.systemctl.stop(unit(name))
        if name in self.copies and self.loaded is not None:
            self.copies.pop(name, None)
            if write_units(Path(self.loaded.config.systemd.unit_dir), self._files(self.loaded)).changed:
                self.systemctl.daemon_reload()

    def restart(self, instance: Instance) -> None:
        self._slot_directory(instance.name)
        self.systemctl.restart(instance.unit)

    def _slot_directory(self, name: str) -> None:
        """Its --slot-save-path (render.slot_save_arguments), before each start: the server
        refuses to start without it. A failure is said; the unit's own error follows."""
        if self.slots_dir is None or self.slots_gid is None:
            return
        try:
            make_slot_directory(self.slots_dir, name, gid=self.slots_gid, mode=0o770)
        except OSError as exc:
            log.warning("%s: cannot make its prompt cache's directory under %s: %s", name, self.slots_dir, exc)

    def observe(self, names: list[str]) -> dict[str, Observation]:
        shown = self.systemctl.show_many([unit(n) for n in names], "MainPID", "ActiveState", "SubState")
        result = {}
        for name in names:
            props = shown.get(unit(name), {})
            if "ActiveState" not in props or not props.get("MainPID", "").isdigit():
                raise SystemctlError(f"systemctl show gave no state for {unit(name)}")
            pid = int(props["MainPID"]) or None
            active, sub = props.get("ActiveState", "unknown"), props.get("SubState", "?")
            # "activating": a start job runs, or Restart= will bring it back after a crash.
            result[name] = Observation(pid, active == "activating", f"{active} ({sub})")
        return result

    def forget(self, config: Config) -> None:
        """After a real stop: remove the units we rendered, so a stop (or a package purge) leaves nothing."""
        result = write_units(Path(config.systemd.unit_dir), {})
        if result.removed:
            log.info("units: removed %s; systemctl daemon-reload", ", ".join(result.removed))
            self.systemctl.daemon_reload()

    def stop_all_on_exit(self, looks: int = 5, pause_s: float = 0.2) -> bool:
        # `systemctl restart numa-infer` (an upgrade, an operator) stops us too: only a
        # real stop takes the instances down, so a restarted daemon can adopt them.
        # systemd holds a running job for us while it delivers SIGTERM, but it sends SIGTERM
        # to every process in our cgroup and re-reads the cgroup until no new process shows
        # up: a systemctl forked in that window is killed too (seen in the VM suite as a
        # restart read as a stop). So a failed or empty answer is looked at again.
        seen, failed = "", False
        for look in range(looks):
            if look:
                log.info("%s: looking again for the job that stops the daemon", seen)
                time.sleep(pause_s)
            try:
                jobs = self.systemctl.jobs()
            except SystemctlError as exc:
                seen, failed = str(exc), True
                continue
            kind = next((kind for _, unit, kind, _ in jobs if unit == self.daemon_unit), None)
            if kind in RESTART_JOBS:
                log.info("daemon restart in progress (job %s): leaving instances running for the next daemon to adopt",
                         kind)
                return False
            if kind is not None:
                log.info("%s job %s: stopping the instances", self.daemon_unit, kind)
                return True
            seen, failed = f"no job for {self.daemon_unit} among {len(jobs)} job(s)", False
        if not failed:
            log.info("%s: a stop from outside systemd: stopping the instances", seen)
            return True
        raise SystemctlError(seen)


    def frontdoor_runner(self, run_dir: Path) -> FrontdoorRunner:
        # The unit (render.render_frontdoor_unit) fixes where its files are.
        return SystemdFrontdoorRunner(self.systemctl, self.handout)


@dataclass(frozen=True)
class FrontdoorHandout:
    """What the daemon under systemd needs to hold the front door's socket for HAProxy's
    unit: where to keep it (the unit's file descriptor store), what systemd passed at start
    (numa-infer-port.socket's sockets, what a previous daemon stored; by name), who may take
    it (listener.Handout), and the socket unit that keeps the port while the daemon is away."""

    store: Store
    kept: Mapping[str, list[int]]
    uids: frozenset[int]
    gid: int | None
    path: Path = Path(FRONTDOOR_HANDOUT)
    port: PortUnit | None = field(default=None, compare=False)


class SystemdFrontdoorRunner:
    """HAProxy as numa-infer-frontdoor.service (rendered into the unit directory by `sync`).

    The daemon holds the listening socket (listener.py says why); the unit starts HAProxy
    through `frontdoor_exec`, which asks the daemon for it."""

    socket_path = Path(FRONTDOOR_SOCKET)
    run_dir = Path(FRONTDOOR_RUN_DIR)
    restarted_by_manager = True  # Restart=on-failure in its unit

    def __init__(self, systemctl: Systemctl, handout: FrontdoorHandout | None = None) -> None:
        self.systemctl = systemctl
        self.listener = HeldListener(None if handout is None else handout.store)
        user = frontdoor_runs_as(BackendKind.SYSTEMD)  # None: the unit keeps HAProxy root
        self.haproxy_uids = frozenset({0} | ({user.uid} if user is not None and user.uid is not None else set()))
        self.haproxy_gid = None if user is None else user.gid  # the daemon is in it (SupplementaryGroups=)
        self.port = None if handout is None else handout.port
        if handout is not None:
            self.listener.offer(handout.kept)
            Handout(self.listener, handout.path, handout.uids, handout.gid).start()

    def running(self) -> bool:
        props = self.systemctl.show_many([FRONTDOOR_UNIT], "ActiveState").get(FRONTDOOR_UNIT, {})
        return props.get("ActiveState") in ("active", "reloading", "activating")

    def start(self, binary: str, config_path: Path) -> None:
        self.systemctl.start(FRONTDOOR_UNIT)  # the unit holds the user; HAProxy asks for the socket

    def reload(self) -> None:
        self.systemctl.reload(FRONTDOOR_UNIT)

    def stop(self) -> None:
        self.systemctl.stop(FRONTDOOR_UNIT)

    def hand_back(self) -> None:
        if self.port is not None:
            self.port.take_over(self.listener)
