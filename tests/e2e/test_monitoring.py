"""The Grafana dashboard and the Prometheus alert rules (packaging/grafana, packaging/prometheus).

- `promtool check rules` and `promtool test rules` (each alert fires from synthetic series
  and stays silent on a healthy host: packaging/prometheus/numa-infer-rules.test.yml);
- a real Prometheus (Debian's `prometheus`, on loopback, temporary storage, 1 s scrapes)
  scrapes a real daemon (process backend, llama-server on the tiny generated model): every
  dashboard query and every alert expression returns data, or is on the documented list
  of results that are empty while the host is healthy, whose inner series must then exist;
- one fault: a reload whose servers cannot start, then kill -9 of an instance: its restarts
  fail, it is marked failed, and the matching alerts fire in that Prometheus.

Not skipped when promtool or prometheus is missing (scripts/setup installs them): a check
that silently does not run protects nothing. The topology is tests/daemon_harness.py's
fake 2-node sysfs (these hosts have one node); everything else is real.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from numad_infer.lifecycle.states import State
from numad_infer.status.metrics import SnapshotCollector
from numad_infer.status.records import (
    DaemonState,
    DaemonStatus,
    FrontdoorStatus,
    InstanceStatus,
    ModelStatus,
    Status,
    TenantStatus,
)
from numad_infer.tune import bandwidth_file as bandwidthfile
from numad_infer.util.histogram import REQUEST_DURATION_BOUNDS, TIME_TO_FIRST_TOKEN_BOUNDS, Histogram, Recorder
from tests.daemon_harness import ROOT, DaemonRun, daemons, free_port, generated_model

RULES = ROOT / "packaging/prometheus/numa-infer-rules.yml"
RULES_TEST = ROOT / "packaging/prometheus/numa-infer-rules.test.yml"
DASHBOARD = ROOT / "packaging/grafana/numa-infer.json"
# Not "numa-infer": the rules and the dashboard select no job name (a PodMonitor names it so).
JOB = "ml/numa-infer"
TENANT_KEY = "team-a-" + "7" * 32

# Alert expressions that are empty on a healthy host (that is what makes them alerts), each
# with the series inside it that must exist for the alert to be able to fire at all. Each
# inner expression is checked to be part of the alert's expression, so the two cannot part.
EXPECTED_EMPTY_WHEN_HEALTHY: dict[str, tuple[str, ...]] = {
    "NumaInferDaemonDown": ('up', 'max_over_time(numa_infer_config_ok[1d])'),
    "NumaInferDaemonAbsent": ('numa_infer_config_ok',),
    "NumaInferInstanceFailed": ('numa_infer_instance_state{state="failed"}',),
    "NumaInferInstanceUnhealthy": ('numa_infer_instance_healthy',),
    "NumaInferNodeOutOfRotation": ('max by (job, instance, model, node) (numa_infer_instance_in_rotation)',),
    "NumaInferModelDown": ('numa_infer_model_healthy',),
    "NumaInferMemoryNotLocal": ('numa_infer_local_memory_fraction',
                                'numa_infer_min_local_fraction'),
    "NumaInferRestartLoop": ('increase(numa_infer_instance_restarts_total[15m])',),
    "NumaInferFrontdoorDown": ('numa_infer_frontdoor_up',),
    "NumaInferFrontdoorQueueFull": ('numa_infer_frontdoor_requests_queued '
                                    '/ numa_infer_frontdoor_queue_size',),
    "NumaInferFrontdoor5xxHigh": (
        'sum by (job, instance) (rate(numa_infer_frontdoor_responses_total[5m]))',),
    "NumaInferReloadRefused": ('numa_infer_config_ok',),
    "NumaInferTimeToFirstTokenHigh": (
        'sum by (job, instance, server, le) (rate(numa_infer_time_to_first_token_seconds_bucket[10m]))',),
}
# Grafana's own variables, as the dashboard's "All" would send them.
DASHBOARD_VARIABLES = {"$instance": ".*", "$node": ".*", "$model": ".*", "$__rate_interval": "1m"}


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: apt-get install prometheus (scripts/setup does)"
    return path


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _alerts() -> dict[str, str]:
    return {rule["alert"]: _one_line(rule["expr"]) for rule in _rules() if "alert" in rule}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with the dashboard's variables as "All" would fill them)."""
    doc = json.loads(DASHBOARD.read_text())
    found = []
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name in sorted(DASHBOARD_VARIABLES, key=len, reverse=True):
                expr = expr.replace(name, DASHBOARD_VARIABLES[name])
            found.append((panel["title"], expr))
    return found


