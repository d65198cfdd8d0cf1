"""Several models on one host, end to end: the real daemon (process backend), real HAProxy,
real llama-server instances, two [[models]] on the fake 2-node topology (tests/daemon_harness.py:
these hosts have two CPUs), each model on its own node's core. Routing is checked on the
answer's `model`, which each instance sets itself (`--alias`), not the front door."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.daemon_harness import DaemonRun, daemons, door_settled, generated_model, wait_for

ALPHA = '[[models]]\nname = "alpha"\naliases = ["a1"]\npath = "{model}"\ncontext_size = 256\nnodes = [0]\n'
BETA = '[[models]]\nname = "beta"\npath = "{model}"\ncontext_size = 256\nnodes = [1]\n'


@pytest.fixture
def run(tmp_path: Path):
    with daemons(tmp_path, generated_model("tiny")) as start:
        yield start(engine="llama-server", models=ALPHA + BETA)


def ask(port: int, model: object, timeout: float = 60) -> tuple[int, dict]:
    body = {"prompt": "hello", "max_tokens": 2} | ({} if model is None else {"model": model})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def in_rotation(run: DaemonRun, names: list[str], timeout: float = 120) -> dict:
    return run.wait(lambda s: sorted(i["name"] for i in s["instances"]) == sorted(names)
                    and door_settled(s, required=True)
                    and all(i["state"] == "healthy" and i.get("rotation") == "UP" for i in s["instances"]),
                    timeout, f"{names} healthy and in rotation")


def test_two_models_are_placed_apart_and_routed_by_name_and_alias(run: DaemonRun) -> None:
    state = in_rotation(run, ["infer@alpha-0", "infer@beta-1"])
    assert {i["name"]: i["cpus"] for i in state["instances"]} == {"infer@alpha-0": [0], "infer@beta-1": [1]}
    port = run.frontend_port
    assert [ask(port, m)[1].get("model") for m in ("alpha", "a1", "beta")] == ["alpha", "alpha", "beta"]
    for wrong in ("gamma", None, 7, ["alpha"]):
        code, body = ask(port, wrong)
        assert code == 404 and body["error"]["code"] == "model_not_found", (wrong, code, body)
        assert "alpha" in body["error"]["message"] and "beta" in body["error"]["message"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as resp:
        assert {"alpha", "beta"} <= {m["id"] for m in json.load(resp)["data"]}


def test_a_killed_instance_of_one_model_fails_no_request_of_the_other(run: DaemonRun) -> None:
    state = in_rotation(run, ["infer@alpha-0", "infer@beta-1"])
    victim = run.instance(state, "infer@beta-1")["pid"]
    outcomes: list[tuple[int, str | None]] = []
    done = threading.Event()

    def client() -> None:
        while not done.is_set() and len(outcomes) < 400:
            code, body = ask(run.frontend_port, "alpha")
            outcomes.append((code, body.get("model")))

    thread = threading.Thread(target=client)
    thread.start()
    try:
        wait_for(lambda: len(outcomes) >= 3, "alpha's first answers", timeout_s=30)
        os.kill(victim, signal.SIGKILL)
        run.wait(lambda s: (i := run.instance(s, "infer@beta-1"))["state"] == "healthy" and i["pid"] != victim,
                 60, "beta's instance back")
    finally:
        done.set()
        thread.join(60)
    assert outcomes and all(o == (200, "alpha") for o in outcomes), outcomes[:5]


class Asking:
    """A client asking `model` through the front door without pause until ended; what it got."""

    def __init__(self, run: DaemonRun, model: str) -> None:
        self.outcomes: list[tuple[int, str | None]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(run.frontend_port, model))
        self.thread.start()

    def _loop(self, port: int, model: str) -> None:
        while not self.done.is_set():
            try:
                code, body = ask(port, model)
                self.outcomes.append((code, body.get("model")))
            except OSError as exc:  # a connection refused or cut is a failure too, not a dead thread
                self.outcomes.append((0, repr(exc)))

    def answered(self, more: int = 3, timeout_s: float = 30) -> None:
        """Wait until `more` answers have come since this call."""
        had = len(self.outcomes)
        wait_for(lambda: len(self.outcomes) >= had + more, f"{more} more answers", timeout_s=timeout_s)

    def end(self) -> list[tuple[int, str | None]]:
        self.done.set()
        self.thread.join(90)
        return self.outcomes


def test_a_stopped_instance_of_one_model_fails_no_request_of_the_other(run: DaemonRun) -> None:
    """SIGSTOP of beta's instance until the daemon finds it hung and restarts it: every
    request for alpha meanwhile is answered, by alpha."""
    state = in_rotation(run, ["infer@alpha-0", "infer@beta-1"])
    victim = run.instance(state, "infer@beta-1")["pid"]
    client = Asking(run, "alpha")
    try:
        client.answered()
        os.kill(victim, signal.SIGSTOP)
        run.wait(lambda s: run.instance(s, "infer@beta-1")["state"] != "healthy", 30, "beta's instance found hung")
        state = run.wait(lambda s: (i := run.instance(s, "infer@beta-1"))["state"] == "healthy" and i["pid"] != victim,
                         90, "beta's instance restarted")
        client.answered()
    finally:
        outcomes = client.end()
        with contextlib.suppress(ProcessLookupError):  # the daemon killed it; if not, it must not stay stopped
            os.kill(victim, signal.SIGCONT)
    assert run.instance(state, "infer@alpha-0")["restarts"] == 0
    assert outcomes and all(o == (200, "alpha") for o in outcomes), [o for o in outcomes if o != (200, "alpha")][:5]
    assert ask(run.frontend_port, "beta")[1].get("model") == "beta"


def test_affinity_drift_of_one_models_instance_is_repaired_and_fails_no_request_of_the_other(run: DaemonRun) -> None:
    """Every thread of beta's instance moved onto alpha's CPU: the daemon pins them back to
    beta's own, and every request for alpha meanwhile is answered, by alpha."""
    state = in_rotation(run, ["infer@alpha-0", "infer@beta-1"])
    beta = run.instance(state, "infer@beta-1")
    alpha_cpus, beta_cpus = set(run.instance(state, "infer@alpha-0")["cpus"]), set(beta["cpus"])
    pid = beta["pid"]
    client = Asking(run, "alpha")
    try:
        client.answered()
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        for tid in tids:
            os.sched_setaffinity(tid, alpha_cpus)
        state = run.wait(lambda s: (run.instance(s, "infer@beta-1")["last_repair"] or {}).get("kind") == "affinity",
                         30, "beta's threads re-pinned")
        deadline = time.monotonic() + 10
        while any(os.sched_getaffinity(t) != beta_cpus for t in _live(pid, tids)):
            assert time.monotonic() < deadline, {t: os.sched_getaffinity(t) for t in _live(pid, tids)}
            time.sleep(0.05)
        client.answered()
    finally:
        outcomes = client.end()
    now = run.instance(run.state() or state, "infer@beta-1")
    assert now["pid"] == pid  # re-pinned, not restarted
    assert run.instance(run.state() or state, "infer@alpha-0")["last_repair"] is None
    assert outcomes and all(o == (200, "alpha") for o in outcomes), [o for o in outcomes if o != (200, "alpha")][:5]
    assert ask(run.frontend_port, "beta")[1].get("model") == "beta"


