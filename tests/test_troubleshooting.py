"""The README's troubleshooting table ("When something is wrong"), row by row: each test
makes the row's "likely cause" and checks that an operator sees what its "what you see"
cell says (the cell's code spans, "..." standing for any text), and where it can, that the
"fix" cell's fix works. The README is what is under test: a row that says something the
program does not do fails here, and is fixed there.

Real daemons (process backend) on the fake 2-node sysfs of tests/daemon_harness.py, real
HAProxy, real llama-server on generated models. Two rows need what this host lacks (a
NUMA machine, systemd as PID 1): their test here tries the code path that produces what
the row says, and ROWS names the VM scenario (tests/vm/scenarios.py) that tries the row whole.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from numad_infer.lifecycle.drift import NodeUsage, check_memory
from numad_infer.supervision import holds
from tests import fakesys
from tests.daemon_harness import (
    ROOT,
    DaemonRun,
    daemons,
    generated_model,
    llama_server_binary,
    server_python,
    shared_dir,
    two_single_cpu_nodes,
    with_server_keys,
)
from tests.troubleshooting_helpers import HEADER, cell_pattern, loading_llama_server, long_stream, post, started, table

KEY_A = "trouble-a-" + "1" * 32
KEY_B = "trouble-b-" + "2" * 32
KEY_C = "trouble-c-" + "3" * 32
INSTANCE_KEY = "trouble-instances-" + "4" * 32


def row(first: str) -> dict[str, str]:
    """The README's row whose first cell starts with `first`."""
    found = [r for r in table() if r["what you see"].startswith(first)]
    assert len(found) == 1, (first, [r["what you see"] for r in table()])
    return found[0]


def seen(first: str) -> list[re.Pattern[str]]:
    """The code spans of a row's "what you see", as patterns ("..." matches any text)."""
    return cell_pattern(row(first)["what you see"])


def shows(first: str, text: str) -> None:
    """`text` (an output, an answer) shows what the row's "what you see" says."""
    patterns = seen(first)
    assert patterns, first
    missing = [p.pattern for p in patterns if not p.search(text)]
    assert not missing, (first, missing, text)


def secret(path: Path, key: str) -> Path:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


# -- the daemons ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonRun]:
    """Two llama-server instances (one slot each) on the "small" model, whose 2000 tokens
    take seconds, behind a front door with a queue of one and three tenants: team-a
    unlimited, team-b at most one request in flight, team-c one request a minute."""
    tmp = tmp_path_factory.mktemp("door")
    keys = tmp / "keys"
    tenants = (f'[[tenants]]\nname = "team-a"\nkey_file = "{secret(keys / "a", KEY_A)}"\n'
               f'[[tenants]]\nname = "team-b"\nkey_file = "{secret(keys / "b", KEY_B)}"\nmax_in_flight = 1\n'
               f'[[tenants]]\nname = "team-c"\nkey_file = "{secret(keys / "c", KEY_C)}"\nrequests_per_minute = 1\n')
    with daemons(tmp, generated_model("small")) as start:
        run = start(engine="llama-server", context_size=2048, extra_config=tenants,
                    frontend='listen = "127.0.0.1:{port}"\nqueue_size = 1\nqueue_timeout_s = 30\n')
        run.all_healthy(2)
        yield run


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonRun]:
    """One llama-server instance on the tiny model, with server.api_key_file and no tenants."""
    tmp = tmp_path_factory.mktemp("keyed")
    key = secret(tmp / "keys" / "instances", INSTANCE_KEY)
    with started(tmp / "run", generated_model("tiny"), lambda text: with_server_keys(text, f'api_key_file = "{key}"\n'),
                 engine="llama-server", placement="nodes = [0]") as run:
        run.all_healthy(1)
        yield run


def quiet(run: DaemonRun) -> None:
    """Nothing in flight at the front door any more (the streams a test left are closed)."""
    run.wait(lambda s: (s.get("frontdoor") or {}).get("in_flight") == 0
             and all(i["state"] == "healthy" and i.get("rotation") == "UP" for i in s["instances"]), 60,
             "every instance in rotation, nothing in flight")


# -- one test per row -------------------------------------------------------------------------

