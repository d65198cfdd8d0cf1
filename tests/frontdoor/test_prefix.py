"""Prefix-aware routing (`frontend.affinity = "prefix"`): the rendered haproxy.cfg, then a
real HAProxy over stub servers that answer with their name, so each test reads on the
answer which instance served a request.

One test here per behaviour, for what only a real HAProxy shows: the key read from the
body or a header, the buffer, the one queue, the home wait's timing, the later-turn rule.
The pick's own rules (the load bound, conversations first seen together, each way an
instance leaves and comes back, the home got back within the wait) are the Lua's unit
tests, tests/lua/pick_spec.lua, which run in a second."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.config.models import served_models
from numad_infer.errors import ConfigError
from numad_infer.frontdoor.haproxy import AdminState, RuntimeAPI
from numad_infer.frontdoor.haproxy_config import BACKEND, Paths, body_buffer, render_haproxy
from tests.daemon_harness import free_port_block, wait_for
from tests.fakes import load_of
from tests.frontdoor.harness import SLOW_MARKER, Answer, FrontDoor, plan_for, with_haproxy

SYSTEM = "You are a helpful assistant. Answer briefly and cite sources. " * 20  # ~1.2 KB, shared by all


def _prefix(text: str) -> str:
    """`affinity = "prefix"` (the default, named so that these tests keep it) unless the text names an affinity."""
    if "affinity =" in text:
        return text
    return text.replace("[frontend]\n", '[frontend]\naffinity = "prefix"\n') if "[frontend]\n" in text else (
        text + '[frontend]\naffinity = "prefix"\n')


def _render(tmp_path: Path, text: str, as_written: bool = False) -> str:
    config = parse_config(text if as_written else _prefix(text), "/etc/numa-infer.toml")
    served, engine = load_of(config)
    return render_haproxy(config, plan_for(tmp_path, config), Paths(tmp_path / "cfg", tmp_path / "state",
                                                                    tmp_path / "sock"), served=served, engine=engine)


def _backend_text(text: str, name: str = BACKEND) -> str:
    return text.split(f"\nbackend {name}\n")[1].split("\nbackend ")[0]


def test_prefix_hashes_the_prompt_start_within_a_load_bound_and_none_keeps_leastconn(tmp_path: Path) -> None:
    # The default (docs/frontdoor.md, "Prefix routing"): a file that names no affinity.
    text = _backend_text(_render(tmp_path / "a", '[model]\npath = "/m.gguf"\n', as_written=True))
    # Least connections where no rule picks: a request without a key, or none in rotation.
    assert "    balance leastconn\n" in text and "balance hash" not in text and "hash-balance-factor" not in text
    assert "json_query('$.messages[0].content'),bytes(0,256)" in text
    assert "json_query('$.prompt'),bytes(0,256)" in text
    assert "if { req.hdr(X-Session-Id) -m found }" in text and "stick" not in text
    assert "    http-request set-var(txn.prefix_hash) var(txn.prefix_key),xxh32 if { var(txn.prefix_key) -m found }\n" in text
    assert ("    http-request set-var(txn.prefix_server) lua.numa_pick(instances,1.25) "
            "if { var(txn.prefix_hash) -m found }\n") in text
    # Every server of the backend the pick may name (the surge's too), never the hold's.
    servers = [line.split()[1] for line in text.splitlines() if line.startswith("    server ")]
    assert [s for s in servers if not s.startswith("hold-")] == [
        line.split()[1] for line in text.splitlines() if line.startswith("    use-server ")]
    # The wait for a busy home, then the queue's bound again for a request that waited,
    # before the use-server rules (HAProxy runs http-request rules first whatever the order).
    wait = text.index("    http-request lua.numa_home_wait instances 1000 if { var(txn.prefix_hash) -m found } "
                      "{ var(txn.prefix_later) -m found }\n")
    again = text.index("if { var(txn.prefix_waited) -m bool } { queue(instances) ge 64 }\n")
    assert wait < again < text.index("    use-server ")
    unwaited = _render(tmp_path / "w", '[model]\npath = "/m.gguf"\n[tuning]\nprefix_wait_s = 0\n')
    assert "numa_home_wait" not in _backend_text(unwaited) and "prefix_waited" not in unwaited
    tuned = _render(tmp_path / "b", '[model]\npath = "/m.gguf"\n[frontend]\naffinity_header = "X-Chat"\n'
                                    '[tuning]\nprefix_bytes = 512\nprefix_balance_factor = 1.5\n')
    assert "lua.numa_pick(instances,1.5)" in tuned and "bytes(0,512)" in tuned and "req.hdr(X-Chat)" in tuned
    # The buffer json_query reads holds the longest prompt an instance accepts.
    assert "    tune.bufsize 65536\n" in tuned
    plain = _render(tmp_path / "c", '[model]\npath = "/m.gguf"\n[frontend]\naffinity = "none"\n')
    assert "    balance leastconn\n" in plain and "use-server" not in plain and "json_query" not in plain
    header = _render(tmp_path / "d", '[model]\npath = "/m.gguf"\n[frontend]\naffinity = "header"\n')
    assert "    balance leastconn\n" in header and "stick on req.hdr(X-Session-Id)" in header
    assert "prefix_key" not in header and "use-server" not in header


def test_every_models_backend_hashes_on_its_own(tmp_path: Path) -> None:
    text = _render(tmp_path, TWO)
    for name in ("model-alpha", "model-beta"):
        backend = _backend_text(text, name)
        assert f"lua.numa_pick({name},1.25)" in backend and "    balance leastconn\n" in backend


def test_out_of_range_prefix_keys_are_refused() -> None:
    for table, bad in (("tuning", "prefix_bytes = 0"), ("tuning", "prefix_balance_factor = 1.0"),
                       ("tuning", "prefix_balance_factor = 1.001"), ("frontend", 'affinity = "prefixes"')):
        with pytest.raises(ConfigError, match=f"{table}[.]"):
            parse_config(f'[model]\npath = "/m.gguf"\n[{table}]\n{bad}\n', "/etc/numa-infer.toml")


# Two nodes x 2 instances: four servers, each with 8 slots (the load bound, not maxconn, is
# what spreads a hot key over them).
FOUR = '[model]\npath = "/m.gguf"\n[placement]\ninstances_per_node = 2\n[server]\nparallel = 8\n'
TWO = ('[[models]]\nname = "alpha"\npath = "/a.gguf"\n[[models]]\nname = "beta"\npath = "/b.gguf"\n'
       '[server]\nparallel = 4\n')
STUBS = ("stub0", "stub1", "stub2", "stub3")


def _door(tmp_path: Path, head: str, frontend: str = "") -> FrontDoor:
    base = free_port_block(8)
    config = parse_config(_prefix(f'{head}[frontend]\nlisten = "127.0.0.1:{base}"\n{frontend}\n').replace(
        "[server]\n", f"[server]\nbase_port = {base + 1}\n"), "/etc/numa-infer.toml")
    ports = [i.port for i in plan_for(tmp_path / "ports", config).instances]
    return FrontDoor(tmp_path, config, tmp_path / "run", ports)


def _two_started(tmp_path: Path, parallel: int, frontend: str = "") -> FrontDoor:
    """Two servers of `parallel` slots, both stubs up and HAProxy started; the caller stops it."""
    door = _door(tmp_path, f'[model]\npath = "/m.gguf"\n[server]\nparallel = {parallel}\n', frontend)
    try:
        for k in range(2):
            door.start_stub(k)
        door.start_haproxy()
        door.servers_up()
    except BaseException:
        door.stop()
        raise
    return door


@pytest.fixture
def four(tmp_path: Path):
    door = _door(tmp_path, FOUR)
    for k in range(4):
        door.start_stub(k)
    door.start_haproxy()
    door.servers_up()
    yield door
    door.stop()


def _chat(system: str | None, turns: list[str]) -> dict[str, object]:
    """A chat request at the last of `turns` (user messages), the assistant's answers between."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    for n, text in enumerate(turns):
        if n:
            messages.append({"role": "assistant", "content": f"answer {n}"})
        messages.append({"role": "user", "content": text})
    return {"messages": messages}


