"""Prometheus endpoint (`[metrics] listen`): the daemon's published snapshot, as metrics.

Read at scrape time from the last snapshot the loop published (an immutable Status
swapped in whole), so the HTTP thread never touches state the loop is changing. Served by
one thread with bounded connections and deadlines (status/httpserver): the endpoint may
listen on every address of a pod.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from numad_infer.config.values import parse_listen
from numad_infer.lifecycle.drift import EventKind
from numad_infer.lifecycle.states import State
from numad_infer.status.httpserver import BoundedHTTPServer
from numad_infer.status.records import METRICS_REFUSED, InstanceStatus, Status, TenantStatus, in_rotation

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

    from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)


class SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], Status | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        if snap is None:
            return
        models = {i.name: snap.model_of(i) for i in snap.instances}
        yield from _instance_metrics(snap.instances, models)
        yield from _model_metrics(snap)
        yield from _daemon_metrics(snap)
        if snap.frontdoor is not None and snap.frontdoor.tenants:
            yield from _tenant_metrics(snap.frontdoor.tenants)


# `server`, not `instance`: Prometheus's own target label is `instance` (the host), and a
# daemon's `instance` would be renamed `exported_instance` on every scrape. `model`: the
# name clients send ([[models]] name; model.name with a single [model], "" without one).
_LABELS = ["server", "node", "model"]
# numa_infer_tenant_requests' `code` for a request whose client left before the answer's
# end: no HTTP status, so that an expression over 5xx leaves out users who gave up.
CLIENT_LEFT = "client_left"

# Per-instance gauges: (name, help, the value, None when the instance has none).
_GAUGES: tuple[tuple[str, str, Callable[[InstanceStatus], float | None]], ...] = (
    ("numa_infer_instance_healthy", "1 if the instance answers its health probe",
     lambda i: 1.0 if i.state == State.HEALTHY else 0.0),
    ("numa_infer_probe_latency_seconds", "Latency of the last successful health probe",
     lambda i: None if i.probe_latency_ms is None else i.probe_latency_ms / 1000),
    ("numa_infer_local_memory_fraction", "Share of anonymous memory on the instance's own nodes",
     lambda i: i.local_memory_fraction),
    ("numa_infer_instance_threads", "Threads (OpenMP) the instance runs with", lambda i: i.threads),
    # An alert on "a node without an instance in rotation" needs HAProxy's view, not only
    # the daemon's: a healthy instance can still be DOWN or in MAINT at the front door.
    ("numa_infer_instance_in_rotation", "1 while the front door sends the instance requests (HAProxy UP)",
     lambda i: None if i.rotation is None else 1.0 if in_rotation(i.rotation) else 0.0),
    ("numa_infer_instance_requests_in_flight", "Requests the front door has sent to the instance and not finished",
     lambda i: i.in_flight),
    ("numa_infer_instance_requests_queued", "Requests waiting at the front door for this instance",
     lambda i: None if i.in_flight is None else i.queued or 0),
    ("numa_infer_instance_decode_tokens_per_second",
     "Tokens the instance generated per second over the last pass (engines that count them)",
     lambda i: i.decode_tokens_per_s),
    ("numa_infer_instance_decode_efficiency",
     "Decode tokens/s x bytes a decoded token reads / the node's read bandwidth (numa-infer tune)",
     lambda i: i.decode_efficiency),
    ("numa_infer_instance_busy_slots", "Requests the instance works on now (engines that report it)",
     lambda i: i.busy_slots),
    ("numa_infer_instance_slots", "Requests the instance can work on at once (engines that report it)",
     lambda i: i.slots),
    ("numa_infer_instance_kv_cache_usage_ratio",
     "Share of the instance's KV cache held by requests in progress, 0 to 1 (llama-server's /slots)",
     lambda i: None if not i.kv_cache_size or i.kv_cache_tokens is None else i.kv_cache_tokens / i.kv_cache_size),
)


def _key(inst: InstanceStatus, models: dict[str, str]) -> list[str]:
    return [inst.name, "" if inst.node is None else str(inst.node), models.get(inst.name, inst.model)]


def _instance_metrics(instances: tuple[InstanceStatus, ...], models: dict[str, str]) -> Iterator[Metric]:
    gauges = [(GaugeMetricFamily(name, text, labels=_LABELS), value) for name, text, value in _GAUGES]
    state = GaugeMetricFamily("numa_infer_instance_state", "1 for the instance's current state",
                              labels=[*_LABELS, "state"])
    restarts = CounterMetricFamily("numa_infer_instance_restarts",
                                   "Restarts of the instance (by numa-infer or systemd)", labels=_LABELS)
    drifts = CounterMetricFamily("numa_infer_drift_events", "Drift found, by kind", labels=[*_LABELS, "kind"])
    repairs = CounterMetricFamily("numa_infer_repairs", "Repairs done, by kind", labels=[*_LABELS, "kind"])
    # An info metric (value 1): the label says which CPU kernels the engine runs.
    cpu = GaugeMetricFamily("numa_infer_instance_cpu_backend_info",
                            "The engine's CPU kernels: ggml's variant and its wide units",
                            labels=[*_LABELS, "cpu_backend"])
    # Counters of the engine's own (llama-server's /metrics), summed over the instance's
    # processes since the daemon started (supervision/instance.PromptTally).
    cached = CounterMetricFamily("numa_infer_instance_prompt_tokens_cached",
                                 "Prompt tokens the engine took from its cache (a slot's or --cache-ram's) instead "
                                 "of computing them", labels=_LABELS)
    computed = CounterMetricFamily("numa_infer_instance_prompt_tokens_computed",
                                   "Prompt tokens the engine computed (prefill)", labels=_LABELS)
    for inst in instances:
        key = _key(inst, models)
        if inst.prompt_tokens_cached is not None and inst.prompt_tokens_computed is not None:
            cached.add_metric(key, inst.prompt_tokens_cached)
            computed.add_metric(key, inst.prompt_tokens_computed)
        for family, value in gauges:
            found = value(inst)
            if found is not None:
                family.add_metric(key, found)
        for name in State:
            state.add_metric([*key, name.value], 1.0 if inst.state == name else 0.0)
        restarts.add_metric(key, inst.restarts)
        if inst.cpu_backend is not None:
            cpu.add_metric([*key, inst.cpu_backend], 1.0)
        for kind in EventKind:
            drifts.add_metric([*key, kind.value], inst.drift_events.get(kind.value, 0))
            repairs.add_metric([*key, kind.value], inst.repairs.get(kind.value, 0))
    yield from (family for family, _ in gauges)
    yield from (state, restarts, drifts, repairs, cpu, cached, computed)
    yield from _latency_metrics(instances, models)


def _latency_metrics(instances: tuple[InstanceStatus, ...], models: dict[str, str]) -> Iterator[Metric]:
    """Per instance, from the front door's log of each request (request_log.py says how)."""
    first = HistogramMetricFamily(
        "numa_infer_time_to_first_token_seconds",
        "From the front door receiving a request to the first byte of its answer's body from the instance: a "
        "stream's first token; an answer sent whole counts whole. Includes the wait in the front door's queue",
        labels=_LABELS)
    whole = HistogramMetricFamily(
        "numa_infer_request_duration_seconds",
        "From the front door receiving a request to the last byte of its answer, queue included", labels=_LABELS)
    for inst in instances:
        key = _key(inst, models)
        for family, histogram in ((first, inst.time_to_first_token), (whole, inst.request_duration)):
            if histogram is not None:
                family.add_metric(key, histogram.cumulative(), histogram.sum)
    yield from (first, whole)


