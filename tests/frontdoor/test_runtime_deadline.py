"""HAProxy's runtime API has one deadline per command and a cap on its answer, and a front
door that stops answering costs a pass one deadline, not one per call.

The admin socket's directory belongs to the front door's user, who can replace admin.sock
with a server of their own: here tests/peers.py's, on a real UNIX socket, that drips one
byte every 50 ms or floods 64 MiB."""

from __future__ import annotations

import shutil
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from numad_infer.daemon.publish import frontdoor_status
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.frontdoor.haproxy import ANSWER_CAP, AdminState, NoRuntimeAnswer, RuntimeAPI
from numad_infer.lifecycle.states import State
from numad_infer.plan.placement import make_plan
from numad_infer.supervision.reconcile import PASS_SLACK_S, Reconciler
from tests.daemon_harness import wait_for
from tests.fakes import FakeProc, RecordingBackend, answering_probe, cfg, loaded_for, served_of, three_nodes
from tests.peers import Peer, answer, drip, flood, timed

DEADLINE_S = 0.5
SLACK_S = 0.5  # what a command may take past its deadline on a loaded 2-CPU machine
HUGE = 64 << 20
STAT_DRIP = (b"", b"# pxname,svname,qcur,scur,stot,status\n")
SHOW_STAT = (b"# pxname,svname,qcur,scur,stot,status,hrsp_1xx,hrsp_2xx,hrsp_3xx,hrsp_4xx,hrsp_5xx,hrsp_other\n"
             b"openai,FRONTEND,,0,7,OPEN,0,7,0,0,0,0\n"
             b"instances,infer-0,0,0,3,UP,,,,,,\ninstances,infer-1,0,0,4,UP,,,,,,\n"
             b"instances,infer-2,0,0,0,UP,,,,,,\ninstances,BACKEND,0,0,7,UP,,,,,,\n")


@pytest.fixture
def admin_sock() -> Iterator[Path]:
    """Where admin.sock is: a short directory (a UNIX socket's path is at most 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="admin-"))
    yield directory / "admin.sock"
    shutil.rmtree(directory, ignore_errors=True)


@dataclass
class StandingRunner:
    """A HAProxy that is there (as systemd keeps it), whatever answers on its socket."""

    socket_path: Path
    run_dir: Path
    restarted_by_manager: bool = True
    haproxy_uids: frozenset[int] = frozenset({0})
    haproxy_gid: int | None = None

    def running(self) -> bool:
        return True


def door_on(path: Path) -> Frontdoor:
    door = Frontdoor(StandingRunner(path, path.parent))  # type: ignore[arg-type]
    door.api = RuntimeAPI(str(path), timeout_s=DEADLINE_S)
    door.listen = "127.0.0.1:8000"  # as after `apply`
    return door


def test_a_dripping_admin_socket_is_no_answer_by_the_deadline(admin_sock: Path) -> None:
    with Peer(drip(*STAT_DRIP), unix_path=admin_sock) as haproxy:
        started = time.monotonic()
        with pytest.raises(NoRuntimeAnswer, match=r"no answer within 0\.5s$"):
            RuntimeAPI(str(admin_sock), timeout_s=DEADLINE_S).command("show stat")
        assert time.monotonic() - started < DEADLINE_S + SLACK_S
        assert haproxy.sent > 3 and haproxy.requests == [b"show stat\n"]


def test_an_oversized_answer_is_refused_at_its_cap_without_reading_it_all(admin_sock: Path) -> None:
    haproxy = Peer(flood(b"# pxname,svname\n", HUGE), unix_path=admin_sock)
    tracemalloc.start()
    try:
        started = time.monotonic()
        with pytest.raises(NoRuntimeAnswer, match="an answer longer than 1 MiB"):
            RuntimeAPI(str(admin_sock), timeout_s=5.0).command("show stat")
        took = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    wait_for(lambda: haproxy.finished == 1, "the peer done with the connection closed on it", timeout_s=10)
    haproxy.close()
    assert took < 2.0 and peak < 4 * ANSWER_CAP
    assert haproxy.sent < HUGE // 4  # the cap plus the socket's buffers, not the answer


def test_a_well_behaved_admin_socket_is_still_read(admin_sock: Path) -> None:
    with Peer(answer(lambda request: SHOW_STAT if request == b"show stat\n" else b""), unix_path=admin_sock):
        door = door_on(admin_sock)
        stats = door.observe()
        assert stats is not None and stats.servers["infer-1"].served == 4 and door.answers is not None
        assert door.answers.responses["2xx"] == 7 and door.error == ""


def test_a_stuck_front_door_is_recorded_unanswering_and_the_pass_goes_on(admin_sock: Path) -> None:
    config = cfg(f"[tuning]\nprobe_timeout_s = {DEADLINE_S}\n")
    with Peer(drip(*STAT_DRIP), unix_path=admin_sock) as haproxy:
        door = door_on(admin_sock)
        rec = Reconciler(RecordingBackend(), FakeProc(), frontdoor=door, probe=answering_probe)  # type: ignore[arg-type]
        rec.apply(loaded_for(config, make_plan(config, three_nodes(), served=served_of(config))), 0.0)
        states, took = timed(lambda: rec.monitor(1.0))
    assert took < DEADLINE_S + DEADLINE_S + PASS_SLACK_S  # the front door's deadline, then the probes'
    assert states == {"infer@0": State.HEALTHY, "infer@1": State.HEALTHY, "infer@2": State.HEALTHY}
    status = frontdoor_status(door, {})
    assert status is not None and not status.up
    assert status.error == f"runtime API {admin_sock}: no answer within 0.5s"
    assert haproxy.connections == 1  # not answering: nothing more is asked of it this pass


def test_a_front_door_that_stops_answering_mid_pass_is_asked_nothing_more(admin_sock: Path) -> None:
    scripted = answer(lambda request: SHOW_STAT if request == b"show stat\n" else b"")
    dripping = drip(*STAT_DRIP)
    with Peer(lambda conn, request, peer: (scripted if request == b"show stat\n" else dripping)(conn, request, peer),
              unix_path=admin_sock) as haproxy:
        door = door_on(admin_sock)
        assert door.observe() is not None
        conf = cfg()
        a, b, _ = make_plan(conf, three_nodes(), served=served_of(conf)).instances
        _, took = timed(lambda: door.set_state(a, AdminState.MAINT))
        assert took < DEADLINE_S + SLACK_S
        assert door.stats is None and door.error.endswith("no answer within 0.5s")
        _, took = timed(lambda: door.set_state(b, AdminState.MAINT))
        assert took < 0.05 and haproxy.connections == 2  # `show stat`, the one `set server`
        assert door.in_flight(a) is None  # not known: a drain decided on it waits for nothing
