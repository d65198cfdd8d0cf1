"""The `Backend` interface: where instances run, as the reconcile loop sees it.

Two backends implement it: systemd units (production, backends/systemd.py) and child
processes (no systemd, backends/process.py). Both take the same plan and expose the same
small surface to the reconcile loop:
`specs` (what would run, for diffs), `current_specs` (what a previous daemon left),
`sync` (definitions on disk), `start`, `stop`, `restart`, and `observe` (main PID and
state in words of every instance, in one read).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from numad_infer.config.schema import Config
from numad_infer.frontdoor.control import FrontdoorRunner
from numad_infer.host.identity import BackendKind
from numad_infer.plan.model import Instance
from numad_infer.validate.loaded import Loaded


@dataclass(frozen=True)
class Observation:
    pid: int | None  # main process, None when not running
    pending: bool  # the service manager is (re)starting it: not ours to restart now
    description: str  # unit state in words, for logs and status


class Backend(Protocol):
    name: str
    kind: BackendKind  # decides who the instances run as (identity.instances_run_as)
    # Each instance in a cgroup of its own, whose memory.numa_stat is that instance's
    # memory (systemd units); otherwise memory is read from /proc/PID/numa_maps.
    instance_cgroups: bool
    # Where the instances' engines save their slots across a restart (STATE_DIR/slots), or
    # None: they start cold (supervision/slot_keeper.py).
    slots_dir: Path | None
    # Why it starts no copy of an instance for a surge (supervision/surge.py); None: it does.
    surge_refusal: str | None
    # The cgroup a copy starts in, whose memory limit (and its parents') bounds it; None: the daemon's.
    copy_cgroup: str | None

    def specs(self, loaded: Loaded) -> dict[str, str]: ...
    def current_specs(self, loaded: Loaded) -> dict[str, str]: ...
    def sync(self, loaded: Loaded) -> bool: ...
    def start(self, instance: Instance) -> None: ...
    def start_copy(self, copy: Instance) -> None: ...
    def stop(self, name: str) -> None: ...
    def restart(self, instance: Instance) -> None: ...
    def observe(self, names: list[str]) -> dict[str, Observation]: ...
    def stop_all_on_exit(self) -> bool: ...
    def forget(self, config: Config) -> None: ...
    def frontdoor_runner(self, run_dir: Path) -> FrontdoorRunner: ...