def _live(pid: int, tids: list[int]) -> list[int]:
    return [t for t in tids if os.path.exists(f"/proc/{pid}/task/{t}")]


def test_a_reload_that_adds_and_removes_a_model_leaves_the_other_alone(run: DaemonRun) -> None:
    state = in_rotation(run, ["infer@alpha-0", "infer@beta-1"])
    alpha = run.instance(state, "infer@alpha-0")
    run.models = ALPHA
    run.write_config()
    assert run.cli("reload").returncode == 0
    state = in_rotation(run, ["infer@alpha-0"])
    kept = run.instance(state, "infer@alpha-0")
    assert (kept["pid"], kept["port"]) == (alpha["pid"], alpha["port"])
    # One model left: any name routes to it, as with a single [model].
    assert ask(run.frontend_port, "beta")[1].get("model") == "alpha"
    run.models = ALPHA + BETA
    run.write_config()
    assert run.cli("reload").returncode == 0
    state = in_rotation(run, ["infer@alpha-0", "infer@beta-1"])
    kept = run.instance(state, "infer@alpha-0")
    assert (kept["pid"], kept["port"]) == (alpha["pid"], alpha["port"])
    assert ask(run.frontend_port, "beta")[1].get("model") == "beta"


def test_restart_by_model_name_rolls_that_models_instances_alone(run: DaemonRun) -> None:
    state = in_rotation(run, ["infer@alpha-0", "infer@beta-1"])
    pids = {i["name"]: i["pid"] for i in state["instances"]}
    out = run.cli("restart", "--timeout", "120", "beta")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "restarted: infer@beta-1"
    state = in_rotation(run, ["infer@alpha-0", "infer@beta-1"])
    now = {i["name"]: i["pid"] for i in state["instances"]}
    assert now["infer@alpha-0"] == pids["infer@alpha-0"] and now["infer@beta-1"] != pids["infer@beta-1"]