def _model_metrics(snap: Status) -> Iterator[Metric]:
    """Per model: what the Kubernetes inference gateway's endpoint picker weighs (its
    --total-queued-requests-metric, --total-running-requests-metric and
    --kv-cache-usage-percentage-metric name them, with `{model=NAME}`: docs/kubernetes.md)."""
    healthy = GaugeMetricFamily("numa_infer_model_healthy",
                                "1 while the model is served: one of its servers in rotation at the front door (a "
                                "surge's copy included; without one, an instance healthy)", labels=["model"])
    queued = GaugeMetricFamily("numa_infer_model_requests_queued",
                               "Requests for the model waiting at the front door for one of its instances",
                               labels=["model"])
    running = GaugeMetricFamily("numa_infer_model_requests_running",
                                "Requests for the model the front door has sent to its instances and not finished",
                                labels=["model"])
    kv = GaugeMetricFamily("numa_infer_model_kv_cache_usage_ratio",
                           "Share of the KV cache of the model's instances in rotation held by requests in progress, "
                           "0 to 1 (llama-server's /slots)", labels=["model"])
    for model in snap.models:
        healthy.add_metric([model.name], 1.0 if model.healthy else 0.0)
        if model.in_flight is not None:
            queued.add_metric([model.name], model.queued or 0)
            running.add_metric([model.name], model.in_flight)
        # Of the instances that can take its next request: a drained one's cache is no room.
        mine = [i for i in snap.instances if i.name in model.instances and i.kv_cache_size
                and i.kv_cache_tokens is not None and (snap.frontdoor is None or in_rotation(i.rotation))]
        if mine:
            kv.add_metric([model.name], sum(i.kv_cache_tokens or 0 for i in mine) / sum(i.kv_cache_size or 0
                                                                                         for i in mine))
    yield from (healthy, queued, running, kv)