def test_check_names_a_missing_llama_server(tmp_path: Path) -> None:
    fs = fakesys.write_tree(tmp_path / "fs", two_single_cpu_nodes())
    config = tmp_path / "numa-infer.toml"
    missing = tmp_path / "no" / "llama-server"
    config.write_text(f'[model]\npath = "{generated_model("tiny")}"\n[server]\nllama_server = "{missing}"\n')

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "numad_infer", "--config", str(config), "--fsroot", str(fs),
                               "--state-file", str(tmp_path / "state.json"), "check"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)

    refused = check()
    assert refused.returncode != 0
    shows("`check`", refused.stdout + refused.stderr)
    # The fix: point the key at llama-server.
    config.write_text(config.read_text().replace(str(missing), str(llama_server_binary())))
    fixed = check()
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


def test_an_instance_that_keeps_crashing_is_failed_with_its_last_error(tmp_path: Path) -> None:
    bad = 'extra_args = ["--no-such-option-of-llama-server"]\n'
    fixed = False
    with started(tmp_path, generated_model("tiny"), lambda text: text if fixed else with_server_keys(text, bad),
                 engine="llama-server", placement="nodes = [0]", monitor="max_restarts = 2\n") as run:
        run.wait(lambda s: s["instances"] and s["instances"][0]["state"] == "failed", 60, "infer@0 failed")
        status = run.cli("status")
        text = status.stdout
        assert status.returncode != 0
        shows("`status`: an instance `failed`", text)
        assert re.search(r"^infer@0 .* failed ", text, re.M), text
        # "its last error is in `status`"; its engine's log says why (journalctl -u infer@0
        # under systemd; the process backend's STATE_DIR/logs/infer@0.log here).
        assert re.search(r"^  infer@0: error: ", text, re.M), text
        log = (run.state_file.parent / "logs" / "infer@0.log").read_text(errors="replace")
        assert "--no-such-option-of-llama-server" in log, log[-2000:]
        # The fix: the bad extra_args out, then `numa-infer reload`.
        fixed = True
        run.write_config(placement="nodes = [0]", monitor="max_restarts = 2\n")
        reload = run.cli("reload")
        assert reload.returncode == 0, reload.stdout + reload.stderr
        run.wait(lambda s: s["instances"][0]["state"] == "healthy", 60, "infer@0 healthy after the reload")


def test_a_model_that_loads_longer_than_the_grace_is_starting_then_unhealthy(tmp_path: Path) -> None:
    # A llama-server that answers 503 "Loading model" for 4 s before it has loaded (a big
    # model does for minutes), under monitor.startup_grace_s = 1.
    engine = loading_llama_server(shared_dir(), llama_server_binary(), server_python(), loading_s=4.0)
    grace = {"s": 1}

    def edit(text: str) -> str:
        text = text.replace(f'llama_server = "{llama_server_binary()}"', f'llama_server = "{engine}"')
        return text.replace("startup_grace_s = 60\n", f"startup_grace_s = {grace['s']}\n")
    states: list[str] = []

    def track(state: dict) -> bool:
        if state["instances"] and (not states or states[-1] != state["instances"][0]["state"]):
            states.append(state["instances"][0]["state"])
        return "unhealthy" in states
    with started(tmp_path, generated_model("tiny"), edit, engine="llama-server", placement="nodes = [0]") as run:
        run.wait(track, 60, "infer@0 unhealthy")
        expected = [p.pattern for p in seen("`status`: `starting`")]
        assert expected == ["starting", "unhealthy"]
        assert states[:2] == expected, states
        # Its probe answered as a loading llama-server does (the daemon's log of the move).
        assert "infer@0: starting -> unhealthy (probe failed: HTTP 503)" in run.logs(), run.logs()
        # The fix: a grace longer than the load. Its next start is given that long.
        grace["s"] = 30
        run.write_config(placement="nodes = [0]")
        reload = run.cli("reload")
        assert reload.returncode == 0, reload.stdout + reload.stderr
        run.wait(lambda s: s["instances"][0]["state"] == "healthy", 90, "infer@0 healthy with a longer grace")


