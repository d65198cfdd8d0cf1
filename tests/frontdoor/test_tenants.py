"""Tenants at the front door (issue 39, frontdoor/tenants.py): the daemon's own front door
code over a real HAProxy, with in-process stand-ins for the instances that echo the
Authorization header they got. Keys reach HAProxy through the key files only; a rotation is
a reload of HAProxy, never a restart."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from numad_infer.config.apikey import read_tenant_keys
from numad_infer.config.tenants import TenantKey
from numad_infer.config.load import parse_config
from numad_infer.errors import ConfigError
from numad_infer.frontdoor import tenants
from numad_infer.frontdoor.haproxy import AdminState
from numad_infer.frontdoor.haproxy_config import BACKEND
from tests.daemon_harness import wait_for
from tests.frontdoor.harness import Door, with_haproxy

from tests.frontdoor.tenant_door import (INSTANCE_KEY, KEY_A, KEY_B, LONG_STREAM, SLOW, STREAM_GAP_S, TWO_MODELS,
                                        Reply, key_file, post, tenant_tables)


@with_haproxy
def test_a_request_without_a_known_key_gets_a_json_401_and_a_known_key_is_served(door_with) -> None:
    door = door_with()
    for key in (None, "not-a-key", KEY_A + "x"):
        reply = post(door.port, key)
        assert reply.status == 401, reply
        assert reply.headers["WWW-Authenticate"] == "Bearer"
        assert reply.body["error"]["code"] == 401 and "API key" in reply.body["error"]["message"]
    # The models list is behind the key too.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{door.port}/v1/models", timeout=10)
    assert refused.value.code == 401
    for key in (KEY_A, KEY_B):
        reply = post(door.port, key, model="beta")
        assert reply.status == 200, reply
        # The tenant's key stays at the front door: the instances require none here.
        assert reply.body["authorization"] is None


@with_haproxy
def test_the_instances_get_their_own_key_and_never_the_tenants(door_with, keys_dir: Path) -> None:
    key_file(keys_dir, "instance", INSTANCE_KEY)
    door = door_with(server=f'api_key_file = "{keys_dir / "instance"}"\n')
    reply = post(door.port, KEY_B)
    assert reply.status == 200 and reply.body["authorization"] == f"Bearer {INSTANCE_KEY}"
    # A client sending the instances' key is no tenant.
    assert post(door.port, INSTANCE_KEY).status == 401


@with_haproxy
def test_keys_reach_haproxy_only_through_files_that_only_it_may_read(door_with) -> None:
    door = door_with()
    paths = door.door.paths
    text = paths.config.read_text()
    assert KEY_A not in text and KEY_B not in text and str(paths.keys[0]) in text
    assert KEY_A not in repr(door.keys) and "team-a" in repr(door.keys)
    for path in paths.keys:
        info = path.stat()
        gid = door.door.runner.haproxy_gid
        assert info.st_uid == os.geteuid()
        assert stat.S_IMODE(info.st_mode) == (0o640 if gid is not None else 0o600)
        if gid is not None:
            assert info.st_gid == gid
    assert f"{KEY_A} team-a\n" in paths.keys[0].read_text()


@with_haproxy
def test_a_model_the_tenant_may_not_use_gets_a_json_403(door_with) -> None:
    door = door_with(b='models = ["beta"]\n')
    assert post(door.port, KEY_B, model="beta").status == 200
    reply = post(door.port, KEY_B, model="alpha")
    assert reply.status == 403, reply
    assert reply.body["error"]["type"] == "permission_error" and "alpha" in reply.body["error"]["message"]
    assert post(door.port, KEY_A, model="alpha").status == 200  # team-a may use every model


def _get(port: int, path: str, key: str) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@with_haproxy
def test_a_refused_request_does_not_count_against_requests_per_minute(door_with) -> None:
    # The fixture's readiness probe is team-a's; team-b's minute starts here.
    door = door_with(b='models = ["beta"]\nrequests_per_minute = 3\n')
    assert [post(door.port, KEY_B, model="alpha").status for _ in range(3)] == [403] * 3
    assert [post(door.port, KEY_B, model="gamma").status for _ in range(2)] == [404] * 2  # not served
    assert [post(door.port, KEY_B, model="beta").status for _ in range(4)] == [200, 200, 200, 429]


@with_haproxy
def test_the_model_list_shows_a_tenant_only_the_models_it_may_use(door_with) -> None:
    door = door_with(b='models = ["beta"]\n')
    status, doc = _get(door.port, "/v1/models", KEY_B)
    assert status == 200 and [m["id"] for m in doc["data"]] == ["beta"], doc
    status, doc = _get(door.port, "/v1/models/alpha", KEY_B)
    assert status == 404 and doc["error"]["code"] == "model_not_found", doc
    assert _get(door.port, "/v1/models/beta", KEY_B)[0] == 200
    status, doc = _get(door.port, "/v1/models", KEY_A)  # team-a may use every model
    assert status == 200 and [m["id"] for m in doc["data"]] == ["alpha", "beta"], doc
    assert _get(door.port, "/v1/models/alpha", KEY_A)[0] == 200


def _at_once(port: int, key: str, count: int) -> list[Reply]:
    replies: list[Reply] = []
    threads = [threading.Thread(target=lambda: replies.append(post(port, key, content=SLOW))) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return replies


@with_haproxy
def test_a_tenant_over_its_requests_in_flight_gets_a_json_429_and_the_other_tenant_is_served(door_with) -> None:
    door = door_with(a="max_in_flight = 2\n")
    results: list[list[Reply]] = []
    flood = threading.Thread(target=lambda: results.append(_at_once(door.port, KEY_A, 5)))
    flood.start()
    # While team-a's slow requests run, team-b is served.
    time.sleep(0.5)
    assert post(door.port, KEY_B).status == 200
    flood.join(30)
    statuses = sorted(r.status for r in results[0])
    assert statuses == [200, 200, 429, 429, 429], statuses
    refused = next(r for r in results[0] if r.status == 429)
    assert refused.headers["Retry-After"] == "1" and refused.body["error"]["type"] == "rate_limit_exceeded"
    assert "2 request(s) in flight" in refused.body["error"]["message"]
    # Answered requests leave the count: the next one is served.
    assert post(door.port, KEY_A).status == 200


@with_haproxy
def test_a_tenant_over_its_requests_per_minute_gets_a_json_429_and_refusals_do_not_count(door_with) -> None:
    door = door_with(a="requests_per_minute = 4\n")
    # The fixture's readiness probe was team-a's first request of the minute.
    statuses = [post(door.port, KEY_A).status for _ in range(6)]
    assert statuses == [200, 200, 200, 429, 429, 429], statuses
    refused = post(door.port, KEY_A)
    assert refused.status == 429 and refused.headers["Retry-After"] == "15"
    assert post(door.port, KEY_B).status == 200


@with_haproxy
def test_a_rotated_key_is_a_reload_that_refuses_the_old_key_from_the_next_request(door_with, keys_dir: Path) -> None:
    door = door_with()
    master = door.master
    # A slow request of team-b runs across the rotation of team-a's key.
    slow: list[Reply] = []
    running = threading.Thread(target=lambda: slow.append(post(door.port, KEY_B, content=SLOW)))
    running.start()
    time.sleep(0.3)
    new_key = "team-a-new-" + "d" * 40
    key_file(keys_dir, "a", new_key)
    keys = read_tenant_keys(door.config, "test.toml")
    assert door.apply(keys)  # the rules are the same; the keys are not: a reload
    wait_for(lambda: post(door.port, new_key).status == 200, f"the new key served\n{door.log()}")
    assert post(door.port, KEY_A).status == 401
    running.join(30)
    assert [r.status for r in slow] == [200]
    assert door.master == master  # reloaded, not restarted
    assert not door.apply(keys)  # the same keys again: nothing to do


@with_haproxy
def test_conversations_keep_their_instances_across_the_reload_of_a_key_rotation(door_with, keys_dir: Path) -> None:
    """Prefix routing's homes outlive a reload: a new HAProxy process starts with empty Lua
    tables, and the daemon hands it the last one's homes (affinity.py). Eight conversations
    start while instance X is busy, so all are homed on Y; after a key rotation (a reload)
    each next turn goes to Y again. A fresh HAProxy on an idle fleet would send about half
    of them to X (the highest score among equals)."""
    door = door_with(models='[model]\npath = "/m.gguf"\nname = "alpha"\n', server="parallel = 1\n")
    busy = threading.Thread(target=post, args=(door.port, KEY_B), kwargs={"content": SLOW})
    busy.start()
    time.sleep(0.5)
    first = {post(door.port, KEY_A, content=f"conversation {n}").body["port"] for n in range(8)}
    busy.join(30)
    assert len(first) == 1, first  # all on the instance that was free
    master = door.master
    new_key = "team-a-new-" + "e" * 40
    key_file(keys_dir, "a", new_key)
    assert door.apply(read_tenant_keys(door.config, "test.toml"))
    wait_for(lambda: post(door.port, KEY_A).status == 401, f"the reload\n{door.log()}")
    assert door.master == master  # reloaded, not restarted
    after = []
    for n in range(8):
        # HAProxy counts a request a moment past its answer: sent at once, the next turn
        # would find its home busy and, a first turn, not wait for it (affinity.py).
        wait_for(lambda: door.door.api.backend(BACKEND).in_flight == 0, "the last request let go")
        after.append(post(door.port, new_key, content=f"conversation {n}").body["port"])
    assert set(after) == first, (first, after)
    homes = door.door.paths.homes  # hashes of prompts' first bytes: HAProxy's group may read them, no one else
    assert stat.S_IMODE(homes.stat().st_mode) == 0o640, oct(homes.stat().st_mode)
    lines = homes.read_text().splitlines()  # "backend server key", nothing else (no blank line)
    assert len(lines) >= 8 and all(len(line.split()) == 3 for line in lines), lines


def test_tenant_keys_are_checked_as_the_instances_key_is(tmp_path: Path, keys_dir: Path) -> None:
    def config(a: str = "", b: str = "", front: str = "") -> str:
        return (f'[model]\npath = "/m.gguf"\nname = "alpha"\n{front}'
                + tenant_tables(keys_dir, a, b))

    key_file(keys_dir, "a", KEY_A)
    key_file(keys_dir, "b", KEY_A)
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.key_file .*same key as tenant team-a"):
        read_tenant_keys(parse_config(config()), "t.toml")
    key_file(keys_dir, "b", "has#hash")
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.key_file .*Bearer token"):
        read_tenant_keys(parse_config(config()), "t.toml")
    key_file(keys_dir, "b", KEY_B)
    (keys_dir / "b").chmod(0o644)
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.key_file .*chmod 600"):
        read_tenant_keys(parse_config(config()), "t.toml")
    (keys_dir / "b").chmod(0o600)
    assert [k.tenant for k in read_tenant_keys(parse_config(config()), "t.toml")] == ["team-a", "team-b"]
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.models\[0\] = \"gamma\": is not a model served here"):
        parse_config(config(b='models = ["gamma"]\n'))
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.models = \[\]: is empty"):
        parse_config(config(a="models = []\n"))
    with pytest.raises(ConfigError, match=r"tenants: needs the front door"):
        parse_config(config(front='[frontend]\nlisten = ""\n'))
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.name = \"team-a\": is already another tenant's"):
        parse_config(config().replace('name = "team-b"', 'name = "team-a"'))


def test_the_gate_is_empty_without_tenants_and_the_key_files_hold_one_line_each() -> None:
    assert tenants.gate([], "k", "u", instance_key=True) == [] and tenants.table([]) == []
    text = tenants.keys_text((TenantKey("team-a", KEY_A), TenantKey("team-b", KEY_B)))
    assert text.splitlines()[1:] == [f"{KEY_A} team-a", f"{KEY_B} team-b"]
    assert tenants.upstream_text(None) == tenants.HEADER
    assert tenants.upstream_text("k").endswith("instances Bearer k\n")


def test_the_stick_tables_lines_give_each_tenants_in_flight_and_last_minute() -> None:
    text = ("# table: tenant-usage, type: string, size:2, used:2\n"
            "0x7fe5240374d0: key=flood use=2 exp=0 gpc0=12 gpc0_rate(60000)=7\n"
            "0x7fe5240345c0: key=quiet use=0 exp=0 gpc0=3 gpc0_rate(60000)=3\n\n")
    assert tenants.parse_usage(text) == {"flood": tenants.TenantCount(2, 7), "quiet": tenants.TenantCount(0, 3)}
    assert tenants.parse_usage("") == {}


def test_status_and_metrics_show_each_tenant_with_labels_from_the_configuration_only() -> None:
    from numad_infer.cli.present import _tenant_line
    from numad_infer.status.metrics import _tenant_metrics
    from numad_infer.status.records import TenantStatus
    from numad_infer.util.histogram import Histogram

    first = Histogram((0.1, 1.0), (1, 1, 0), 0.55, 2)
    shown = (TenantStatus("team-a", 1, 5, {"200": 4, "429": 2}, first, first, 120, 30, 3), TenantStatus("team-b"))
    assert _tenant_line(shown[0]) == ("  tenant team-a: 1 in flight, 5 let through in the last minute; answers since "
                                      "the daemon started: 200 x4, 429 x2; tokens 120 prompt, 30 completion in 3 "
                                      "answer(s)")
    assert _tenant_line(shown[1]) == "  tenant team-b: answers since the daemon started: none"
    families = {f.name: f for f in _tenant_metrics(shown)}
    assert [(s.labels, s.value) for s in families["numa_infer_tenant_requests"].samples if s.name.endswith("_total")] \
        == [({"tenant": "team-a", "code": "200"}, 4), ({"tenant": "team-a", "code": "429"}, 2)]
    assert [s.labels["tenant"] for s in families["numa_infer_tenant_requests_in_flight"].samples] == ["team-a"]
    assert [(s.labels, s.value) for s in families["numa_infer_tenant_tokens"].samples if s.name.endswith("_total")] \
        == [({"tenant": "team-a", "kind": "prompt"}, 120), ({"tenant": "team-a", "kind": "completion"}, 30)]
    assert {s.labels["tenant"] for f in families.values() for s in f.samples} == {"team-a"}


@with_haproxy
def test_each_tenants_tokens_are_counted_from_its_answers_whole_or_streamed(door_with) -> None:
    door = door_with()
    timings = door.door.requests.timings
    wait_for(lambda: "team-a" in timings.tenants(), "the first request's log line")  # the fixture's own
    before = timings.tenants()["team-a"]
    for _ in range(3):
        assert post(door.port, KEY_A).status == 200
    assert post(door.port, KEY_B, more={}).status == 200
    streams = [post_stream(door.port, KEY_A), post_stream(door.port, KEY_A, usage=True),
               post_stream(door.port, KEY_A, long=True)]
    for (first_s, streamed), events in zip(streams, (3, 3, 3 + LONG_STREAM), strict=True):
        assert first_s < STREAM_GAP_S * 0.8, first_s  # its first token was not held for the token count
        assert streamed.count(b"data: ") == events and streamed.endswith(b"data: [DONE]\n\n")  # passed on whole
    wait_for(lambda: timings.tenants()["team-a"].answers.get("200", 0) == before.answers.get("200", 0) + 6,
             "the log lines of team-a's requests", detail=door.log)
    used = timings.tenants()["team-a"]
    # Three answers sent whole (11 + 3 each), two streams with llama-server's timings only (5
    # from the cache + 2 read, 4 made), a stream with usage (11 + 3): the model's text counts not.
    assert (used.prompt_tokens - before.prompt_tokens, used.completion_tokens - before.completion_tokens,
            used.counted_answers - before.counted_answers) == (33 + 7 + 11 + 7, 9 + 4 + 3 + 4, 6)
    wait_for(lambda: timings.tenants().get("team-b") is not None, "team-b's line")
    assert (timings.tenants()["team-b"].prompt_tokens, timings.tenants()["team-b"].counted_answers) == (11, 1)


@with_haproxy
def test_the_token_filter_under_load_fails_nothing_and_holds_nothing(door_with) -> None:
    """Many answers at once, whole and streamed, later turns among them (the prefix pick and
    its wait run on the same streams as the token filter): no Lua error in HAProxy's log, no
    request left unanswered. A smoke test: the failure that a Lua action on the response
    caused beside the filter (HAProxy 2.6: "attempt to index a thread value", answers left
    stuck) showed only under bench/tenants.py's priority load, not here."""
    door = door_with(models='[model]\npath = "/m.gguf"\nname = "alpha"\n', server="parallel = 1\n")
    failures: list[object] = []
    stop = time.monotonic() + 12

    def client(n: int) -> None:
        while time.monotonic() < stop:
            try:
                if n % 3 == 0:
                    post_stream(door.port, KEY_A)
                else:
                    history = {"messages": [{"role": "user", "content": f"conversation {n}"},
                                            {"role": "assistant", "content": "yes"},
                                            {"role": "user", "content": "and then"}]}
                    reply = post(door.port, KEY_B, more={})
                    assert reply.status == 200, reply
                    data = json.dumps({"model": "alpha", **history}).encode()
                    req = urllib.request.Request(f"http://127.0.0.1:{door.port}/v1/chat/completions", data=data,
                                                 headers={"Authorization": f"Bearer {KEY_A}"})
                    with urllib.request.urlopen(req, timeout=30) as response:
                        assert response.status == 200
            except Exception as exc:  # any failure is the finding
                failures.append(exc)

    clients = [threading.Thread(target=client, args=(n,)) for n in range(6)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(60)
    assert failures == [] and not any(t.is_alive() for t in clients), (failures[:3], door.log()[-3000:])
    assert "Lua" not in door.log(), door.log()[-2000:]


def post_stream(port: int, key: str, usage: bool = False, long: bool = False) -> tuple[float, bytes]:
    """Seconds to the first event, and the whole stream (`usage`: ask for OpenAI's usage;
    `long`: LONG_STREAM more events)."""
    data = json.dumps({"model": "alpha", "stream": True, "messages": [{"role": "user", "content": "hi"}],
                       **({"stream_options": {"include_usage": True}} if usage else {}),
                       **({"long": True} if long else {})}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=data,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    started = time.monotonic()
    with urllib.request.urlopen(req, timeout=30) as response:
        first = response.readline()
        took = time.monotonic() - started
        return took, first + response.read()


@with_haproxy
def test_a_batch_tenants_queued_requests_let_an_interactive_request_pass(door_with) -> None:
    """Two instances of one slot each, kept busy by batch requests with five more of them
    queued; an interactive request, sent after them, is served at the first free slot: in
    arrival order it would wait for all five (three more rounds of 2 s). Batch: team-b's
    class, and team-a's own request that asks for it with `X-Priority: batch` (sent before
    the interactive one, it is served after it). team-b asking for `interactive` stays
    batch: a header lowers a request's class, never raises it."""
    door = door_with(models='[model]\npath = "/m.gguf"\nname = "alpha"\n', b='priority = "batch"\n')
    finished: list[tuple[str, float]] = []
    started = time.monotonic()

    def ask(key: str, who: str, more: dict | None = None) -> None:
        assert post(door.port, key, content=f"{who} {SLOW}", more=more).status == 200
        finished.append((who, time.monotonic() - started))

    batch = [threading.Thread(target=ask, args=(KEY_B, "batch", {"X-Priority": "interactive"})) for _ in range(6)]
    for thread in batch:
        thread.start()
    wait_for(lambda: door.door.api.backend("instances").queued >= 4, "four batch requests queued")
    batch.append(threading.Thread(target=ask, args=(KEY_A, "asked-batch", {"X-Priority": "batch"})))
    batch[-1].start()
    wait_for(lambda: door.door.api.backend("instances").queued >= 5, "team-a's batch request queued")
    interactive = threading.Thread(target=ask, args=(KEY_A, "interactive"))
    interactive.start()
    for thread in [*batch, interactive]:
        thread.join(30)
    order = [who for who, _ in sorted(finished, key=lambda f: f[1])]
    assert len(order) == 8 and order.index("interactive") <= 3 < order.index("asked-batch"), finished
    text = door.door.paths.config.read_text()
    assert ("    http-request set-var(txn.batch) bool(true) if { var(txn.tenant) -m str team-b } || "
            "{ req.hdr(x-priority) -m str -i batch }\n"
            "    http-request set-priority-offset int(10000) if { var(txn.batch) -m bool }\n") in text


@with_haproxy
@pytest.mark.parametrize("deadlines", ["own", "shared"])
def test_each_class_waits_up_to_its_own_queue_deadline(door_with, deadlines: str) -> None:
    """Two instances of one slot, each request 2 s. B1, B2 take the slots; B3-B6 (batch)
    wait, then I (interactive). Interactive deadline 3 s; batch 5 s (`own`) or also 3 s
    (`shared`, what HAProxy's one queue timeout gave before). At 2 s I passes the waiting
    batch requests (with B3); at 4 s B4 and B5 get the slots, having waited 4 s, past the
    interactive deadline but within their own; B6 would get one at 6 s, past its 5 s: a
    JSON 503 with Retry-After at 5 s. With one shared deadline, B4-B6 get that 503 at 3 s.
    No interactive reserve: B1 and B2 take both slots (the reserve has its own test)."""
    own = deadlines == "own"
    door = door_with(models='[model]\npath = "/m.gguf"\nname = "alpha"\n', server="parallel = 1\n",
                     b='priority = "batch"\n',
                     frontend="queue_timeout_s = 3\n" + ("batch_queue_timeout_s = 5\n" if own else "")
                     + "[tuning]\ninteractive_reserve = 0\n")
    api = door.door.api
    results: dict[str, tuple[Reply, float]] = {}
    started = time.monotonic()

    def ask(key: str, who: str) -> None:
        sent = time.monotonic()
        # Each its own conversation: one prompt for all would be one prefix key, and the
        # second request would wait for the first's instance (tuning.prefix_wait_s).
        reply = post(door.port, key, content=f"{who} {SLOW}")
        results[who] = (reply, time.monotonic() - sent)

    def send(key: str, who: str, waiting: int) -> threading.Thread:
        thread = threading.Thread(target=ask, args=(key, who))
        thread.start()
        wait_for(lambda: api.backend("instances").queued >= waiting - 2, f"{who} waiting")
        return thread

    threads = [threading.Thread(target=ask, args=(KEY_B, f"B{n}")) for n in (1, 2)]
    for thread in threads:
        thread.start()
    wait_for(lambda: api.backend("instances").in_flight == 2, "B1 and B2 at the instances")
    threads += [send(KEY_B, f"B{n}", n) for n in range(3, 7)]  # one by one: their order is known
    threads.append(send(KEY_A, "I", 7))
    waiting = api.backend("instances")  # status's figures: at the instances, and the rest
    assert (waiting.in_flight, waiting.queued) == (2, 5), waiting
    for thread in threads:
        thread.join(30)
    statuses = {who: reply.status for who, (reply, _) in results.items()}
    ended = {who: took for who, (_, took) in results.items()}
    assert statuses["I"] == 200 and ended["I"] < 4.9, (statuses, ended)  # with B3, before B4 and B5
    assert statuses["B1"] == statuses["B2"] == statuses["B3"] == 200, statuses
    late = ("B4", "B5", "B6")
    if own:
        assert statuses["B4"] == statuses["B5"] == 200 and min(ended["B4"], ended["B5"]) > 4.0, (statuses, ended)
        refused, waited = results["B6"][0], ended["B6"]
        assert refused.status == 503 and refused.headers["Retry-After"] == "1", refused
        assert refused.body["error"]["code"] == 503 and 4.5 < waited < 5.9, (refused, waited)
        text = door.door.paths.config.read_text()
        assert "    http-request lua.numa_batch_wait 5000 64 0 if { var(txn.batch) -m bool } !{ fe_name hold }" in text
        # With no instance in rotation, a batch request's hold lasts its own deadline too.
        assert ("    http-request lua.numa_hold 3000 64 if !{ var(txn.batch) -m bool }\n"
                "    http-request lua.numa_hold 5000 64 if { var(txn.batch) -m bool }\n") in text
    else:
        assert all(statuses[w] == 503 for w in late) and all(2.5 < ended[w] < 3.9 for w in late), (statuses, ended)
        assert "numa_batch_wait" not in door.door.paths.config.read_text()
    assert time.monotonic() - started < 20


@with_haproxy
def test_interactive_requests_find_a_slot_kept_for_them_while_they_come(door_with) -> None:
    """Two instances of one slot, each request 2 s; the default reserve of 1 slot. The
    fixture's first request (team-a, interactive) starts the reserve: B1 (batch) takes one
    slot, B2 waits in the front door beside the free one, and I (interactive) sent then is
    answered in one request's time, not after B1's. Once no interactive request has come for
    10 s, batch takes every slot."""
    door = door_with(models='[model]\npath = "/m.gguf"\nname = "alpha"\n', server="parallel = 1\n",
                     b='priority = "batch"\n')
    seen = time.monotonic()  # the fixture's request, just answered
    api = door.door.api
    results: dict[str, tuple[int, float, float]] = {}

    def ask(key: str, who: str) -> threading.Thread:
        def run() -> None:
            sent = time.monotonic()
            reply = post(door.port, key, content=f"{who} {SLOW}")
            results[who] = (reply.status, sent, time.monotonic())
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    threads = [ask(KEY_B, "B1")]
    wait_for(lambda: api.backend("instances").in_flight == 1, "B1 at an instance")
    threads.append(ask(KEY_B, "B2"))
    wait_for(lambda: api.backend("instances").queued == 1, "B2 waiting")
    time.sleep(0.3)  # B2 would have had the free slot by now without the reserve
    assert api.backend("instances").in_flight == 1, api.backend("instances")
    threads.append(ask(KEY_A, "I"))
    for thread in threads:
        thread.join(30)
    status, sent, ended = results["I"]
    assert status == 200 and ended - sent < 2.9, results  # at once, beside B1
    assert results["B2"][0] == 200 and results["B2"][2] > results["B1"][2] - 0.5, results  # after B1 or I
    assert "    http-request lua.numa_batch_wait 30000 64 1 if {" in door.door.paths.config.read_text()
    # 10 s without an interactive request: no slot is held back.
    time.sleep(max(0.0, 10.2 - (time.monotonic() - max(seen, results["I"][1]))))
    threads = [ask(KEY_B, "B3"), ask(KEY_B, "B4")]
    wait_for(lambda: api.backend("instances").in_flight == 2, "B3 and B4 at the instances")
    for thread in threads:
        thread.join(30)
    assert results["B3"][0] == results["B4"][0] == 200, results


@with_haproxy
def test_in_a_hold_each_class_waits_up_to_its_own_deadline_from_its_arrival(door_with) -> None:
    """No instance in rotation (both in maintenance). Interactive deadline 1 s, batch 4 s,
    and batch_delay_s = 0 (the class still counts: the gate marks it, not its offset). The
    interactive request gets the JSON 503 at 1 s; a batch one held 2.5 s is let go when an
    instance comes back and is served; another batch one sent while the only slot is taken
    waits for room, its hold counted in its 4 s: refused at about 4 s from its arrival."""
    door = door_with(models='[model]\npath = "/m.gguf"\nname = "alpha"\n', server="parallel = 1\n",
                     b='priority = "batch"\n',
                     frontend="queue_timeout_s = 1\nbatch_queue_timeout_s = 4\n[tuning]\nbatch_delay_s = 0\n")
    api = door.door.api
    names = list(api.backend("instances").instances)
    for name in names:
        api.set_state("instances", name, AdminState.MAINT)
    results: dict[str, tuple[int, float]] = {}

    def ask(key: str, who: str, content: str) -> None:
        sent = time.monotonic()
        results[who] = (post(door.port, key, content=content).status, time.monotonic() - sent)

    threads = [threading.Thread(target=ask, args=(KEY_A, "interactive", "hi")),
               threading.Thread(target=ask, args=(KEY_B, "held", SLOW)),
               threading.Thread(target=ask, args=(KEY_B, "late", SLOW))]
    for thread in threads:
        thread.start()
        time.sleep(0.2)
    time.sleep(2.5)
    api.set_state("instances", names[0], AdminState.READY)  # one slot: held or late, the other waits
    for thread in threads:
        thread.join(20)
    assert results["interactive"][0] == 503 and results["interactive"][1] < 2.0, results
    served = [w for w in ("held", "late") if results[w][0] == 200]
    refused = [w for w in ("held", "late") if results[w][0] == 503]
    assert len(served) == 1 and len(refused) == 1, results  # one slot for 2 s: the other's 4 s ran out
    assert 3.5 < results[refused[0]][1] < 4.8 and results[served[0]][1] > 2.5, results
    # A request that reaches the hold through the hold server (its instance died under it)
    # waits there by its class too, read from the gate's header (the same Lua action as
    # tests/frontdoor/test_hold.py's replacement test, with the class's limit).
    hold_frontend = door.door.paths.config.read_text().split("\nfrontend hold\n")[1].split("\n\n")[0]
    assert ("    http-request lua.numa_hold_again 1000 if !{ req.hdr(x-priority) -m str batch }\n"
            "    http-request lua.numa_hold_again 4000 if { req.hdr(x-priority) -m str batch }\n") in hold_frontend


@with_haproxy
def test_requests_let_go_after_a_hold_queue_again_in_their_class(door_with) -> None:
    """No instance in rotation: four batch requests (team-b's class) and then an interactive
    one wait in the hold (hold.py). When one instance of one slot comes back, all five are
    let go at once into the backend's queue, each in its class: the interactive request is
    served first or second, not in whatever order they woke. A request that reaches the
    hold through the hold server (its instance died under it) enters the backend again from
    the hold frontend, where no key is read: the gate's X-Priority says its class there."""
    door = door_with(models='[model]\npath = "/m.gguf"\nname = "alpha"\n', server="parallel = 1\n",
                     b='priority = "batch"\n')
    api = door.door.api
    names = list(api.backend("instances").instances)
    for name in names:
        api.set_state("instances", name, AdminState.MAINT)
    finished: list[tuple[str, float]] = []
    started = time.monotonic()

    def ask(key: str, who: str) -> None:
        assert post(door.port, key, content=SLOW).status == 200
        finished.append((who, time.monotonic() - started))

    def held() -> int:
        return api.backend("instances").queued

    threads = [threading.Thread(target=ask, args=(KEY_B, "batch")) for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_for(lambda: held() == 4, "the four batch requests held")
    threads.append(threading.Thread(target=ask, args=(KEY_A, "interactive")))
    threads[-1].start()
    wait_for(lambda: held() == 5, "the interactive request held too")
    api.set_state("instances", names[0], AdminState.READY)
    for thread in threads:
        thread.join(40)
    order = [who for who, _ in sorted(finished, key=lambda f: f[1])]
    assert len(order) == 5 and order.index("interactive") <= 1, finished
    text = door.door.paths.config.read_text()
    assert "    http-request set-header x-priority batch if { var(txn.batch) -m bool }\n" in text  # the gate's
    hold_frontend = text.split("\nfrontend hold\n")[1].split("\n\n")[0]
    assert "    http-request set-priority-offset int(10000) if { req.hdr(x-priority) -m str batch }" in hold_frontend


@with_haproxy
def test_the_openai_client_reads_each_refusal_as_its_own_error_type(door_with) -> None:
    """What a client written against OpenAI's SDK sees: the class it catches, and the
    message from the body (not a parse failure)."""
    import openai

    door = door_with(a="requests_per_minute = 2\n", b='models = ["beta"]\n')

    def ask(key: str, model: str = "alpha") -> None:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{door.port}/v1", api_key=key, max_retries=0, timeout=30)
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])

    with pytest.raises(openai.AuthenticationError) as refused:
        ask("not-a-key")
    assert "API key" in refused.value.message and refused.value.status_code == 401
    with pytest.raises(openai.PermissionDeniedError) as forbidden:
        ask(KEY_B, model="alpha")
    assert "model alpha" in forbidden.value.message
    ask(KEY_A)  # the fixture's probe was team-a's first of the minute: this is its second
    with pytest.raises(openai.RateLimitError) as limited:
        ask(KEY_A)
    assert limited.value.response.headers["retry-after"] == "30" and "2 request(s)" in limited.value.message
