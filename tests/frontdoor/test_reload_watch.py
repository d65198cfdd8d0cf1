"""Whether HAProxy took a reload (frontdoor/reload_watch.py), on a clock and workers the test
moves: taken when another worker answers, asked again after RELOAD_TAKEN_S when not, nothing
to watch when no worker answered before it. The real HAProxy that drops such a reload is in
test_control.py."""

from __future__ import annotations

from numad_infer.errors import NumaInferError
from numad_infer.frontdoor.reload_watch import RELOAD_TAKEN_S, ReloadWatch


class Haproxy:
    def __init__(self) -> None:
        self.worker: int | None = 100
        self.signals = 0
        self.now = 0.0

    def worker_pid(self) -> int:
        if self.worker is None:
            raise NumaInferError("runtime API: no socket")
        return self.worker

    def send(self) -> None:
        self.signals += 1


def test_a_reload_is_pending_until_another_worker_answers() -> None:
    h = Haproxy()
    watch = ReloadWatch(h.worker_pid, h.send, lambda: h.now)
    watch.ask()
    assert h.signals == 1 and watch.pending is not None and watch.pending.worker_pid == 100
    h.now += 0.5
    watch.check()
    assert watch.pending is not None and h.signals == 1  # not yet, and too soon to ask again
    h.worker = 101
    watch.check()
    assert watch.pending is None and h.signals == 1


def test_a_dropped_reload_is_asked_again_each_time_the_bound_passes() -> None:
    h = Haproxy()
    watch = ReloadWatch(h.worker_pid, h.send, lambda: h.now)
    watch.ask()
    for asks in (2, 3):
        h.now += RELOAD_TAKEN_S
        watch.check()
        assert h.signals == asks and watch.pending is not None and watch.pending.asks == asks
    h.worker = None  # between workers: looked at again next pass, not asked
    h.now += RELOAD_TAKEN_S
    watch.check()
    assert h.signals == 3
    h.worker = 102
    watch.check()
    assert watch.pending is None


def test_nothing_to_watch_without_a_worker_before_or_after_a_new_start() -> None:
    h = Haproxy()
    h.worker = None
    watch = ReloadWatch(h.worker_pid, h.send, lambda: h.now)
    watch.ask()
    assert h.signals == 1 and watch.pending is None
    h.worker = 100
    watch.ask()
    watch.forget()  # HAProxy started anew: it reads the file as it is
    h.now += 10 * RELOAD_TAKEN_S
    watch.check()
    assert watch.pending is None and h.signals == 2