def _tenant_metrics(tenants: tuple[TenantStatus, ...]) -> Iterator[Metric]:
    """Per `[[tenants]]` table (frontdoor/tenants.py): the label's values come from the
    configuration, never from a request."""
    answers = CounterMetricFamily("numa_infer_tenant_requests",
                                  "The tenant's requests answered by the front door since the daemon started, by HTTP "
                                  f"status (its own 429 and 403 included); code=\"{CLIENT_LEFT}\": its client left "
                                  "before the answer's end", labels=["tenant", "code"])
    in_flight = GaugeMetricFamily("numa_infer_tenant_requests_in_flight",
                                  "The tenant's requests answered or queued now (what max_in_flight holds)",
                                  labels=["tenant"])
    last_minute = GaugeMetricFamily("numa_infer_tenant_requests_last_minute",
                                    "The tenant's requests let through in the last 60 s (what requests_per_minute "
                                    "holds)", labels=["tenant"])
    first = HistogramMetricFamily("numa_infer_tenant_time_to_first_token_seconds",
                                  "As numa_infer_time_to_first_token_seconds, for the tenant's requests",
                                  labels=["tenant"])
    whole = HistogramMetricFamily("numa_infer_tenant_request_duration_seconds",
                                  "As numa_infer_request_duration_seconds, for the tenant's requests",
                                  labels=["tenant"])
    tokens = CounterMetricFamily("numa_infer_tenant_tokens",
                                 "Tokens the engine reported in the tenant's answers, sent whole or streamed, by "
                                 "kind: prompt or completion", labels=["tenant", "kind"])
    counted = CounterMetricFamily("numa_infer_tenant_token_counted_answers",
                                  "The tenant's answers whose tokens numa_infer_tenant_tokens_total counts",
                                  labels=["tenant"])
    for tenant in tenants:
        for code, count in sorted(tenant.answers.items()):
            answers.add_metric([tenant.name, code], count)
        if tenant.left:  # a code of its own, not the 502 HAProxy logs for a stream the daemon ended
            answers.add_metric([tenant.name, CLIENT_LEFT], tenant.left)
        if tenant.answers or tenant.left:  # as the answers: a tenant that sent nothing has no series yet
            tokens.add_metric([tenant.name, "prompt"], tenant.prompt_tokens)
            tokens.add_metric([tenant.name, "completion"], tenant.completion_tokens)
            counted.add_metric([tenant.name], tenant.counted_answers)
        if tenant.in_flight is not None and tenant.last_minute is not None:
            in_flight.add_metric([tenant.name], tenant.in_flight)
            last_minute.add_metric([tenant.name], tenant.last_minute)
        for family, histogram in ((first, tenant.time_to_first_token), (whole, tenant.request_duration)):
            if histogram is not None:
                family.add_metric([tenant.name], histogram.cumulative(), histogram.sum)
    yield from (answers, in_flight, last_minute, first, whole, tokens, counted)


