"""Several models behind one front door (issue 31): the rendered haproxy.cfg, then a real
HAProxy over stub servers, each logging the X-Test-Id of every request it got, so each
test says on the server side which model's instance a request reached."""

from __future__ import annotations

from numad_infer.config.models import served_models

import json
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.frontdoor.haproxy import AdminState, RuntimeAPI, merged
from numad_infer.frontdoor.haproxy_config import BACKEND, SPARE_CONNECTIONS, Paths, body_buffer, render_haproxy
from numad_infer.frontdoor.routing import backends, models_list, routed
from tests.daemon_harness import free_port_block, wait_for
from tests.fakes import load_of
from tests.frontdoor.harness import plan_for
from tests.frontdoor.harness import Door as ControlDoor
from tests.frontdoor.harness import SLOW_MARKER, Answer, FrontDoor, _get

TWO = ('[[models]]\nname = "alpha"\naliases = ["gpt-4o-mini"]\npath = "/a.gguf"\ncontext_size = 32768\n'
       '[[models]]\nname = "beta"\naliases = ["b:latest"]\npath = "/b.gguf"\ncontext_size = 2048\nparallel = 2\n'
       '[server]\nparallel = 4\n')
# plan_for's host has two nodes: alpha-0, alpha-1 on stubs 0 and 1, beta-0, beta-1 on 2 and 3.
ALPHA, BETA = ("stub0", "stub1"), ("stub2", "stub3")


def _render(tmp_path: Path, text: str) -> str:
    config = parse_config(text, "/etc/numa-infer.toml")
    paths = Paths(tmp_path / "haproxy.cfg", tmp_path / "state", tmp_path / "sock")
    served, engine = load_of(config)
    return render_haproxy(config, plan_for(tmp_path, config), paths, served=served, engine=engine)


def test_two_models_get_a_backend_each_with_their_own_slots_queue_and_a_route_by_name_or_alias(
        tmp_path: Path) -> None:
    text = _render(tmp_path, TWO)
    alpha, beta = text.split("\nbackend model-alpha\n")[1].split("\nbackend model-beta\n")
    assert "maxconn 4 observe" in alpha and "maxconn 2 observe" in beta  # per-model parallel
    assert "{ queue(model-alpha) ge 64 }" in alpha and "{ queue(model-beta) ge 64 }" in beta
    assert "    server infer-alpha-0 " in alpha and "infer-beta" not in alpha
    assert "    server infer-beta-1 " in beta and "infer-alpha" not in beta
    assert f"backend {BACKEND}\n" not in text and "default_backend" not in text
    assert "    use_backend model-alpha if { var(txn.model) -m str alpha gpt-4o-mini }\n" in text
    assert "    use_backend model-beta if { var(txn.model) -m str beta b:latest }\n" in text
    # The buffer holds the longest context of the two (alpha's), routing needs it without affinity.
    assert "    tune.bufsize 278528\n" in text
    # 2 instances x 4 slots + 2 x 2, and per backend a queue and holds: arriving ones, and
    # on its hold server, two connections each (the client's, the hold server's).
    assert f"    maxconn {8 + 4 + 2 * 4 * 64 + SPARE_CONNECTIONS}\n" in text


def test_one_model_in_either_form_reads_no_model_from_the_body(tmp_path: Path) -> None:
    single = _render(tmp_path / "a", '[model]\npath = "/m.gguf"\nname = "alpha"\n')
    assert f"    default_backend {BACKEND}\n" in single and "txn.model" not in single
    one = _render(tmp_path / "b", '[[models]]\nname = "alpha"\npath = "/a.gguf"\n')
    assert "    default_backend model-alpha\n" in one and "txn.model" not in one and "{ path /v1/models" not in one
    # Without affinity on the body, nothing reads it, and HAProxy keeps its own buffer size.
    plain = _render(tmp_path / "c", '[model]\npath = "/m.gguf"\nname = "alpha"\n[frontend]\naffinity = "none"\n')
    assert "json_query" not in plain and "bufsize" not in plain
    assert not routed(served_models(parse_config('[[models]]\nname = "alpha"\npath = "/a.gguf"\n', "cfg")))


