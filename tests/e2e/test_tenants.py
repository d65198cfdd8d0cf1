"""Tenants end to end (issue 39): the real daemon (process backend), real HAProxy, real
llama-server instances on the tiny model. The 2-node topology is fake (these hosts have
one node); the keys, files, processes and requests are real."""

from __future__ import annotations

import json
import stat
import threading
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.daemon_harness import daemons, door_settled, free_port, generated_model

KEY_A = "tenant-a-" + "1" * 32
KEY_A_NEW = "tenant-a-rotated-" + "2" * 32
KEY_B = "tenant-b-" + "3" * 32
INSTANCE_KEY = "instances-" + "4" * 32


def completion(port: int, key: str | None, max_tokens: int = 4) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", method="POST",
        data=json.dumps({"prompt": "hello", "max_tokens": max_tokens}).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def call(port: int, method: str, path: str, key: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=data,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def streamed(port: int, key: str, max_tokens: int = 4) -> tuple[int, dict]:
    """A streamed completion: its status and its last event's `timings` (llama-server's own
    counts, which it sends in every stream's last event)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", method="POST",
        data=json.dumps({"prompt": "hello", "max_tokens": max_tokens, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [json.loads(line[len("data: "):]) for line in response.read().decode().splitlines()
                  if line.startswith("data: {")]
        return response.status, events[-1]["timings"]


def _tenant(state: dict, name: str) -> dict:
    front = state.get("frontdoor") or {}
    return next((t for t in front.get("tenants", []) if t["name"] == name), {"answers": {}, "last_minute": None})


def _answers(state: dict, name: str) -> dict[str, int]:
    return _tenant(state, name)["answers"]


def secret(path: Path, key: str) -> None:
    path.write_text(key + "\n")
    path.chmod(0o600)


@pytest.fixture
def daemon(tmp_path: Path):
    with daemons(tmp_path, generated_model("tiny")) as start:
        yield start


def test_tenant_keys_gate_the_front_door_rotate_by_reload_and_appear_nowhere(daemon, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    secret(keys / "a", KEY_A)
    secret(keys / "b", KEY_B)
    secret(keys / "instances", INSTANCE_KEY)
    tenants = (f'[[tenants]]\nname = "team-a"\nkey_file = "{keys / "a"}"\n'
               f'[[tenants]]\nname = "team-b"\nkey_file = "{keys / "b"}"\nmax_in_flight = 4\n')
    metrics_port = free_port()
    run = daemon(engine="llama-server", extra_config=f'{tenants}[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n')
    run.server_extra = f'api_key_file = "{keys / "instances"}"\n'
    run.write_config()
    state = run.all_healthy(2)
    door = run.frontend_port
    assert completion(door, None)[0] == 401
    assert completion(door, INSTANCE_KEY)[0] == 401  # the instances' key is no tenant's
    status, answer = completion(door, KEY_A)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
    # A tenant's key reaches the inference API only: llama-server's management API answers
    # no one through the front door (it would with the instances' key swapped in).
    for method, path, body in (("GET", "/slots", None), ("GET", "/metrics", None), ("GET", "/props", None),
                               ("POST", "/slots/0?action=erase", {}), ("POST", "/props", {}),
                               ("POST", "/slots/0?action=save", {"filename": "x.bin"}), ("GET", "/lora-adapters", None)):
        assert call(door, method, path, KEY_A, body)[0] == 404, (method, path)
    assert call(door, "POST", "/tokenize", KEY_A, {"content": "hello"})[0] == 200
    assert call(door, "POST", "/completion", KEY_A, {"prompt": "hello", "n_predict": 2})[0] == 200
    # The instances keep requiring their own key, for clients that reach them directly.
    port = run.instance(state, "infer@0")["port"]
    assert completion(port, KEY_A)[0] == 401
    assert completion(port, INSTANCE_KEY)[0] == 200
    pids = {i["name"]: i["pid"] for i in state["instances"]}

    # team-a's key rotated while a request of team-b runs: a reload that restarts nothing.
    during: list[tuple[int, dict]] = []
    running = threading.Thread(target=lambda: during.append(completion(door, KEY_B, max_tokens=48)))
    running.start()
    secret(keys / "a", KEY_A_NEW)
    reload = run.cli("reload")
    assert reload.returncode == 0 and reload.stdout.strip() == (
        "reloaded: no instance changed; front door: tenants, keys or routing changed, HAProxy reloaded"), reload
    run.wait(lambda s: door_settled(s, required=True), 30, "the front door reloaded")
    assert completion(door, KEY_A)[0] == 401
    assert completion(door, KEY_A_NEW)[0] == 200
    running.join(60)
    assert [status for status, _ in during] == [200]
    state = run.wait(lambda s: all(i["state"] == "healthy" for i in s["instances"]), 30, "still healthy")
    assert {i["name"]: i["pid"] for i in state["instances"]} == pids

    # Usage per tenant, in status and the metrics: team-a's answers (its 401s carried no
    # known key, so they are no one's), team-b's across the rotation. The stick table's
    # counts start again with the reloaded HAProxy: the last minute holds the later one.
    status, last = completion(door, KEY_B)
    assert status == 200
    status, timings = streamed(door, KEY_B)
    assert status == 200
    state = run.wait(lambda s: _answers(s, "team-a").get("200", 0) >= 2 and _answers(s, "team-b").get("200") == 3
                     and _tenant(s, "team-b")["last_minute"] == 2, 30, "the tenants' answers counted")
    tenant_b = _tenant(state, "team-b")
    assert tenant_b["in_flight"] == 0 and tenant_b["time_to_first_token"]["count"] == 3
    # Its tokens, as llama-server reported them: `usage` in the two answers sent whole, the
    # stream's last event's `timings` (read from the cache + computed; generated).
    reported = [answer["usage"] for _, answer in during] + [last["usage"]]
    assert (tenant_b["prompt_tokens"], tenant_b["completion_tokens"], tenant_b["counted_answers"]) == (
        sum(u["prompt_tokens"] for u in reported) + timings["cache_n"] + timings["prompt_n"],
        sum(u["completion_tokens"] for u in reported) + timings["predicted_n"], 3)
    text = run.cli("status").stdout
    assert "  tenant team-a: 0 in flight" in text and "200 x" in text, text
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'numa_infer_tenant_requests_total{code="200",tenant="team-a"}' in metrics
    assert 'numa_infer_tenant_time_to_first_token_seconds_count{tenant="team-b"} 3.0' in metrics
    completion_tokens = float(tenant_b["completion_tokens"])
    assert f'numa_infer_tenant_tokens_total{{kind="completion",tenant="team-b"}} {completion_tokens}' in metrics

    # No key anywhere an operator or another user looks: argv, the logs, the state file,
    # `status --json`, the metrics, haproxy.cfg.
    places = {"daemon log": run.logs(), "state file": run.state_file.read_text(),
              "status --json": run.cli("status", "--json").stdout, "metrics": metrics,
              "haproxy.cfg": (run.state_file.parent / "haproxy.cfg").read_text()}
    for log in (run.state_file.parent / "logs").glob("*"):
        places[log.name] = log.read_text(errors="replace")
    for process in psutil.process_iter(["cmdline"]):
        places[f"argv of pid {process.pid}"] = " ".join(process.info["cmdline"] or ())
    for key in (KEY_A, KEY_A_NEW, KEY_B, INSTANCE_KEY):
        assert [where for where, text in places.items() if key in text] == [], key
    assert "tenant-keys.map" in places["haproxy.cfg"]
    keyfile = run.state_file.parent / "tenant-keys.map"
    assert KEY_A_NEW in keyfile.read_text() and KEY_A not in keyfile.read_text()
    assert stat.S_IMODE(keyfile.stat().st_mode) in (0o640, 0o600)