def _daemon_metrics(snap: Status) -> Iterator[Metric]:
    front = snap.frontdoor
    if front is not None:
        up = GaugeMetricFamily("numa_infer_frontdoor_up", "1 while the front door (HAProxy) answers its runtime API")
        up.add_metric([], 1.0 if front.up else 0.0)
        yield up
        if front.queued is not None:
            waiting = GaugeMetricFamily("numa_infer_frontdoor_requests_queued",
                                        "Requests waiting at the front door for any instance")
            waiting.add_metric([], front.queued)
            yield waiting
        if front.in_flight is not None:
            serving = GaugeMetricFamily("numa_infer_frontdoor_requests_in_flight",
                                        "Requests the front door has sent to instances and not finished")
            serving.add_metric([], front.in_flight)
            yield serving
        if front.queue_size is not None:
            # Published so that "queue full" is an expression, not a copy of the config in the rules.
            size = GaugeMetricFamily("numa_infer_frontdoor_queue_size",
                                     "frontend.queue_size: requests that may wait; one more is answered 503")
            size.add_metric([], front.queue_size)
            yield size
        if front.responses:
            answers = CounterMetricFamily("numa_infer_frontdoor_responses",
                                          "Answers the front door sent to clients, by HTTP class (HAProxy counts "
                                          "no finer: its own 503 for a full queue is in 5xx); reset when HAProxy "
                                          "restarts", labels=["code"])
            for code, count in sorted(front.responses.items()):
                answers.add_metric([code], count)
            yield answers
        left = CounterMetricFamily("numa_infer_frontdoor_abandoned_requests",
                                   "Requests the daemon stopped because their client had left before the answer "
                                   "(queued or at an instance), by model, since the daemon started",
                                   labels=["model"])
        for model, count in sorted(front.abandoned.items()):
            left.add_metric([model], count)
        yield left
    passes = GaugeMetricFamily("numa_infer_pass_duration_seconds", "Duration of the last monitoring pass")
    passes.add_metric([], snap.daemon.pass_duration_s or 0.0)
    yield passes
    if snap.daemon.min_local_fraction is not None:
        floor = GaugeMetricFamily("numa_infer_min_local_fraction",
                                  "monitor.min_local_fraction: local memory below it is memory drift")
        floor.add_metric([], snap.daemon.min_local_fraction)
        yield floor
    ok = GaugeMetricFamily("numa_infer_config_ok", "0 while the last reload was refused (old plan still running)")
    ok.add_metric([], 1.0 if snap.daemon.config_ok else 0.0)
    yield ok


def serve(listen: str, snapshot: Callable[[], Status | None]) -> BoundedHTTPServer:
    host, port = parse_listen(listen)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    metrics_app = make_wsgi_app(registry)

    def only_metrics(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        # prometheus_client answers every path; an endpoint should answer only its own.
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"numa-infer: metrics are at /metrics\n"]
        answer: Iterable[bytes] = metrics_app(environ, start_response)
        return answer

    server = BoundedHTTPServer(host, port, only_metrics)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info("metrics on http://%s/metrics", listen)
    return server


class Endpoint:
    """The metrics HTTP server, (re)started when `[metrics] listen` changes, and tried again
    at each apply while it could not listen."""

    def __init__(self, snapshot: Callable[[], Status | None]) -> None:
        self.snapshot = snapshot
        self.address = ""  # what it was asked to listen on
        self.error = ""  # why it could not: `cannot listen on ADDR: why`
        self._server: BoundedHTTPServer | None = None

    @property
    def listen(self) -> str:
        """Published as the daemon's `metrics`: the address served, or why it is not
        (records.METRICS_REFUSED...), which `status` shows and counts as degraded."""
        return self.error or (self.address if self._server is not None else "")

    def listen_on(self, listen: str) -> None:
        if listen == self.address and not self.error:
            return
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.address, self.error = listen, ""
        if listen:
            try:
                self._server = serve(listen, self.snapshot)
            except OSError as exc:
                self.error = f"{METRICS_REFUSED}{listen}: {exc.strerror or exc}"
                log.error("metrics.listen = %s: cannot listen: %s", listen, exc.strerror)