def _idle(door: FrontDoor) -> None:
    """Wait until HAProxy has let go of the last request: the client has its answer a moment
    before HAProxy stops counting it, and a server still counted busy is one the load bound
    may skip (at one request in flight over four servers the mean is 0.25)."""
    api = RuntimeAPI(str(door.run_dir / "haproxy.sock"))
    wait_for(lambda: api.backend(BACKEND).in_flight == 0, "no request in flight")


def _served(door: FrontDoor, body: dict[str, object], headers: dict[str, str] | None = None) -> str:
    _idle(door)
    answer = _post(door, json.dumps(body).encode(), headers)
    assert answer.status == 200, answer
    return answer.served_by()


def _post(door: FrontDoor, data: bytes, headers: dict[str, str] | None = None) -> Answer:
    req = urllib.request.Request(f"http://127.0.0.1:{door.port}/v1/chat/completions", method="POST", data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return Answer(response.status, response.headers.get_content_type(), response.read())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.headers.get_content_type(), exc.read())


@with_haproxy
def test_a_conversations_turns_meet_one_instance_and_conversations_spread_over_all(four: FrontDoor) -> None:
    first = {}
    for c in range(40):
        opening = f"conversation {c}: tell me about topic {c * 7919}"
        seen = {_served(four, _chat(SYSTEM, [opening, *(f"follow-up {t}" for t in range(turn))]))
                for turn in range(4)}
        assert len(seen) == 1, (c, seen)  # every turn on the instance that holds the history
        first[c] = seen.pop()
        # Without a system prompt, the first message is the key alone.
        bare = {_served(four, _chat(None, [opening, *(f"follow-up {t}" for t in range(turn))])) for turn in range(3)}
        assert len(bare) == 1, (c, bare)
    # The shared system prompt does not pin every conversation to one instance.
    spread = Counter(first.values())
    assert set(spread) == set(STUBS), spread
    assert max(spread.values()) <= 2 * 40 / 4, spread
    # Completions: the start of `prompt`, a history that grows behind it.
    prompt = "Once upon a time " * 20
    assert len({_served(four, {"prompt": prompt + " and then" * n}) for n in range(4)}) == 1


