"""An instance stopped on purpose (a hold, e.g. `numa-infer tune`) is no drift."""

from __future__ import annotations

from numad_infer.lifecycle.states import State
from numad_infer.plan.placement import make_plan
from numad_infer.supervision.reconcile import Reconciler
from tests.fakes import (FakeFrontdoor, FakeProc, RecordingBackend, answering_probe, cfg, loaded_for, served_of,
                         three_nodes)


def test_a_held_instances_exit_records_no_drift() -> None:
    backend, front, proc = RecordingBackend(), FakeFrontdoor(), FakeProc()
    rec = Reconciler(backend, proc, frontdoor=front, probe=answering_probe)
    conf = cfg()
    rec.apply(loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf))), 0.0)
    rec.monitor(0.5)
    rec.holds = {"infer@1": "numa-infer tune (pid 4242)"}
    for t in (1.0, 2.0, 3.0):
        rec.monitor(t)
    rt = rec.runtimes["infer@1"]
    assert rt.supervision.state == State.HELD and ("stop", "infer@1") in backend.calls
    assert rt.last_drift is None and not rt.drift_counts
    rec.holds = {}
    for t in (4.0, 5.0):
        rec.monitor(t)
    assert rt.supervision.state == State.HEALTHY and rt.last_drift is None