def test_a_full_queue_answers_503_server_busy(door: DaemonRun) -> None:
    quiet(door)
    holders = []
    try:
        # A slot taken on each instance (a completion goes to an instance with a free slot),
        # then one more request, which waits in the queue.
        for n in range(3):
            holders.append(long_stream(door.frontend_port, KEY_A, f"{n}: a long answer"))
            if n < 2:
                holders[-1].wait_first_token()
        # Every instance busy (a slot each) and the queue (queue_size = 1) full.
        door.wait(lambda s: s["frontdoor"]["queued"] >= 1 and all(i.get("in_flight") for i in s["instances"]),
                  30, "both slots busy and one request queued")
        started_at = time.monotonic()
        status, headers, body = post(door.frontend_port, KEY_A, {"prompt": "one more", "max_tokens": 1})
        took = time.monotonic() - started_at
    finally:
        for holder in holders:
            holder.close()
    shows("clients get `503`", f"{status} {body['error']['type']}")
    assert status == 503 and headers.get("retry-after") == "1", (status, headers, body)
    assert took < 2.0, took  # refused at once, not after queue_timeout_s
    quiet(door)


def test_a_request_without_a_key_gets_401_with_tenants(door: DaemonRun) -> None:
    status, _, body = post(door.frontend_port, None, {"prompt": "hi", "max_tokens": 1})
    shows("clients get `401`", str(status))
    assert body["error"]["code"] == 401, body
    # The fix: a tenant's key.
    assert post(door.frontend_port, KEY_A, {"prompt": "hi", "max_tokens": 1})[0] == 200


def test_a_request_without_a_key_gets_401_with_an_api_key_file(keyed: DaemonRun) -> None:
    # No tenants: the front door passes the request on, and llama-server refuses it.
    status, _, body = post(keyed.frontend_port, None, {"prompt": "hi", "max_tokens": 1})
    shows("clients get `401`", str(status))
    assert body["error"]["code"] == 401, body
    assert post(keyed.frontend_port, INSTANCE_KEY, {"prompt": "hi", "max_tokens": 1})[0] == 200


def test_a_tenant_over_its_limits_gets_429_with_retry_after(door: DaemonRun) -> None:
    quiet(door)
    # max_in_flight = 1: a second request while its first is answered.
    holder = long_stream(door.frontend_port, KEY_B, "team-b's long one")
    try:
        holder.wait_first_token()
        status, headers, body = post(door.frontend_port, KEY_B, {"prompt": "hi", "max_tokens": 1})
    finally:
        holder.close()
    shows("a tenant gets `429`", str(status))
    assert headers.get("retry-after") == "1", (status, headers, body)
    # requests_per_minute = 1: a second request within the minute.
    assert post(door.frontend_port, KEY_C, {"prompt": "hi", "max_tokens": 1})[0] == 200
    status, headers, body = post(door.frontend_port, KEY_C, {"prompt": "hi", "max_tokens": 1})
    shows("a tenant gets `429`", str(status))
    assert int(headers["retry-after"]) > 1, (status, headers, body)  # about a request's share of the minute
    # The fix's other half: `status` shows each tenant's counts.
    door.wait(lambda s: any(t["name"] == "team-c" and t["answers"].get("429") for t in s["frontdoor"]["tenants"]),
              20, "team-c's 429 counted")
    text = door.cli("status").stdout
    assert re.search(r"^  tenant team-c: .*429", text, re.M), text
    quiet(door)


def test_a_body_that_is_not_json_gets_500_with_the_parse_error(door: DaemonRun) -> None:
    for body, content_type in ((b"prompt=Hi", "application/x-www-form-urlencoded"),  # curl -d prompt=Hi
                               (b"prompt=Hi&max_tokens=4", "application/json"),
                               (b'{"prompt": "Hi', "application/json"), (b"", "application/json")):
        status, _, answer = post(door.frontend_port, KEY_A, body, content_type=content_type)
        shows("clients get `500`", f"{status} {answer['error']['message']}")
    # What the row used to say: a JSON body without `Content-Type: application/json` is
    # answered (llama-server reads the body as JSON whatever the header says).
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded"):
        status, _, answer = post(door.frontend_port, KEY_A, {"prompt": "hello", "max_tokens": 2},
                                 content_type=content_type)
        assert status == 200 and answer["usage"]["completion_tokens"] == 2, (content_type, answer)