def test_the_model_list_names_every_model_then_every_alias_with_its_model() -> None:
    config = parse_config(TWO, "cfg")
    served = served_models(config)
    assert json.loads(models_list(served)) == {"object": "list", "data": [
        {"id": "alpha", "object": "model", "created": 0, "owned_by": "numa-infer"},
        {"id": "beta", "object": "model", "created": 0, "owned_by": "numa-infer"},
        {"id": "gpt-4o-mini", "object": "model", "created": 0, "owned_by": "numa-infer", "parent": "alpha"},
        {"id": "b:latest", "object": "model", "created": 0, "owned_by": "numa-infer", "parent": "beta"}]}
    assert backends(served) == {"alpha": "model-alpha", "beta": "model-beta"}
    assert body_buffer(served) == 32768 * 8 + 16 * 1024


@pytest.fixture
def door(tmp_path: Path):
    base = free_port_block(5)
    config = parse_config(f'{TWO}base_port = {base + 1}\n[frontend]\nlisten = "127.0.0.1:{base}"\n'
                          'queue_size = 1\n', "/etc/numa-infer.toml")
    made = FrontDoor(tmp_path, config, tmp_path / "state dir", [base + 1 + k for k in range(4)])
    yield made
    made.stop()


def _start(door: FrontDoor, stubs: range = range(4)) -> None:
    for k in stubs:
        door.start_stub(k)
    door.start_haproxy()
    api = RuntimeAPI(str(door.run_dir / "haproxy.sock"))
    wanted = len(stubs)
    wait_for(lambda: sum(s.status == "UP" for b in ("model-alpha", "model-beta")
                         for s in api.backend(b).instances.values()) == wanted, f"{wanted} servers UP")


def _post(door: FrontDoor, test_id: str, body: bytes) -> Answer:
    req = urllib.request.Request(f"http://127.0.0.1:{door.port}/v1/chat/completions", method="POST", data=body,
                                 headers={"Content-Type": "application/json", "X-Test-Id": test_id})
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return Answer(response.status, response.headers.get_content_type(), response.read())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.headers.get_content_type(), exc.read())


def _seen_by(door: FrontDoor, stubs: tuple[str, ...]) -> list[str]:
    return [test_id for stub in stubs for test_id in door.log(stub)]


