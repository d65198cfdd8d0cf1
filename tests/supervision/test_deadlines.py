"""Every call the daemon makes to an instance has one deadline and a cap on its answer, and
a pass has a deadline: against real sockets whose peer drips one byte every 50 ms (a
timeout per receive, as http.client's, never fires against it) or floods 64 MiB.

The peers are tests/peers.py's; the instances' supervision runs over tests/fakes.py's
backend and /proc reader, the probes and counter reads over real sockets."""

from __future__ import annotations

import threading
import time
import tracemalloc

import pytest

from numad_infer.engines import engine_of
from numad_infer.lifecycle.states import State
from numad_infer.plan.placement import make_plan
from numad_infer.supervision import reconcile
from numad_infer.supervision.health import METRICS_CAP, KeyCheck, ProbeResult, check_key, probe, read_engine_metrics
from numad_infer.supervision.reconcile import PASS_SLACK_S, Reconciler
from numad_infer.util import peer
from tests.daemon_harness import free_port_block, wait_for
from tests.fakes import FakeProc, RecordingBackend, cfg, loaded_for, served_of, three_nodes
from tests.peers import BODY_DRIP, HEADER_DRIP, Peer, answer, drip, flood, http, timed

DEADLINE_S = 0.5
# What a call may take past its deadline on a loaded 2-CPU machine: the thread waking up,
# the socket closing. A per-receive timeout would take as long as the peer likes.
SLACK_S = 0.5
METRICS = b"llamacpp:tokens_predicted_total 1234\nllamacpp:requests_processing 1\n"
LLAMA_SERVER = cfg('[server]\nengine = "llama-server"\n')
HUGE = 64 << 20

# Every place an instance's answer can be dripped: the status line, the headers, the body.
STATUS_DRIP = (b"", b"HTTP/1.1 200 OK\r\n")
DRIPS = {"status line": STATUS_DRIP, "headers": HEADER_DRIP, "body": BODY_DRIP}


@pytest.mark.parametrize("where", ["status line", "headers"])
def test_a_probe_of_a_dripping_instance_fails_by_its_deadline(where: str) -> None:
    with Peer(drip(*DRIPS[where])) as instance:
        result, took = timed(lambda: probe("127.0.0.1", instance.port, DEADLINE_S, "/health"))
        assert took < DEADLINE_S + SLACK_S
        assert result == ProbeResult(False, pytest.approx(took, abs=0.05), "no answer within 0.5s")
        assert instance.sent > len(DRIPS[where][0]) + 3  # it did drip while the probe waited


def test_a_probe_reads_the_status_and_headers_not_a_dripping_body() -> None:
    # The status says all a probe needs: a body that never ends does not hold it.
    with Peer(drip(*BODY_DRIP)) as instance:
        result, took = timed(lambda: probe("127.0.0.1", instance.port, DEADLINE_S, "/health"))
        assert isinstance(result, ProbeResult) and result.ok and took < DEADLINE_S


@pytest.mark.parametrize("where", ["status line", "headers"])
def test_a_key_check_against_a_dripping_instance_is_unknown_by_its_deadline(where: str) -> None:
    with Peer(drip(*DRIPS[where])) as instance:
        verdict, took = timed(lambda: check_key("127.0.0.1", instance.port, "k", DEADLINE_S, "/v1/models"))
        assert verdict == KeyCheck.UNKNOWN and took < DEADLINE_S + SLACK_S
        assert instance.requests[0].startswith(b"GET /v1/models HTTP/1.1\r\n")
        assert b"\r\nAuthorization: Bearer k\r\n" in instance.requests[0]


@pytest.mark.parametrize("where", sorted(DRIPS))
def test_a_counter_read_from_a_dripping_instance_gives_none_by_its_deadline(where: str) -> None:
    engine = engine_of(LLAMA_SERVER)
    with Peer(drip(*DRIPS[where])) as instance:
        counters, took = timed(lambda: read_engine_metrics(engine, "127.0.0.1", instance.port, None, DEADLINE_S))
        assert counters is None and took < DEADLINE_S + SLACK_S