def test_memory_short_on_a_node_is_drift_and_doctor_shows_it(tmp_path: Path) -> None:
    # Needs a NUMA host for the whole row: VM scenario 5-memory-drift (migratepages moves an
    # instance's memory to another node; status shows it below 90 % and the repair).
    # Here: the verdict behind status's LOCAL-MEM and "drifting", and the fix's doctor on a
    # host whose node 1 has no free memory left and a busy process on an inference CPU.
    from numad_infer.config.schema import MonitorSection
    from numad_infer.doctor.verdicts import Neighbour
    from tests.doctor.hosts import doctor, put
    floor = MonitorSection().min_local_fraction
    assert "90 %" in row("`status`: local memory")["what you see"] and floor == 0.9
    verdict = check_memory(NodeUsage(anon={0: 880, 1: 120}), frozenset({0}), floor)
    assert verdict.drifted and verdict.local_fraction == 0.88
    short = "Node 1 MemTotal: 268435456 kB\nNode 1 MemFree: 0 kB\nNode 1 FilePages: 0 kB"
    checks = doctor(tmp_path, lambda r: put(r, "sys/devices/system/node/node1/meminfo", short),
                    neighbours=(Neighbour(4242, "backup", 3, 90.0),))
    memory, others = checks["memory on node 1"], checks["other processes on inference CPUs"]
    assert memory.level.value == "fail" and memory.seen.startswith("0") and " free" in memory.seen, memory
    assert others.level.value == "warn" and "backup (pid 4242)" in others.seen, others


def test_systemd_216_group_is_the_package_users_missing(tmp_path: Path) -> None:
    # Needs systemd as PID 1: VM scenarios d1-install and d2-configure-start (the .deb's
    # users made on install, then the daemon started). Here: every group numa-infer.service
    # names (SupplementaryGroups=; systemd answers 216/GROUP for one that does not exist)
    # is one the package's sysusers.d file makes (the real systemd-sysusers, into a scratch
    # root): the row's fix makes what the unit needs.
    unit = (ROOT / "debian/numa-infer.service").read_text()  # what the .deb installs
    groups = {g for line in unit.splitlines() if re.match(r"(Supplementary)?Groups?=", line)
              for g in line.split("=", 1)[1].split()}
    assert groups, "numa-infer.service names no group: the row's 216/GROUP cannot happen"
    assert "216/GROUP" in row("`systemctl start numa-infer` fails")["what you see"]
    assert "`systemd-sysusers`" in row("`systemctl start numa-infer` fails")["fix"]
    (tmp_path / "etc").mkdir()
    proc = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(ROOT / "debian/numa-infer.sysusers")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    made = {line.split(":")[0] for line in (tmp_path / "etc/group").read_text().splitlines()}
    assert groups <= made, (groups, made)


def test_an_instance_held_by_tune_and_healthz_503_without_rotation(keyed: DaemonRun) -> None:
    # `numa-infer tune` holds the instances of the node it measures (supervision/holds.py):
    # here a process that takes the hold as tune does, then is killed as a tune can be.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from numad_infer.supervision import holds\n"
         "holds.acquire(Path(sys.argv[1]), 'infer@0', 'numa-infer tune'); print(flush=True); time.sleep(300)",
         str(holds.hold_dir(keyed.state_file))], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"\n"
        keyed.wait(lambda s: s["instances"][0]["state"] == "held", 30, "infer@0 held")
        text = keyed.cli("status").stdout
        shows("`status`: an instance `held`", text)
        assert re.search(r"^infer@0 .* held ", text, re.M), text
        # No instance in rotation (the only one is held): /healthz answers 503, status says why.
        status, body = healthz(keyed)
        shows("`/healthz` answers", f"/healthz {status}")
        assert body["reason"].startswith("no instance in rotation"), body
    finally:
        # The fix: "a killed tune releases it within seconds".
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    keyed.wait(lambda s: s["instances"][0]["state"] == "healthy", 15, "infer@0 back within seconds of the kill")
    keyed.wait(lambda s: healthz(keyed)[0] == 200, 30, "/healthz 200 again")