@with_haproxy
def test_the_affinity_header_wins_over_the_prompt(four: FrontDoor) -> None:
    by_header = {_served(four, _chat(None, [f"unrelated question {n}"]), {"X-Session-Id": "chat-42"})
                 for n in range(12)}
    assert len(by_header) == 1, by_header
    by_prompt = {_served(four, _chat(None, [f"unrelated question {n}"])) for n in range(12)}
    assert len(by_prompt) > 1, by_prompt


@with_haproxy
def test_a_request_without_a_key_is_served_round_robin_and_a_body_past_the_buffer_is_still_routed(
        four: FrontDoor) -> None:
    # No JSON, a prompt of token ids, content given as something else: no key, the least
    # busy server, never a refusal.
    keyless = [b"not json", b'{"prompt": [1, 2, 3]}', b'{"messages": [{"role": "user", "content": 7}]}', b""] * 4
    answers = []
    for body in keyless:
        _idle(four)
        answers.append(_post(four, body))
    assert [a.status for a in answers] == [200] * 16, answers
    assert len({a.served_by() for a in answers}) >= 3, answers  # leastconn over 4 idle servers
    # Content given as parts is read from the first part's text.
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look at this"}]}]}
    assert len({_served(four, parts) for _ in range(4)}) == 1
    # A history longer than HAProxy's buffer: the first messages are within it, the key is
    # read, and the turn meets the same instance as the short one.
    buffer = body_buffer(served_models(four.config))
    opening = "a long conversation"
    short = _served(four, _chat(SYSTEM, [opening]))
    history = [opening, *(f"turn {t}: " + "lorem ipsum dolor " * 500 for t in range(40))]
    long_body = json.dumps(_chat(SYSTEM, history)).encode()
    assert len(long_body) > 2 * buffer
    assert {_served(four, json.loads(long_body)) for _ in range(3)} == {short}
    # A first message that alone is longer than the buffer: json_query finds nothing in the
    # cut body, the least busy server serves it.
    huge = json.dumps(_chat("x" * 2 * buffer, ["hi"])).encode()
    answers = []
    for _ in range(8):
        _idle(four)
        answers.append(_post(four, huge))
    assert [a.status for a in answers] == [200] * 8, answers
    assert len({a.served_by() for a in answers}) > 1, answers


def _placement(door: FrontDoor, keys: list[str]) -> dict[str, str]:
    return {key: _served(door, _chat(SYSTEM, [key])) for key in keys}


@with_haproxy
def test_a_server_taken_out_moves_only_its_own_keys_and_gets_them_back(four: FrontDoor) -> None:
    # Drained, as the daemon does before a restart (maintenance and a failed check: the
    # Lua's unit tests, tests/lua/pick_spec.lua).
    state = AdminState.DRAIN
    api = RuntimeAPI(str(four.run_dir / "haproxy.sock"))
    keys = [f"conversation {n}" for n in range(60)]
    before = _placement(four, keys)
    server = "infer-0.0"  # stub0's (the plan's first instance, infer@0.0)
    own = {k for k, s in before.items() if s == "stub0"}
    assert own and len(own) < len(keys)
    api.set_state(BACKEND, server, state)
    during = _placement(four, keys)
    assert {k for k, s in during.items() if s != before[k]} == own  # its keys moved, and only those
    assert "stub0" not in during.values()
    api.set_state(BACKEND, server, AdminState.READY)
    assert _placement(four, keys) == before


