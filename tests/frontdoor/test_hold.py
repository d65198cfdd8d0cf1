"""The hold (frontdoor/hold.py), in a real HAProxy over stub servers: a request for a model
none of whose instances is in rotation waits for one, up to frontend.queue_timeout_s,
instead of HAProxy's immediate 503; another model is not held.

The daemon takes a server out of rotation by the runtime API (maintenance for a restart,
drain before it); the tests do the same, so what is measured is HAProxy's behaviour under
the rendered configuration, not a stand-in for it.

One test here per behaviour that needs HAProxy itself: the wait and the /healthz beside it,
the JSON 503 at the deadline, one backend's hold apart from another's, and a request
dispatched again to the hold server. The hold's own rules (a drained instance holds new
requests too, at most queue_size wait, a waiting client that left is forgotten) are the
Lua's unit tests, tests/lua/hold_spec.lua."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.frontdoor.haproxy import AdminState, RuntimeAPI
from numad_infer.frontdoor.haproxy_config import BACKEND, FRONTEND
from tests.daemon_harness import free_port_block, wait_for
from tests.frontdoor.harness import CRASH_MARKER, HAPROXY, Answer, FrontDoor, _get

pytestmark = pytest.mark.skipif(not os.access(HAPROXY, os.X_OK), reason="haproxy not installed")
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def door(tmp_path: Path):
    made: list[FrontDoor] = []

    def make(frontend: str = "", models: str = "", count: int = 2) -> FrontDoor:
        base = free_port_block(count + 1)
        model = models or '[model]\npath = "/m.gguf"\n'
        config = parse_config(f'{model}[server]\nbase_port = {base + 1}\n'
                              f'[frontend]\nlisten = "127.0.0.1:{base}"\n{frontend}', "/etc/numa-infer.toml")
        made.append(FrontDoor(tmp_path, config, tmp_path / "run", [base + 1 + k for k in range(count)]))
        return made[-1]

    yield make
    for made_door in made:
        made_door.stop()


def _started(door: FrontDoor, backends: tuple[str, ...] = (BACKEND,)) -> RuntimeAPI:
    for k in range(len(door.ports)):
        door.start_stub(k)
    door.start_haproxy()
    api = RuntimeAPI(str(door.run_dir / "haproxy.sock"))
    wait_for(lambda: all(s.status == "UP" for b in backends for s in api.backend(b).instances.values()),
             "every server UP")
    return api


def _out(api: RuntimeAPI, backend: str = BACKEND, state: AdminState = AdminState.MAINT) -> list[str]:
    names = list(api.backend(backend).instances)
    for name in names:
        api.set_state(backend, name, state)
    return names


def _timed(door: FrontDoor, test_id: str, body: dict, into: dict[str, tuple[Answer, float]]) -> threading.Thread:
    def send() -> None:
        started = time.monotonic()
        try:
            answer = door.post(test_id, body)
        except OSError as exc:  # closed without an answer: said as such, not lost in a thread
            answer = Answer(0, "", repr(exc).encode())
        into[test_id] = (answer, time.monotonic() - started)
    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_a_request_waits_for_the_only_instance_and_is_served_when_it_is_back(door) -> None:
    front = door()
    api = _started(front)
    names = _out(api)  # every instance out of rotation: the one instance of a host restarting
    got: dict[str, tuple[Answer, float]] = {}
    thread = _timed(front, "held", CHAT, got)
    time.sleep(1.5)
    assert "held" not in got  # waiting, not refused
    status, body, took = _get(front.port, "/healthz")
    assert status == 503 and took < 1.0  # truthful meanwhile: no instance in rotation
    api.set_state(BACKEND, names[0], AdminState.READY)
    thread.join(30)
    answer, waited = got["held"]
    assert answer.status == 200 and answer.served_by() == "stub0", answer
    assert 1.5 <= waited < 5, waited
    # In rotation again: nothing waits.
    started = time.monotonic()
    assert front.post("after", CHAT).status == 200 and time.monotonic() - started < 1.0


def test_a_hold_ends_at_the_queue_timeout_with_the_json_503(door) -> None:
    front = door("queue_timeout_s = 1.5\n")
    api = _started(front)
    _out(api)
    got: dict[str, tuple[Answer, float]] = {}
    _timed(front, "late", CHAT, got).join(30)
    answer, waited = got["late"]
    assert answer.status == 503 and answer.error()["type"] == "server_busy", answer
    assert 1.4 <= waited < 4, waited


def test_one_models_hold_never_holds_another_model(door) -> None:
    models = ('[[models]]\nname = "alpha"\npath = "/a.gguf"\n[[models]]\nname = "beta"\npath = "/b.gguf"\n')
    front = door(models=models, count=4)
    api = _started(front, ("model-alpha", "model-beta"))
    names = _out(api, "model-alpha")
    got: dict[str, tuple[Answer, float]] = {}
    held = _timed(front, "alpha", {"model": "alpha", **CHAT}, got)
    _timed(front, "beta", {"model": "beta", **CHAT}, got).join(30)
    assert got["beta"][0].status == 200 and got["beta"][1] < 1.0 and "alpha" not in got
    api.set_state("model-alpha", names[0], AdminState.READY)
    held.join(30)
    assert got["alpha"][0].status == 200 and got["alpha"][0].served_by() == "stub0"


@pytest.mark.parametrize("daemon", [True, False], ids=["daemon-takes-it-out", "haproxy-checks-alone"])
def test_with_one_instance_what_it_had_queued_or_was_refused_by_waits_for_its_replacement(door, daemon: bool) -> None:
    """The requests HAProxy had already given to the only instance when it died (queued for
    its one slot, or sent before HAProxy saw it dead) meet a refused connection. Once they
    found no other server and got a 503 at once (issue 40); then, sent to the same server
    again, they met the replacement while it loaded its model, and its 503. Now the retry
    is dispatched again, to the hold server, which lets them go when the replacement is in
    rotation. The request the dead process had received is not replayed: a JSON 502.

    One race is the kernel's: the dying process's connections may close before its
    listening socket, and the first queued request, handed over in that instant, is
    accepted and then cut like the one being answered (2 of 5 runs here): a 502 too, never
    more than that one, and never for a request sent after the death.

    `daemon`: the daemon takes the instance out of rotation when it sees it dead and puts
    it back once its own probe passes, as it does; or it has not seen the death yet, and
    HAProxy's own checks alone decide (a refused connection marks the server down, and
    the replacement's /health is a 503 until its model is loaded)."""
    front = door(models='[model]\npath = "/m.gguf"\n[placement]\nnodes = [0]\n', count=1)
    api = _started(front)
    got: dict[str, tuple[Answer, float]] = {}
    crashing = _timed(front, "crash", {"messages": [{"role": "user", "content": CRASH_MARKER}]}, got)
    wait_for(lambda: front.log("stub0") == ["crash"], "the crashing request at the stub")
    queued = [_timed(front, f"queued{n}", CHAT, got) for n in range(3)]  # behind it: one slot (maxconn 1)
    crashing.join(30)
    assert got["crash"][0].status == 502 and got["crash"][0].error()["type"] == "server_error", got["crash"]
    time.sleep(0.3)  # past the instant of the death
    late = _timed(front, "late", CHAT, got)  # HAProxy may or may not have seen the death yet
    if daemon:
        (name,) = _out(api)  # out of rotation while it restarts the instance
    time.sleep(2.0)
    early = {k: (v[0].status, round(v[1], 2)) for k, v in got.items() if k != "crash"}
    cut = [k for k, (status, _) in early.items() if status == 502]
    assert len(cut) <= 1 and cut == list(early), early  # waiting, not refused (but the race's one)
    # The replacement, on the same port: it listens at once and, like llama-server, answers
    # 503 "Loading model" for 3 s. The daemon puts it back in rotation once its probe passes.
    front.start_stub(0, loading_s=3.0)
    if daemon:
        wait_for(lambda: _get(front.ports[0], "/health")[0] == 200, "the replacement loaded", timeout_s=10)
        api.set_state(BACKEND, name, AdminState.READY)
    for thread in [*queued, late]:
        thread.join(40)
    answers = {k: (v[0].status, v[0].body[:80], round(v[1], 2)) for k, v in got.items()}
    served = [k for k in (*(f"queued{n}" for n in range(3)), "late")
              if got[k][0].status == 200 and got[k][0].served_by() == "stub0"]
    assert sorted(served + cut) == ["late", "queued0", "queued1", "queued2"] and len(served) >= 3, answers
    assert front.log("stub0").count("crash") == 1  # never replayed