def test_a_restart_of_one_models_only_instance_surges_for_that_model_alone(run: DaemonRun) -> None:
    """Issue 40 with [[models]]: alpha's only instance restarted by name, under requests for
    both models. Its node (this host's node 0) has room: a copy serves alpha from alpha's
    spare server meanwhile; no request of either model fails, beta's instance is untouched.
    (Beta's node 1 exists only in the fake topology: its restart would hold, and say that the
    node's free memory cannot be read.)"""
    state = in_rotation(run, ["infer@alpha-0", "infer@beta-1"])
    pids = {i["name"]: i["pid"] for i in state["instances"]}
    alpha, beta = Asking(run, "alpha"), Asking(run, "beta")
    try:
        alpha.answered()
        beta.answered()
        out = run.cli("restart", "--timeout", "120", "alpha")
        assert out.returncode == 0, out.stdout + out.stderr
        state = run.wait(lambda s: "its copy stopped" in (run.instance(s, "infer@alpha-0").get("restart_cover") or ""),
                         60, "alpha's copy stopped")
        alpha.answered()
    finally:
        asked = {"alpha": alpha.end(), "beta": beta.end()}
    for model, outcomes in asked.items():
        assert outcomes and all(o == (200, model) for o in outcomes), (model, [o for o in outcomes if o[0] != 200][:5])
    now = {i["name"]: i for i in state["instances"]}
    assert now["infer@alpha-0"]["pid"] != pids["infer@alpha-0"] and now["infer@beta-1"]["pid"] == pids["infer@beta-1"]
    assert now["infer@alpha-0"]["restart_cover"].startswith("surge: a second copy fits")
    assert now["infer@beta-1"].get("restart_cover") is None
    logs = run.logs()
    assert "surge-model-alpha -> ready" in logs and "surge-model-beta" not in logs


def test_a_restarted_daemon_keeps_the_ports_a_reload_left(run: DaemonRun) -> None:
    """After a reload removed the first model, the second keeps its port; a daemon started
    again (killed here: a crash, an upgrade) plans it on the same port, from the state file
    the last one left, not on the file's order (which would restart what it adopts)."""
    state = in_rotation(run, ["infer@alpha-0", "infer@beta-1"])
    beta_port = run.instance(state, "infer@beta-1")["port"]
    assert beta_port == run.base_port + 1
    run.models = BETA
    run.write_config()
    assert run.cli("reload").returncode == 0
    assert run.instance(in_rotation(run, ["infer@beta-1"]), "infer@beta-1")["port"] == beta_port
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(30)
    run.proc = run.spawn()
    state = run.wait(lambda s: s["daemon"]["pid"] == run.proc.pid and s["instances"]
                     and s["instances"][0]["state"] == "healthy", 60, "the new daemon's instance healthy")
    assert [(i["name"], i["port"]) for i in state["instances"]] == [("infer@beta-1", beta_port)]
    assert ask(run.frontend_port, "beta")[1].get("model") == "beta"