def healthz(run: DaemonRun) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", run.frontend_port, timeout=10)
    try:
        connection.request("GET", "/healthz")
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_healthz_answers_503_while_no_instance_is_in_rotation(keyed: DaemonRun) -> None:
    # Tried with the held instance above (the row's "held"); here with the instance down
    # (SIGSTOP: out of HAProxy's rotation until the daemon replaces it).
    pid = keyed.state()["instances"][0]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        keyed.wait(lambda s: healthz(keyed)[0] == 503, 30, "/healthz 503 with the instance stopped")
        status, body = healthz(keyed)
        shows("`/healthz` answers", f"/healthz {status}")
        assert body["reason"].startswith("no instance in rotation"), body
        # The fix: `numa-infer status` says which (not healthy, out of rotation).
        shown = keyed.cli("status")
        assert shown.returncode == 1 and not re.search(r"^infer@0 .* healthy .* UP ", shown.stdout, re.M), shown.stdout
    finally:
        os.kill(pid, signal.SIGCONT)
    keyed.wait(lambda s: s["instances"][0]["state"] == "healthy" and healthz(keyed)[0] == 200, 60,
               "in rotation again")


# -- every row has its test -------------------------------------------------------------------

# A row's first cell -> the tests that try it, and where this host cannot try it whole
# (no NUMA hardware, no systemd as PID 1), the VM scenarios that do.
ROWS: dict[str, tuple[tuple[Callable[..., None], ...], str]] = {
    '`check`: `server.llama_server = "...": no such file`': ((test_check_names_a_missing_llama_server,), ""),
    "`status`: an instance `failed`": ((test_an_instance_that_keeps_crashing_is_failed_with_its_last_error,), ""),
    "`status`: `starting` for minutes, then `unhealthy`":
        ((test_a_model_that_loads_longer_than_the_grace_is_starting_then_unhealthy,), ""),
    "clients get `503` `server_busy`": ((test_a_full_queue_answers_503_server_busy,), ""),
    "clients get `401`": ((test_a_request_without_a_key_gets_401_with_tenants,
                           test_a_request_without_a_key_gets_401_with_an_api_key_file), ""),
    "a tenant gets `429`": ((test_a_tenant_over_its_limits_gets_429_with_retry_after,), ""),
    "clients get `500` `[json.exception.parse_error.101] parse error ...`":
        ((test_a_body_that_is_not_json_gets_500_with_the_parse_error,), ""),
    "`status`: local memory under 90 %, drift repeats":
        ((test_memory_short_on_a_node_is_drift_and_doctor_shows_it,), "tests/vm/scenarios.py: 5-memory-drift"),
    "`systemctl start numa-infer` fails with status 216/GROUP":
        ((test_systemd_216_group_is_the_package_users_missing,),
         "tests/vm/scenarios.py: d1-install, d2-configure-start"),
    "`status`: an instance `held`": ((test_an_instance_held_by_tune_and_healthz_503_without_rotation,), ""),
    "`/healthz` answers `503`": ((test_an_instance_held_by_tune_and_healthz_503_without_rotation,
                                  test_healthz_answers_503_while_no_instance_is_in_rotation), ""),
}


def test_every_row_of_the_table_has_its_test() -> None:
    rows = [r["what you see"] for r in table()]
    assert len(rows) >= 10, rows  # the table was found and read whole
    assert len(rows) == len(set(rows)), "two rows with one first cell"
    assert sorted(rows) == sorted(ROWS), ("rows without a test", set(rows) - set(ROWS),
                                          "tests of rows no longer there", set(ROWS) - set(rows))
    module = sys.modules[__name__]
    for first, (tests, scenarios) in ROWS.items():
        assert tests, first
        for test in tests:
            assert test.__name__.startswith("test_") and getattr(module, test.__name__) is test, first
        if scenarios:
            path, names = scenarios.split(": ")
            text = (ROOT / path).read_text()
            for name in names.split(", "):
                assert f'@scenario("{name}")' in text, (first, name)


def test_the_table_reader_splits_cells_by_their_pipes_only(tmp_path: Path) -> None:
    # A `|` inside a code span (a shell pipe in a fix) is no cell's end; the table ends at
    # its first line that is not a row.
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{HEADER}\n|---|---|---|\n| a `x | y` | b | `c` |\n\n| after | the | table |\n")
    assert table(readme) == [{"what you see": "a `x | y`", "likely cause": "b", "fix": "`c`"}]
    assert [p.pattern for p in cell_pattern('`check`: `k = "...": no such file`, then `failed`')] == [
        re.escape('k = "') + ".*?" + re.escape('": no such file'), "failed"]