# -- pure checks ---------------------------------------------------------------------------------


def _full_status() -> Status:
    """A status with every optional field set, so the collector publishes every metric it has."""
    inst = InstanceStatus(name="infer@0", node=0, cpus=(0,), mems=(0,), threads=1, port=8080, pid=1,
                          state=State.HEALTHY, local_memory_fraction=0.8, probe_latency_ms=3.0, drift_events={"memory": 1},
                          repairs={"memory": 1}, rotation="UP 1/2", in_flight=1, queued=0, served=5, slots=2,
                          busy_slots=1, decode_tokens_per_s=10.0, decode_efficiency=0.4, kv_cache_tokens=64,
                          kv_cache_size=512, prompt_tokens_cached=300, prompt_tokens_computed=100,
                          time_to_first_token=_histogram(TIME_TO_FIRST_TOKEN_BOUNDS, 0.3, 2.0),
                          request_duration=_histogram(REQUEST_DURATION_BOUNDS, 1.5, 4.0))
    out = InstanceStatus(name="infer@1", node=1, cpus=(1,), mems=(1,), threads=1, port=8081, pid=2,
                         state=State.UNHEALTHY, rotation="MAINT", in_flight=0, queued=0)
    tenant = TenantStatus("team-a", 1, 5, {"200": 4, "429": 1}, _histogram(TIME_TO_FIRST_TOKEN_BOUNDS, 0.3),
                          _histogram(REQUEST_DURATION_BOUNDS, 1.5), 120, 30, 3)
    front = FrontdoorStatus("127.0.0.1:8000", True, queued=3, in_flight=1, queue_size=64,
                            responses={"2xx": 40, "5xx": 2}, tenants=(tenant,), abandoned={"instances": 1})
    daemon = DaemonStatus(DaemonState.RUNNING, "/etc/numa-infer.toml", pass_duration_s=0.01, min_local_fraction=0.9)
    models = (ModelStatus("", (), ("infer@0", "infer@1"), True, None, queued=3, in_flight=1),)
    return Status(daemon, (inst, out), front, models)


def _histogram(bounds: tuple[float, ...], *values: float) -> Histogram:
    recorder = Recorder(bounds)
    for value in values:
        recorder.observe(value)
    return recorder.snapshot()


def test_the_request_timings_are_published_as_prometheus_histograms() -> None:
    text = _published(_full_status())
    assert 'numa_infer_time_to_first_token_seconds_bucket{le="0.25",model="",node="0",server="infer@0"} 0.0' in text
    assert 'numa_infer_time_to_first_token_seconds_bucket{le="0.5",model="",node="0",server="infer@0"} 1.0' in text
    assert 'numa_infer_time_to_first_token_seconds_bucket{le="+Inf",model="",node="0",server="infer@0"} 2.0' in text
    assert 'numa_infer_time_to_first_token_seconds_count{model="",node="0",server="infer@0"} 2.0' in text
    assert 'numa_infer_request_duration_seconds_sum{model="",node="0",server="infer@0"} 5.5' in text
    assert 'server="infer@1"' not in "".join(line for line in text.splitlines() if "_seconds_" in line)


def _published(status: Status) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: status))
    return generate_latest(registry).decode()


def test_metrics_publish_rotation_queue_size_answers_and_the_locality_floor() -> None:
    text = _published(_full_status())
    # "UP 1/2" is still in rotation (one failed check of the two it takes to go DOWN).
    assert 'numa_infer_instance_in_rotation{model="",node="0",server="infer@0"} 1.0' in text
    assert 'numa_infer_instance_in_rotation{model="",node="1",server="infer@1"} 0.0' in text
    assert "numa_infer_frontdoor_queue_size 64.0" in text
    assert "numa_infer_frontdoor_requests_in_flight 1.0" in text
    assert 'numa_infer_frontdoor_responses_total{code="5xx"} 2.0' in text
    assert 'numa_infer_frontdoor_responses_total{code="2xx"} 40.0' in text
    assert "numa_infer_min_local_fraction 0.9" in text