def test_the_calls_still_read_a_well_behaved_instance() -> None:
    engine = engine_of(LLAMA_SERVER)
    with Peer(answer(lambda request: http(401 if b"Bearer wrong" in request else 200, METRICS))) as instance:
        assert probe("127.0.0.1", instance.port, DEADLINE_S, "/health").ok
        assert check_key("127.0.0.1", instance.port, "right", DEADLINE_S, "/v1/models") == KeyCheck.ACCEPTED
        assert check_key("127.0.0.1", instance.port, "wrong", DEADLINE_S, "/v1/models") == KeyCheck.REJECTED
        counters = read_engine_metrics(engine, "127.0.0.1", instance.port, None, DEADLINE_S)
        assert counters is not None and (counters.tokens_predicted, counters.busy_slots) == (1234.0, 1)


def _bounded_read(prefix: bytes) -> tuple[object, float, int, Peer]:
    """A counter read against a 64 MiB answer: the result, the time, Python's peak memory
    during the call, and the peer (what it managed to send)."""
    engine = engine_of(LLAMA_SERVER)
    instance = Peer(flood(prefix, HUGE))
    tracemalloc.start()
    try:
        counters, took = timed(lambda: read_engine_metrics(engine, "127.0.0.1", instance.port, None, 5.0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        instance.close()
    return counters, took, peak, instance


def test_an_oversized_body_is_refused_on_its_content_length_before_any_of_it_is_read() -> None:
    counters, took, peak, instance = _bounded_read(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % HUGE)
    assert counters is None and took < 1.0 and peak < 1 << 20


def test_an_oversized_body_without_a_length_is_refused_after_its_cap() -> None:
    # HTTP/1.0-style: the body ends with the connection, so only the cap stops the reading.
    counters, took, peak, instance = _bounded_read(b"HTTP/1.0 200 OK\r\n\r\n")
    assert counters is None
    assert peak < 4 * METRICS_CAP  # the cap's buffer and its growth, not 64 MiB
    wait_for(lambda: instance.finished == 1, "the peer done with the connection closed on it", timeout_s=10)
    assert instance.sent < HUGE // 4  # what it got out is the cap plus the kernel's buffers, not the answer


def test_endless_headers_are_refused_at_their_cap() -> None:
    with Peer(flood(b"HTTP/1.1 200 OK\r\n", HUGE)) as instance:
        result, took = timed(lambda: probe("127.0.0.1", instance.port, 5.0, "/health"))
        assert isinstance(result, ProbeResult) and not result.ok and took < 1.0
        assert result.error == f"bad HTTP answer: a line longer than {peer.HEAD_CAP >> 10} KiB"
    many = b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * (peer.HEAD_CAP // 6 + 1) + b"\r\n"
    with Peer(answer(lambda request: many)) as instance:
        result = probe("127.0.0.1", instance.port, 5.0, "/health")
        assert result.error == f"bad HTTP answer: headers longer than {peer.HEAD_CAP >> 10} KiB"


@pytest.mark.parametrize(("raw", "body"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloEXTRA", b"hello"),
    (b"HTTP/1.0 200 OK\r\n\r\nto the end", b"to the end"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n2\r\nde\r\n0\r\nT: 1\r\n\r\n", b"abcde"),
])
def test_the_http_reader_takes_each_way_a_body_ends(raw: bytes, body: bytes) -> None:
    with Peer(answer(lambda request: raw)) as instance:
        got = peer.http_get("127.0.0.1", instance.port, "/x", {}, DEADLINE_S, 1024)
        assert (got.status, got.body) == (200, body)


@pytest.mark.parametrize(("raw", "refused"), [
    (b"SSH-2.0-OpenSSH\r\n\r\n", peer.BadAnswer),
    (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", peer.BadAnswer),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", peer.BadAnswer),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2000\r\n\r\n", peer.TooLarge),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n801\r\n", peer.TooLarge),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", peer.BadAnswer),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n0\r\n\r\n", peer.BadAnswer),
])
def test_the_http_reader_refuses_what_is_no_answer_or_too_long(raw: bytes, refused: type[Exception]) -> None:
    with Peer(answer(lambda request: raw)) as instance, pytest.raises(refused):
        peer.http_get("127.0.0.1", instance.port, "/x", {}, DEADLINE_S, 1024)


# -- a pass --------------------------------------------------------------------------------------


def _reconciler(config_text: str, keepalive=lambda: None, probe=probe) -> Reconciler:
    config = cfg(config_text)
    rec = Reconciler(RecordingBackend(), FakeProc(), keepalive=keepalive, probe=probe)
    rec.apply(loaded_for(config, make_plan(config, three_nodes(), served=served_of(config))), 0.0)
    return rec


def test_a_pass_with_one_dripping_instance_ends_by_its_deadline_the_others_healthy() -> None:
    base = free_port_block(3)
    healthy = answer(lambda request: http(200, METRICS))
    rec = _reconciler(f'[server]\nengine = "llama-server"\nbase_port = {base}\n'
                      f"[monitor]\nstartup_grace_s = 0\n[tuning]\nprobe_timeout_s = {DEADLINE_S}\nunhealthy_after = 3\n")
    with Peer(healthy, base), Peer(drip(*HEADER_DRIP), base + 1) as dripping, Peer(healthy, base + 2):
        # Two passes: the first meets the processes (their counters start with the second).
        passes = [timed(lambda now=now: rec.monitor(now)) for now in (1.0, 2.0)]
        assert dripping.sent > len(HEADER_DRIP[0])
    for states, took in passes:
        assert took < DEADLINE_S + PASS_SLACK_S
        assert states == {"infer@0": State.HEALTHY, "infer@1": State.UNHEALTHY, "infer@2": State.HEALTHY}
    failed = rec.runtimes["infer@1"]
    assert failed.last_probe is not None and failed.last_probe.error == "no answer within 0.5s"
    assert failed.supervision.failures == 2 and failed.engine.counters is None
    assert all(rec.runtimes[n].engine.counters is not None for n in ("infer@0", "infer@2"))


def test_a_probe_that_outlives_its_own_deadline_is_failed_at_the_pass_deadline() -> None:
    # Whatever holds a call past its own deadline (a /proc read, a thread that never
    # starts), the pass waits no longer than its own, and pings the watchdog meanwhile.
    release = threading.Event()
    base = 8080

    def stuck_probe(host: str, port: int, timeout: float, path: str) -> ProbeResult:
        if port == base + 1:
            release.wait(30)
        return ProbeResult(True, 0.001)

    pings: list[float] = []
    rec = _reconciler(f"[monitor]\nstartup_grace_s = 0\n[tuning]\nprobe_timeout_s = {DEADLINE_S}\n",
                      keepalive=lambda: pings.append(time.monotonic()), probe=stuck_probe)
    try:
        started = time.monotonic()
        states = rec.monitor(1.0)
        took = time.monotonic() - started
    finally:
        release.set()
    limit = DEADLINE_S + PASS_SLACK_S
    assert limit <= took < limit + SLACK_S
    assert states == {"infer@0": State.HEALTHY, "infer@1": State.UNHEALTHY, "infer@2": State.HEALTHY}
    assert rec.runtimes["infer@1"].last_probe == ProbeResult(False, limit, f"probe did not finish within {limit:g}s")
    gaps = [b - a for a, b in zip([started, *pings], pings, strict=False)]
    assert pings and max(gaps) <= reconcile._KEEPALIVE_EVERY_S + SLACK_S
