"""Holding and releasing the daemon's fleet while tune measures.

A running fleet is not taken down: each node's instance is held (`holds.py`) while that
node is measured, so the daemon drains it out of the front door, stops it, and brings it
back when the hold goes away (at the end, on Ctrl-C, or when tune dies: a hold names its
holder's PID). Without a front door a hold would cut that node's clients off, so tune
refuses unless told `--stop-instances` (`run._refuse_cutting_clients_off`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from numad_infer.tune.errors import TuneError

log = logging.getLogger(__name__)


class Fleet:
    """The daemon's instances on the nodes being measured: held one node at a time."""

    def __init__(self, state_file: Path, progress: Callable[[str], None]) -> None:
        from numad_infer.status.statefile import read_status

        self.state_file, self.progress = state_file, progress
        self.status = read_status(state_file)
        self.taken: list[Path] = []

    @property
    def live(self) -> bool:
        return self.status is not None and self.status.daemon.state.live and self.status.daemon.pid is not None

    def instances_on(self, node: int) -> list[str]:
        if not self.live:
            return []
        assert self.status is not None
        return [i.name for i in self.status.instances if i.node == node or i.node is None]

    def hold_all(self, timeout_s: float) -> None:
        """Every instance (layouts need the whole machine): only with --stop-instances."""
        for node in sorted({i.node for i in self.status.instances if i.node is not None} if self.live and self.status
                           else set()):
            self.hold(node, timeout_s)

    def hold(self, node: int, timeout_s: float) -> None:
        from numad_infer.lifecycle.states import State
        from numad_infer.status.statefile import read_status
        from numad_infer.supervision import holds

        names = self.instances_on(node)
        if not names:
            return
        directory = holds.hold_dir(self.state_file)
        for name in names:
            self.taken.append(holds.acquire(directory, name, "numa-infer tune"))
        self.progress(f"node {node}: asking the daemon to drain and stop {', '.join(names)}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = read_status(self.state_file)
            states = {i.name: i.state for i in status.instances} if status else {}
            if all(states.get(n) == State.HELD for n in names):
                return
            time.sleep(0.5)
        raise TuneError(f"the daemon did not stop {', '.join(names)} within {timeout_s:g}s")

    def release(self, wait_s: float) -> None:
        """Give the held instances back and wait until they serve again (one node down at a time)."""
        from numad_infer.lifecycle.states import State
        from numad_infer.status.statefile import read_status
        from numad_infer.supervision import holds

        names = [p.name.removesuffix(holds.SUFFIX) for p in self.taken]
        for path in self.taken:
            holds.release(path)
        self.taken = []
        if not names:
            return
        self.progress(f"released {', '.join(names)}; waiting for them to be healthy again")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            status = read_status(self.state_file)
            if status and all(i.state == State.HEALTHY for i in status.instances if i.name in names):
                return
            time.sleep(0.5)
        log.warning("%s not healthy again within %gs after the release", ", ".join(names), wait_s)

    def drop(self) -> None:
        """On any exit: never leave a hold behind."""
        from numad_infer.supervision import holds

        for path in self.taken:
            holds.release(path)
        self.taken = []