def test_without_a_front_door_no_rotation_or_answers_are_invented() -> None:
    full = _full_status()
    bare = Status(full.daemon, tuple(replace(i, rotation=None) for i in full.instances))
    text = _published(bare)
    assert "numa_infer_instance_in_rotation{" not in text and "numa_infer_frontdoor_" not in text


def test_the_dashboard_and_the_rules_use_only_metrics_the_daemon_publishes() -> None:
    published = set(re.findall(r"^(numa_infer_\w+?)(?:\{| )", _published(_full_status()), re.M))
    exprs = [e for _, e in dashboard_queries()] + list(_alerts().values())
    used = {name for e in exprs for name in re.findall(r"\bnuma_infer_\w+", e)}
    assert used and used <= published, sorted(used - published)
    # Everything an operator could want on the dashboard is on it.
    on_dashboard = {name for _, e in dashboard_queries() for name in re.findall(r"\bnuma_infer_\w+", e)}
    # A histogram is on it through its buckets; its _sum and _count come with them.
    on_dashboard |= {name[: -len("_bucket")] + part for name in on_dashboard if name.endswith("_bucket")
                     for part in ("_sum", "_count")}
    assert published - on_dashboard <= {"numa_infer_instance_threads"}, sorted(published - on_dashboard)


def test_the_dashboard_is_a_grafana_dashboard_with_a_datasource_host_and_node_variable() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert 36 <= doc["schemaVersion"] <= 41 and doc["uid"] == "numa-infer"
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"instance", "node"} <= set(variables)
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for panel in doc["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"] and panel["description"], panel["title"]
    # Each panel filters by the variables, so choosing a host or a node narrows every one.
    for title, expr in [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]:
        assert 'instance=~"$instance"' in expr, title


def test_promtool_accepts_the_rules() -> None:
    proc = subprocess.run([_tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in proc.stdout


def test_every_alert_fires_on_its_fault_and_not_on_a_healthy_host_in_promtool() -> None:
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]}
    silent = {case["alertname"] for t in tests for case in t["alert_rule_test"] if not case["exp_alerts"]}
    assert fired == set(_alerts()) and silent == set(_alerts()), (set(_alerts()) - fired, set(_alerts()) - silent)
    proc = subprocess.run([_tool("promtool"), "test", "rules", RULES_TEST.name], capture_output=True, text=True,
                          timeout=120, cwd=RULES_TEST.parent)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_the_expected_empty_list_names_every_alert_and_parts_of_its_expression() -> None:
    alerts = _alerts()
    assert set(EXPECTED_EMPTY_WHEN_HEALTHY) == set(alerts)
    for name, inners in EXPECTED_EMPTY_WHEN_HEALTHY.items():
        for inner in inners:
            assert _one_line(inner) in alerts[name], (name, inner)


# -- a real Prometheus scraping a real daemon -------------------------------------------------------