def _concurrent(door: FrontDoor, bodies: list[bytes]) -> list[Answer]:
    answers: list[Answer | None] = [None] * len(bodies)

    def send(k: int) -> None:
        answers[k] = _post(door, bodies[k])

    threads = [threading.Thread(target=send, args=(k,)) for k in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(a is not None for a in answers)
    return [a for a in answers if a is not None]


@with_haproxy
def test_past_the_bound_a_hot_key_no_longer_piles_onto_its_server(tmp_path: Path) -> None:
    # Two servers of 2 slots, 8 requests at once with one key, each held 3 s. HAProxy's own
    # bound (hash-balance-factor) counts only requests being served: the 4 that wait would
    # all queue for the hot server (measured: 6 of 8 there, the last done after 9 s). This
    # pick names a server only while it has a free slot within the bound: 2 go to each, and
    # the 4 others wait in the backend's one queue for whichever frees first, never in a
    # server's own queue (where an idle server could not take them).
    door = _two_started(tmp_path, 2)
    try:
        api = RuntimeAPI(str(door.run_dir / "haproxy.sock"))
        hot = json.dumps({"prompt": "H" * 300 + SLOW_MARKER}).encode()
        waiting: list[tuple[int, dict[str, int]]] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                stat = api.backend(BACKEND)
                waiting.append((stat.queued, {n: s.queued for n, s in stat.instances.items()}))
                done.wait(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            answers = _concurrent(door, [hot] * 8)
        finally:
            done.set()
            watcher.join()
        assert [a.status for a in answers] == [200] * 8
        served = Counter(a.served_by() for a in answers)
        assert max(q for q, _ in waiting) >= 3, waiting  # they did wait, in the one queue
        assert not any(any(per_server.values()) for _, per_server in waiting), waiting
        # Not 6 of 8 on the hot server: at most 1.25 x the mean of 4.
        assert max(served.values()) <= 5 and len(served) == 2, served
        print(f"past the bound: served {dict(served)}")
    finally:
        door.stop()


@with_haproxy
def test_a_request_waits_for_its_busy_home_up_to_prefix_wait_s_then_runs_on_a_free_instance(tmp_path: Path) -> None:
    """Two servers of one slot. A conversation's first turn holds its home 3 s; its next
    turn, sent meanwhile while the other server is free, waits for the home up to
    prefix_wait_s (1 s), then runs on the free server, which becomes its home: it read the
    whole history there. (A home that frees within the wait is got back: the Lua's unit
    tests, tests/lua/pick_spec.lua.)"""
    wait_s = 1.0
    door = _two_started(tmp_path, 1, frontend=f"[tuning]\nprefix_wait_s = {wait_s}\n")
    try:
        opening = "a conversation of its own " + "x" * 300

        def turn(k: int) -> tuple[str, float]:
            started = time.monotonic()
            body = _chat(SYSTEM, [opening + SLOW_MARKER, *(f"follow-up {t}" for t in range(k))])
            answer = _post(door, json.dumps(body).encode())
            assert answer.status == 200, answer
            return answer.served_by(), time.monotonic() - started

        first: list[tuple[str, float]] = []
        holder = threading.Thread(target=lambda: first.append(turn(0)))
        holder.start()
        time.sleep(0.5)  # the first turn at its home
        home_busy = time.monotonic()
        second, took = turn(1)
        holder.join(30)
        (home, _), = first
        # Waited about wait_s, then served at once elsewhere (3 s of the stub's own).
        assert second != home and wait_s - 0.2 < took - 3 < wait_s + 1.0, (home, second, took)
        third, _ = turn(2)
        assert third == second, (home, second, third)  # its new home
        assert time.monotonic() - home_busy < 20
    finally:
        door.stop()


@with_haproxy
def test_only_a_later_turn_waits_for_its_busy_home(tmp_path: Path) -> None:
    """Two servers of one slot; a conversation's later turn holds its home 3 s. The same
    conversation's first turn sent again (nothing at home beyond what it asks) does not wait
    for the home: it runs at once on the free instance."""
    door = _two_started(tmp_path, 1)
    try:
        home = _served(door, _chat(SYSTEM, ["a repeated opening"]))
        holder = threading.Thread(target=_post, args=(door, json.dumps(
            _chat(SYSTEM, ["a repeated opening", f"and then {SLOW_MARKER}"])).encode()))
        holder.start()
        time.sleep(0.5)  # the later turn at its home
        started = time.monotonic()
        again = _post(door, json.dumps(_chat(SYSTEM, ["a repeated opening"])).encode())
        took = time.monotonic() - started
        holder.join(30)
        assert again.status == 200 and again.served_by() != home and took < 0.8, (home, again, took)
    finally:
        door.stop()
