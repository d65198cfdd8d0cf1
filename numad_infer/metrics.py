"""Prometheus endpoint (`[metrics] listen`): the daemon's published snapshot, as metrics.

Read at scrape time from the last snapshot the loop published (an immutable Status
swapped in whole), so the HTTP thread never touches state the loop is changing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import socket
import threading
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from numad_infer.config import parse_listen
from numad_infer.drift import EventKind
from numad_infer.states import State
from numad_infer.status import Status

log = logging.getLogger(__name__)


class SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], Status | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator:
        snap = self.snapshot()
        if snap is None:
            return
        daemon, instances = snap.daemon, snap.instances
        labels = ["instance", "node"]
        healthy = GaugeMetricFamily("numa_infer_instance_healthy", "1 if the instance answers its health probe", labels=labels)
        state = GaugeMetricFamily("numa_infer_instance_state", "1 for the instance's current state", labels=labels + ["state"])
        restarts = CounterMetricFamily("numa_infer_instance_restarts", "Restarts of the instance (by numa-infer or systemd)", labels=labels)
        latency = GaugeMetricFamily("numa_infer_probe_latency_seconds", "Latency of the last successful health probe", labels=labels)
        local = GaugeMetricFamily("numa_infer_local_memory_fraction", "Share of anonymous memory on the instance's own nodes", labels=labels)
        threads = GaugeMetricFamily("numa_infer_instance_threads", "Threads (OpenMP) the instance runs with", labels=labels)
        in_flight = GaugeMetricFamily("numa_infer_instance_requests_in_flight",
                                      "Requests the front door has sent to the instance and not finished", labels=labels)
        queued = GaugeMetricFamily("numa_infer_instance_requests_queued",
                                   "Requests waiting at the front door for this instance", labels=labels)
        decode = GaugeMetricFamily("numa_infer_instance_decode_tokens_per_second",
                                   "Tokens the instance generated per second over the last pass (llama-server)", labels=labels)
        busy = GaugeMetricFamily("numa_infer_instance_busy_slots", "Requests the instance works on now (llama-server)",
                                 labels=labels)
        efficiency = GaugeMetricFamily("numa_infer_instance_decode_efficiency",
                                       "Decode tokens/s x weight bytes / the node's read bandwidth (numa-infer tune)",
                                       labels=labels)
        slots = GaugeMetricFamily("numa_infer_instance_slots", "Requests the instance can work on at once (llama-server)",
                                  labels=labels)
        drifts = CounterMetricFamily("numa_infer_drift_events", "Drift found, by kind", labels=labels + ["kind"])
        repairs = CounterMetricFamily("numa_infer_repairs", "Repairs done, by kind", labels=labels + ["kind"])
        for inst in instances:
            key = [inst.name, "" if inst.node is None else str(inst.node)]
            healthy.add_metric(key, 1.0 if inst.state == State.HEALTHY else 0.0)
            for name in State:
                state.add_metric(key + [name.value], 1.0 if inst.state == name else 0.0)
            restarts.add_metric(key, inst.restarts)
            threads.add_metric(key, inst.threads)
            if inst.probe_latency_ms is not None:
                latency.add_metric(key, inst.probe_latency_ms / 1000)
            if inst.local_memory_fraction is not None:
                local.add_metric(key, inst.local_memory_fraction)
            if inst.in_flight is not None:
                in_flight.add_metric(key, inst.in_flight)
                queued.add_metric(key, inst.queued or 0)
            if inst.slots is not None:
                slots.add_metric(key, inst.slots)
            if inst.busy_slots is not None:
                busy.add_metric(key, inst.busy_slots)
            if inst.decode_tokens_per_s is not None:
                decode.add_metric(key, inst.decode_tokens_per_s)
            if inst.decode_efficiency is not None:
                efficiency.add_metric(key, inst.decode_efficiency)
            for kind in EventKind:
                drifts.add_metric(key + [kind.value], inst.drift_events.get(kind.value, 0))
                repairs.add_metric(key + [kind.value], inst.repairs.get(kind.value, 0))
        yield from (healthy, state, restarts, latency, local, threads, in_flight, queued, decode, efficiency, busy,
                    slots, drifts, repairs)
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
        passes = GaugeMetricFamily("numa_infer_pass_duration_seconds", "Duration of the last monitoring pass")
        passes.add_metric([], daemon.pass_duration_s or 0.0)
        yield passes
        ok = GaugeMetricFamily("numa_infer_config_ok", "0 while the last reload was refused (old plan still running)")
        ok.add_metric([], 0.0 if daemon.last_reload is not None and not daemon.last_reload.ok else 1.0)
        yield ok


def serve(listen: str, snapshot: Callable[[], Status | None]):
    host, port = parse_listen(listen)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    metrics_app = make_wsgi_app(registry)

    def only_metrics(environ, start_response):
        # prometheus_client answers every path; an endpoint should answer only its own.
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"numa-infer: metrics are at /metrics\n"]
        return metrics_app(environ, start_response)

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = make_server(host, port, only_metrics, Server, handler_class=_SilentHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info("metrics on http://%s/metrics", listen)
    return server


class Endpoint:
    """The metrics HTTP server, (re)started when `[metrics] listen` changes."""

    def __init__(self, snapshot: Callable[[], Status | None]) -> None:
        self.snapshot = snapshot
        self.listen = ""
        self._server = None

    def listen_on(self, listen: str) -> None:
        if listen == self.listen:
            return
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.listen = ""
        if listen:
            try:
                self._server = serve(listen, self.snapshot)
                self.listen = listen
            except OSError as exc:
                log.error("metrics.listen = %s: cannot listen: %s", listen, exc.strerror)