class Prometheus:
    """Debian's prometheus on loopback: temporary config and storage, 1 s scrapes and rule evaluations."""

    def __init__(self, tmp: Path, target: str, rules: Path) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [target]}]}],
        }))
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [_tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.tmp = tmp

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            doc = json.load(response)
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", query=expr)["result"]

    def wait(self, expr: str, timeout: float, what: str) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.logs()}")
            try:
                result = self.query(expr)
            except OSError:  # not listening yet
                result = []
            if result:
                return result
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}: {expr}\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        return (self.tmp / "prometheus.log").read_text()[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[functools.partial]:
    started: list[Prometheus] = []

    def start(target: str, rules: Path) -> Prometheus:
        (tmp_path / "prom").mkdir()
        started.append(Prometheus(tmp_path / "prom", target, rules))
        return started[-1]

    yield start
    for prom in started:
        prom.stop()


def _rules_without_waiting(tmp: Path) -> Path:
    """A test copy of the rules with every `for:` removed: the fault must not have to last
    the minutes an operator's alert waits (the waits themselves are promtool's to test)."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("for", None)
    path = tmp / "numa-infer-rules.live.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _completion(port: int, key: str | None = None) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "hello", "max_tokens": 8}).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def test_live_prometheus_answers_every_dashboard_query_and_a_killed_instance_held_down_fires(
        tmp_path: Path, prometheus) -> None:
    metrics_port = free_port()
    # A tenant, so that the dashboard's Tenants row has a series to show.
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    (keys / "a").write_text(TENANT_KEY + "\n")
    (keys / "a").chmod(0o600)
    with daemons(tmp_path, generated_model("tiny")) as start:
        monitor = "max_restarts = 2\n"
        run: DaemonRun = start(engine="llama-server", monitor=monitor,
                               extra_config=f'[[tenants]]\nname = "team-a"\nkey_file = "{keys / "a"}"\n'
                                            f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n')
        prom = prometheus(f"127.0.0.1:{metrics_port}", _rules_without_waiting(tmp_path))
        state = run.wait(lambda s: len(s["instances"]) == 2 and (s.get("frontdoor") or {}).get("up")
                         and all(i["state"] == "healthy" and i.get("rotation") == "UP" for i in s["instances"]),
                         90, "2 healthy instances in rotation")
        # Decode efficiency needs the node's bandwidth as `numa-infer tune` measured it; a tune
        # run takes minutes, so its results file is written here (the real format, by the real
        # writer, read by the daemon as tune's) with a made-up 10 GB/s.
        bandwidthfile.save(run.state_file.parent / bandwidthfile.RESULTS_NAME, {(0, 0): 10.0, (1, 1): 10.0})
        _completion(run.frontend_port, TENANT_KEY)  # a 2xx answer and generated tokens to count, the tenant's
        ready = time.monotonic()
        prom.wait(f'numa_infer_frontdoor_responses_total{{job="{JOB}", code="2xx"}} >= 1', 20,
                  "the completion counted by the front door")
        # rate() and increase() over the dashboard's 1m need a few scrapes.
        prom.wait(f'count_over_time(numa_infer_frontdoor_responses_total{{job="{JOB}", code="2xx"}}[1m]) >= 3', 20,
                  "three scrapes of the front door's counters")

        empty = [(title, expr) for title, expr in dashboard_queries() if not prom.query(expr)]
        assert not empty, empty
        # The completion's prompt, as llama-server counted it: in the status file and the counters.
        served = [i for i in run.state()["instances"] if i.get("prompt_tokens_computed")]
        assert len(served) == 1 and served[0]["prompt_tokens_cached"] is not None, run.state()["instances"]
        assert prom.query('numa_infer_instance_prompt_tokens_computed_total > 0')
        efficiency = prom.query('numa_infer_instance_decode_efficiency')
        assert {r["metric"]["server"] for r in efficiency} == {"infer@0", "infer@1"}

        alerts = _alerts()
        returned = {name for name, expr in alerts.items() if prom.query(expr)}
        assert not returned, f"alerts that fire on a healthy host: {returned}"
        for name in alerts:
            for inner in EXPECTED_EMPTY_WHEN_HEALTHY[name]:
                assert prom.query(inner), (name, inner)
        print(f"healthy: {len(dashboard_queries())} dashboard queries and {len(alerts)} alert expressions checked "
              f"in {time.monotonic() - ready:.1f}s")

        # The fault: a reload whose servers cannot start (an option llama-server refuses), then
        # kill -9 of infer@1. Its restarts run the new, failing definition: it is held down.
        run.server_extra = 'extra_args = ["--no-such-option-numa-infer"]\n'
        run.write_config(monitor=monitor)
        reload = run.cli("reload")
        assert reload.returncode == 0, reload.stdout + reload.stderr
        victim = run.instance(run.state(), "infer@1")["pid"]
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        run.wait(lambda s: run.instance(s, "infer@1")["state"] == "failed", 60, "infer@1 failed")
        firing = prom.wait('ALERTS{alertname="NumaInferInstanceFailed", alertstate="firing", '
                           'server="infer@1"}', 20, "NumaInferInstanceFailed firing for infer@1")
        assert firing[0]["metric"]["node"] == "1" and firing[0]["metric"]["severity"] == "critical"
        prom.wait('ALERTS{alertname="NumaInferNodeOutOfRotation", alertstate="firing", node="1"}', 20,
                  "NumaInferNodeOutOfRotation firing for node 1")
        active = {a["labels"]["alertname"] for a in prom.get("/api/v1/alerts")["alerts"] if a["state"] == "firing"}
        print(f"kill -9 to alerts firing: {time.monotonic() - killed:.1f}s; firing: {sorted(active)}")
        assert "NumaInferDaemonDown" not in active and "NumaInferFrontdoorDown" not in active


def test_the_deb_ships_the_dashboard_the_rules_and_their_tests_side_by_side() -> None:
    # The unit tests name the rules file relatively: both must land in one directory.
    lines = [line.split() for line in (ROOT / "debian/numa-infer.install").read_text().splitlines() if line.strip()]
    shipped = {source: target for source, target in lines}
    rules, tests = (str(p.relative_to(ROOT)) for p in (RULES, RULES_TEST))
    assert shipped[str(DASHBOARD.relative_to(ROOT))] == "usr/share/numa-infer/grafana/"
    assert shipped[rules] == shipped[tests] == "usr/share/numa-infer/prometheus/"
    assert yaml.safe_load(RULES_TEST.read_text())["rule_files"] == [RULES.name]


def test_two_models_label_every_instance_and_publish_queue_running_and_kv_cache_per_model() -> None:
    """[[models]]: each instance's series carry its model; the endpoint picker's three
    metrics are per model, the KV cache over the model's instances in rotation only."""
    chat = InstanceStatus(name="infer@chat-0", node=0, cpus=(0,), mems=(0,), threads=1, port=8080, pid=1,
                          state=State.HEALTHY, model="chat", rotation="UP", in_flight=2, queued=0,
                          kv_cache_tokens=300, kv_cache_size=1000)
    drained = replace(chat, name="infer@chat-1", node=1, rotation="DRAIN", kv_cache_tokens=1000)
    small = InstanceStatus(name="infer@small-0", node=0, cpus=(1,), mems=(0,), threads=1, port=8082, pid=3,
                           state=State.FAILED, model="small", rotation="MAINT", in_flight=0, queued=0)
    models = (ModelStatus("chat", ("gpt-4o",), ("infer@chat-0", "infer@chat-1"), True, None, 4, 2),
              ModelStatus("small", (), ("infer@small-0",), False, "no instance in rotation (1 failed)", 0, 0))
    full = _full_status()
    text = _published(Status(full.daemon, (chat, drained, small), full.frontdoor, models))
    assert 'numa_infer_instance_healthy{model="chat",node="0",server="infer@chat-0"} 1.0' in text
    assert 'numa_infer_instance_healthy{model="small",node="0",server="infer@small-0"} 0.0' in text
    assert 'numa_infer_model_healthy{model="chat"} 1.0' in text
    assert 'numa_infer_model_healthy{model="small"} 0.0' in text
    assert 'numa_infer_model_requests_queued{model="chat"} 4.0' in text
    assert 'numa_infer_model_requests_running{model="chat"} 2.0' in text
    assert 'numa_infer_model_kv_cache_usage_ratio{model="chat"} 0.3' in text
    assert 'numa_infer_model_kv_cache_usage_ratio{model="small"}' not in text  # no instance says
    assert 'numa_infer_instance_kv_cache_usage_ratio{model="chat",node="1",server="infer@chat-1"} 1.0' in text


def test_prompt_tokens_cached_and_computed_are_counters_per_instance_with_its_model() -> None:
    text = _published(_full_status())
    assert 'numa_infer_instance_prompt_tokens_cached_total{model="",node="0",server="infer@0"} 300.0' in text
    assert 'numa_infer_instance_prompt_tokens_computed_total{model="",node="0",server="infer@0"} 100.0' in text
    assert "# TYPE numa_infer_instance_prompt_tokens_cached_total counter" in text
    assert 'server="infer@1"' not in "".join(line for line in text.splitlines() if "prompt_tokens" in line)