def test_requests_reach_their_models_instances_by_name_or_alias_and_others_get_a_json_404(door) -> None:
    _start(door)
    for n, model in enumerate(["alpha", "gpt-4o-mini", "beta", "b:latest"] * 3):
        answer = door.post(f"{model}.{n}", {"model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status == 200, answer
    assert sorted(_seen_by(door, ALPHA)) == sorted(f"{m}.{n}" for n in range(12) for m in ["alpha", "gpt-4o-mini"]
                                                   if (n % 4) == ["alpha", "gpt-4o-mini"].index(m))
    assert sorted(_seen_by(door, BETA)) == sorted(f"{m}.{n}" for n in range(12) for m in ["beta", "b:latest"]
                                                  if (n % 4) == 2 + ["beta", "b:latest"].index(m))
    wrong = {"unknown": b'{"model": "gamma"}', "missing": b'{"messages": []}', "number": b'{"model": 7}',
             "array": b'{"model": ["alpha"]}', "object": b'{"model": {"id": "alpha"}}', "null": b'{"model": null}',
             "case": b'{"model": "Alpha"}', "not-json": b"model=alpha", "empty": b""}
    for test_id, body in wrong.items():
        error = _post(door, test_id, body).error()
        assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error", (test_id, error)
        assert error["message"].endswith("served models: alpha, beta"), error
    assert not set(wrong) & {*_seen_by(door, ALPHA), *_seen_by(door, BETA)}


def test_a_100_kb_prompt_before_model_routes_right_and_model_beyond_the_buffer_is_a_json_413(door) -> None:
    _start(door)
    prompt = "lorem ipsum " * (100_000 // 12)
    # `model` last, after a 100 KB prompt: inside the buffer (alpha's 32768-token context).
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "model": "b:latest"}).encode()
    assert len(body) > 100_000
    assert _post(door, "long", body).status == 200
    assert _seen_by(door, BETA) == ["long"] and _seen_by(door, ALPHA) == []
    # Longer than any context the models accept: `model` at the end is never read.
    huge = json.dumps({"messages": [{"role": "user", "content": prompt * 4}], "model": "beta"}).encode()
    answer = _post(door, "huge", huge)
    assert answer.status == 413 and answer.error()["code"] == "request_too_large", answer
    assert "send `model` before `messages`" in answer.error()["message"]
    # The same body with `model` first is routed.
    first = json.dumps({"model": "alpha", "messages": [{"role": "user", "content": prompt * 4}]}).encode()
    assert _post(door, "first", first).status == 200
    assert _seen_by(door, ALPHA) == ["first"] and _seen_by(door, BETA) == ["long"]


def test_the_model_list_is_answered_with_every_instance_down_or_busy(door) -> None:
    door.start_haproxy()  # no instance at all
    status, doc, took = _get(door.port, "/v1/models")
    assert status == 200 and [m["id"] for m in doc["data"]] == ["alpha", "beta", "gpt-4o-mini", "b:latest"]
    assert took < 1.0
    # One model by id, as OpenAI's "retrieve model"; an alias names its model as parent.
    assert _get(door.port, "/v1/models/beta")[:2] == (200, {"id": "beta", "object": "model", "created": 0,
                                                            "owned_by": "numa-infer"})
    assert _get(door.port, "/v1/models/b:latest")[1]["parent"] == "beta"
    status, doc, _ = _get(door.port, "/v1/models/gamma")
    assert status == 404 and doc["error"]["code"] == "model_not_found"
    door.start_stub(0)
    door.start_stub(2)
    api = RuntimeAPI(str(door.run_dir / "haproxy.sock"))
    wait_for(lambda: merged([api.backend("model-alpha"), api.backend("model-beta")]).servers["infer-beta-0"].status
             == "UP", "beta-0 UP")
    slow = [threading.Thread(target=door.post, args=(f"slow{n}", {"model": "beta", "prompt": SLOW_MARKER}))
            for n in range(3)]
    for thread in slow:
        thread.start()
    wait_for(lambda: api.backend("model-beta").in_flight >= 2, "beta's slots taken")
    status, doc, took = _get(door.port, "/v1/models")
    assert status == 200 and len(doc["data"]) == 4 and took < 1.0, took
    for thread in slow:
        thread.join(30)


def test_health_is_200_only_while_every_model_has_an_instance_in_rotation(door) -> None:
    door.start_haproxy()
    wait_for(lambda: _get(door.port, "/healthz")[:2] == (503, {
        "status": "unavailable", "reason": "model alpha has no instance in rotation (starting, draining or down)"}),
        "503 naming alpha")
    door.start_stub(0)
    wait_for(lambda: _get(door.port, "/healthz")[1].get("reason", "").startswith("model beta"), "503 naming beta")
    door.start_stub(3)
    wait_for(lambda: _get(door.port, "/healthz")[:2] == (200, {"status": "ok"}), "200")


@pytest.mark.skipif(os.geteuid() != 0, reason="the process backend's HAProxy switches users: needs root")
def test_the_daemons_front_door_reads_and_moves_each_models_servers_in_their_own_backend(tmp_path: Path) -> None:
    made = ControlDoor(tmp_path)
    base = free_port_block(5)
    made.config = parse_config(f'{TWO}base_port = {base + 1}\n[frontend]\nlisten = "127.0.0.1:{base}"\n'
                               'haproxy = "/usr/sbin/haproxy"\n')
    made.plan = plan_for(tmp_path / "multi", made.config)
    try:
        made.start()
        door = made.door
        assert door.observe() is not None
        assert set(door.model_stats) == {"alpha", "beta"}
        assert set(door.model_stats["beta"].instances) == {"infer-beta-0", "infer-beta-1"}
        assert door.stats is not None and len(door.stats.instances) == 4
        beta0 = next(i for i in made.plan.instances if i.name == "infer@beta-0")
        assert door.backend_of(beta0) == "model-beta"
        door.set_state(beta0, AdminState.MAINT)
        assert door.model_stats["beta"].servers["infer-beta-0"].admin == AdminState.MAINT  # this pass's view
        door.observe()
        assert door.model_stats["beta"].servers["infer-beta-0"].admin == AdminState.MAINT  # HAProxy's
        assert door.model_stats["alpha"].servers["infer-alpha-0"].admin == AdminState.READY
        assert door.requests_left() == 0
    finally:
        made.stop()
