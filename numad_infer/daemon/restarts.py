"""`numa-infer restart` on the daemon's side: take the request, start the roll (or say
why not), and keep what the command follows in the status: the request's id, its answer
and the instances not yet restarted and healthy again."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from numad_infer.status.records import RestartResult
from numad_infer.supervision import restart_request
from numad_infer.supervision.reconcile import Reconciler

log = logging.getLogger(__name__)


class Restarts:
    def __init__(self, reconciler: Reconciler, state_file: Path) -> None:
        self.reconciler, self.state_file = reconciler, state_file
        self.last: RestartResult | None = None

    def take(self) -> None:
        """Act on the waiting request (SIGUSR1 said there is one)."""
        request = restart_request.take(self.state_file)
        if request is None:
            return
        if isinstance(request, str):
            log.warning("restart request: %s", request)
            return
        rec = self.reconciler
        error = rec.rollout.request(list(request.instances), rec.runtimes, rec.holds)
        if error:
            log.error("restart refused: %s", error)
        names = request.instances or tuple(rec.runtimes)
        self.last = RestartResult(request.id, time.time(), error is None, names, error, () if error else names)
        rec.roll(time.monotonic())  # the first goes now, not a pass later

    def follow(self) -> RestartResult | None:
        """The last restart with what is left of it; an instance once done stays done."""
        last = self.last
        if last is not None and last.ok and last.left:
            last = self.last = replace(last, left=self.reconciler.rollout.left(last.left, self.reconciler.runtimes))
        return last
