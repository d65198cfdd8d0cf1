"""The rendered haproxy.cfg run by a real HAProxy over stub servers: what the
front door promises (limits, affinity, errors as JSON) holds in HAProxy itself.

What is tested here is HAProxy's behaviour under our configuration: which request is
replayed and which is not, what a failure's body looks like, where a long conversation
lands. The stub servers are tiny Python HTTP servers in subprocesses, each logging every
request it received to a file, so a test can say which server saw what. The state
directory's path has a space and a `#` in it: every test also proves the paths
in haproxy.cfg are quoted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.errors import ConfigError
from numad_infer.frontdoor.haproxy import AdminState, RuntimeAPI
from numad_infer.frontdoor.haproxy_config import BACKEND, FRONTEND, Paths, paths_in, quoted, render_haproxy, write_config
from tests.daemon_harness import free_port_block, wait_for
from tests.fakes import load_of
from tests.frontdoor.harness import plan_for
from tests.frontdoor.harness import _get, Answer, CRASH_MARKER, FrontDoor, HAPROXY, SLOW_MARKER

pytestmark = pytest.mark.skipif(not os.access(HAPROXY, os.X_OK), reason="haproxy not installed")


@pytest.fixture
def front_door(tmp_path: Path):
    made: list[FrontDoor] = []

    def make(model: str = "", frontend: str = "") -> FrontDoor:
        base = free_port_block(3)
        config = parse_config(f'[model]\npath = "/m.gguf"\n{model}\n[server]\nbase_port = {base + 1}\n'
                              f'[frontend]\nlisten = "127.0.0.1:{base}"\n{frontend}', "/etc/numa-infer.toml")
        door = FrontDoor(tmp_path, config, tmp_path / "state dir #1", [base + 1, base + 2])
        made.append(door)
        return door

    yield make
    for door in made:
        door.stop()


def test_a_request_that_crashes_its_instance_gets_one_json_502_and_reaches_no_other(front_door) -> None:
    # Least connections: the others then go to the instance that does not crash. Under
    # affinity = "prefix" those hashed beside the crash share its instance's slots, and die
    # with it as any request in flight there does (502, never replayed).
    door = front_door(frontend='affinity = "none"')
    door.start_stub(0)
    door.start_stub(1)
    door.start_haproxy()
    door.servers_up()
    answers: dict[str, Answer] = {}
    ids = ["crash", *(f"ok{n}" for n in range(12))]

    def send(test_id: str) -> None:
        prompt = CRASH_MARKER if test_id == "crash" else "hello"
        answers[test_id] = door.post(test_id, {"messages": [{"role": "user", "content": prompt}]})

    threads = [threading.Thread(target=send, args=(test_id,)) for test_id in ids]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # the marked request first, the others while its server dies
    for thread in threads:
        thread.join(60)
    crashed = answers["crash"]
    assert crashed.status == 502 and crashed.error()["code"] == 502, crashed
    assert "not sent to another" in crashed.error()["message"]
    # The marked request reached one server only: retrying it would have crashed the other.
    assert (door.log("stub0") + door.log("stub1")).count("crash") == 1
    assert [door.stubs[n].poll() is None for n in ("stub0", "stub1")].count(True) == 1
    ordinary = {i: a.status for i, a in answers.items() if i != "crash"}
    assert set(ordinary.values()) == {200}, ordinary


@pytest.mark.parametrize("affinity", ["prefix", "none"])
def test_a_refused_connection_is_still_retried_on_another_instance(front_door, affinity: str) -> None:
    door = front_door(frontend=f'affinity = "{affinity}"')
    door.start_stub(0)
    door.start_stub(1)
    door.start_haproxy()
    door.servers_up()
    # stub1 vanishes; HAProxy still has it UP until a check or a refused connection says otherwise.
    door.stubs["stub1"].send_signal(signal.SIGKILL)
    door.stubs["stub1"].wait(10)
    # Prompts of their own: under prefix routing a key whose home is stub1 is picked for it
    # (use-server) and must still be redispatched to stub0.
    answers = [door.post(f"ok{n}", {"prompt": f"hello {n}"}) for n in range(8)]
    assert [a.status for a in answers] == [200] * 8, answers
    assert {a.served_by() for a in answers} == {"stub0"}
    assert door.backend_counter("wretr") + door.backend_counter("wredis") >= 1, "no request met the refused port"


def test_haproxys_own_answers_are_openai_json_errors(front_door) -> None:
    door = front_door(frontend="queue_timeout_s = 1\n")
    door.start_haproxy()  # no instance up: held for queue_timeout_s (hold.py), then HAProxy's 503
    answer = door.post("none", {"prompt": "hello"})
    assert answer.status == 503 and answer.error()["code"] == 503, answer
    assert answer.error()["type"] == "server_busy"
    # The answers the metrics publish, and the 5xx alert reads, count HAProxy's own 503, and
    # nothing for the harness's port probe (a connect and close: option http-ignore-probes).
    # HAProxy counts an answer as its stream ends, which may come after the client read it.
    api = RuntimeAPI(str(door.run_dir / "haproxy.sock"))
    wait_for(lambda: api.counters(BACKEND, FRONTEND)[1].responses["5xx"] == 1, "the 503 counted", 10)
    _, answers = api.counters(BACKEND, FRONTEND)
    assert answers.responses == {"1xx": 0, "2xx": 0, "3xx": 0, "4xx": 0, "5xx": 1, "other": 0}, answers
    # The H1 parser's own 400 (malformed request) and 408 (headers too slow) stay HTML in
    # HAProxy 2.6: http-error and errorfile do not reach them (README says so).


def test_an_instance_that_does_not_answer_in_time_is_a_json_504(front_door) -> None:
    door = front_door(frontend="request_timeout_s = 1")
    door.start_stub(0)
    door.start_stub(1)
    door.start_haproxy()
    door.servers_up()
    answer = door.post("late", {"prompt": SLOW_MARKER})
    assert answer.status == 504 and answer.error()["code"] == 504, answer
    assert answer.error()["type"] == "timeout"


def test_user_affinity_holds_for_a_100_kb_prompt_with_user_last(front_door) -> None:
    # A 100 KB prompt is ~25k tokens: an instance with that context accepts it.
    door = front_door(model="context_size = 32768", frontend='affinity = "user"')
    door.start_stub(0)
    door.start_stub(1)
    door.start_haproxy()
    door.servers_up()
    prompt = "lorem ipsum " * (100_000 // 12)
    for user in ("alice", "bob", "carol"):
        # `user` after `messages`, as OpenAI's clients send it.
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "user": user}
        answers = [door.post(f"{user}{n}", body) for n in range(4)]
        assert [a.status for a in answers] == [200] * 4
        assert len({a.served_by() for a in answers}) == 1, (user, [a.served_by() for a in answers])


def test_every_path_in_haproxy_cfg_is_quoted_and_haproxy_accepts_it(tmp_path: Path) -> None:
    config = parse_config('[model]\npath = "/m.gguf"\n', "/etc/numa-infer.toml")
    run_dir = tmp_path / "my state #dir"
    run_dir.mkdir()
    # HAProxy expands $VAR in a file name unless it is escaped, and in a socket address always.
    paths = Paths(run_dir / "haproxy.cfg", run_dir / "state $HOME", run_dir / "haproxy.sock")
    plan = plan_for(tmp_path, config)
    served, engine = load_of(config)
    text = render_haproxy(config, plan, paths, served=served, engine=engine)
    assert f'stats socket "{run_dir}/haproxy.sock" mode 660' in text
    assert f'server-state-file "{run_dir}/state \\$HOME"' in text
    assert f'lua-load "{run_dir}/numa-infer.lua"' in text
    write_config(paths, text)
    paths.state.write_text("1\n")
    check = subprocess.run([HAPROXY, "-c", "-f", str(paths.config)], capture_output=True, text=True)
    assert check.returncode == 0 and "WARNING" not in check.stdout + check.stderr, check
    with pytest.raises(ConfigError, match="control character.*--state-file"):
        quoted(Path("/run/x\ny"))
    with pytest.raises(ConfigError, match=r"contains a \$.*--state-file"):
        render_haproxy(config, plan, paths_in(Path("/run/$HOME"), Path("/run/$HOME/haproxy.sock")), served=served,
                       engine=engine)


def test_the_health_path_is_answered_by_haproxy_200_while_an_instance_is_in_rotation_503_when_none(
        front_door) -> None:
    door = front_door(frontend="queue_size = 1")
    door.start_haproxy()  # no instance up: down once HAProxy's first checks fail (the daemon sets
    # a server that is not healthy to maintenance on its first pass, which counts as not in rotation too)
    wait_for(lambda: _get(door.port, "/healthz")[:2] == (503, {"status": "unavailable", "reason": "no instance in "
                                                                "rotation (starting, draining or down)"}), "503")
    door.start_stub(0)
    door.servers_up_count(1)
    # The only instance is busy and the queue is full: a completion would get 503, the
    # health answer does not wait for either.
    slow = [threading.Thread(target=door.post, args=(f"slow{n}", {"prompt": SLOW_MARKER})) for n in range(3)]
    for thread in slow:
        thread.start()
    api = RuntimeAPI(str(door.run_dir / "haproxy.sock"))
    wait_for(lambda: (b := api.backend(BACKEND)).in_flight >= 1 and b.queued >= 1, "the instance busy, the queue full")
    status, body, took = _get(door.port, "/healthz")
    assert (status, body) == (200, {"status": "ok"}) and took < 1.0, took
    for thread in slow:
        thread.join(30)
    # Drained out of rotation by the daemon (before a restart or a hold): not in rotation.
    (serving,) = [name for name, server in api.backend(BACKEND).servers.items() if server.status == "UP"]
    api.set_state(BACKEND, serving, AdminState.DRAIN)
    assert _get(door.port, "/healthz")[0] == 503
    api.set_state(BACKEND, serving, AdminState.READY)
    assert _get(door.port, "/healthz")[0] == 200
    door.stubs["stub0"].send_signal(signal.SIGKILL)
    wait_for(lambda: _get(door.port, "/healthz")[0] == 503, "503 once the only instance is down")


def test_a_health_path_that_would_shadow_the_api_is_refused() -> None:
    for path in ("/v1", "/v1/models", "healthz", "/health z"):
        with pytest.raises(ConfigError, match=r"frontend.health_path"):
            parse_config(f'[model]\npath = "/m.gguf"\n[frontend]\nhealth_path = "{path}"\n', "cfg")
    assert parse_config('[model]\npath = "/m.gguf"\n[frontend]\nhealth_path = ""\n', "cfg").frontend.health_path == ""
