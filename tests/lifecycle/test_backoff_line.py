"""The BACKOFF line says how long until the next restart, never a monotonic clock value
(before: `next restart at 1198.89`, seconds since boot, meaningless in a log)."""

from __future__ import annotations

import logging
import re

import pytest

from numad_infer.config.schema import MonitorSection
from numad_infer.config.tuning import TuningSection
from numad_infer.lifecycle.states import RestartDecision, State, Supervision

MON = MonitorSection(startup_grace_s=10, max_restarts=5, restart_window_s=100).tuned(
    TuningSection(unhealthy_after=1, restart_backoff_s=2))


def test_backoff_says_in_how_many_seconds(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="numad_infer.lifecycle.states")
    sup = Supervision(name="infer@0")
    sup.on_started(1190.0)
    sup.on_restart(1190.0, MON, "probe failed")
    sup.on_restart(1192.0, MON, "probe failed")  # the second in the window: 4 s of backoff, until 1196
    sup.on_probe(False, 1193.0, MON, "refused")
    assert sup.restart_decision(1193.0, MON) == RestartDecision.WAIT and sup.state == State.BACKOFF
    (line,) = [r.getMessage() for r in caplog.records if "-> backoff" in r.getMessage()]
    assert line == "infer@0: restarting -> backoff (next restart in 3.0 s)"
    assert not re.search(r"\b1196\b", line)
