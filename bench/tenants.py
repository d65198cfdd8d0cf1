#!/usr/bin/env python3
"""Tenants at the front door (issue 39), with a real HAProxy on the rendered haproxy.cfg and
the key files written as the daemon writes them, over stub upstreams (bench/routing.py's:
they answer at once, or after `--service-ms`, so what is measured is the front door):

1. gate cost: the same chat request sent direct to an upstream, through a front door
   without tenants, and through one with 100 tenants (each with a key, an in-flight limit
   and a rate limit; the key sent is the last tenant's, so every tenant's rules are
   passed over), interleaved; p50 and p99, and what the tenants add (goal <= 0.5 ms p50);
   beside them, a front door without tenants under `affinity = "prefix"` (issue 38's pick,
   the default; the others run `"none"`); then streams of 1,000 token events read whole,
   through a front door without tenants and one with 100 (whose Lua filter reads every
   chunk for the token counts);
2. isolation: upstreams that take `--service-ms` per request; tenant "quiet" sends one
   request at a time, alone and then while tenant "flood" sends 10x its in-flight limit at
   once without pause; quiet's p50/p99 latency both ways, its refusals (goal: 0), and the
   flood's answers by status;
3. priority: 12 clients of a batch tenant keep every slot busy and the queue 8 deep; an
   interactive tenant's client asks now and then; each one's queue wait, p50 (goal:
   interactive <= 1/5 of batch), two ways: its time in HAProxy's queue (%Tw, sent back in a
   header the bench adds), and its latency less the service time (which also counts a
   real engine's slower answer while it shares its CPU with the batch request in the
   instance's other slot).

With `--engine llama-server`, isolation and priority run over real llama-server instances
(one thread each, pinned to a CPU of their own where there are enough) on a generated model
instead of stubs: each request a chat prompt of its own (no cache to reuse), one token
asked, so its latency is its time to first token; the queue wait is the latency less the
median of requests sent alone.

    .venv/bin/python bench/tenants.py [--quick] [--service-ms 50] [--engine llama-server [--size small]] [--polite]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.routing import STUB, body, pct  # noqa: E402
from numad_infer.config.load import parse_config  # noqa: E402
from numad_infer.config.models import served_models as served_of  # noqa: E402
from numad_infer.engines import engine_of  # noqa: E402
from numad_infer.config.tenants import TenantKey  # noqa: E402
from numad_infer.frontdoor import tenants  # noqa: E402
from numad_infer.frontdoor.haproxy_config import paths_in, render_haproxy, write_config  # noqa: E402
from numad_infer.plan.model import Plan  # noqa: E402
from tests.daemon_harness import (  # noqa: E402
    free_port_block,
    generated_model,
    llama_server_binary,
    wait_for,
)
from tests.engines.test_builtin_engines import plan_for  # noqa: E402
from tests.frontdoor.harness import HAPROXY, _accepts  # noqa: E402

MODEL = '[model]\npath = "/a.gguf"\nname = "alpha"\n'


# Bench-only: each answer says how long its request waited in HAProxy's queues (%Tw, the
# request log's queue time), the priority figure's direct measure.
QUEUE_HEADER = "X-Bench-Queue-Ms"


# A stub that streams: EVENTS token events, then the last with llama-server's `timings`,
# as fast as it can write them (the Lua filter that counts tokens reads every chunk).
EVENTS = 1000
STREAM_STUB = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":" word"}}],"object":"chat.completion.chunk"}\\n\\n'
LAST = b'data: {"choices":[],"timings":{"cache_n":0,"predicted_n":%d,"prompt_n":12}}\\n\\ndata: [DONE]\\n\\n'

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in [EVENT] * EVENTS + [LAST % EVENTS]:
            self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(part), part))
        self.wfile.write(b"0\\r\\n\\r\\n")

class Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass

Server(("127.0.0.1", int(sys.argv[2])), Handler).serve_forever()
""".replace("EVENTS", str(EVENTS))


def key_of(name: str) -> str:
    return f"{name}-" + "k" * 32


class Door:
    """HAProxy over stubs for a single model, with `tables` ([[tenants]]) and their keys."""

    def __init__(self, tmp: Path, tables: list[str], service_ms: int = 0, parallel: int = 1,
                 model: Path | None = None, frontend: str = "", stub: str | None = None,
                 tuning: str = "") -> None:
        """`model`: real llama-server instances on it instead of stubs; `frontend`: more
        [frontend] keys; `tuning`: [tuning] keys; `stub`: another stub's script."""
        tmp.mkdir()
        self.model, self.parallel = model, parallel
        base = free_port_block(5)
        text = "".join(f'[[tenants]]\nkey_file = "/k/{n}"\n{t}' for n, t in enumerate(tables))
        self.config = parse_config(f'{MODEL}[server]\nbase_port = {base + 1}\nengine = "llama-server"\n'
                                   f'parallel = {parallel}\n[frontend]\nlisten = "127.0.0.1:{base}"\n{frontend}'
                                   f'[tuning]\n{tuning}{text}',
                                   "/etc/numa-infer.toml")
        self.port = base
        plan = plan_for(tmp / "plan", self.config)
        self.procs: list[subprocess.Popen[bytes]] = []
        script = tmp / "stub.py"
        # The routing bench's stub, answering after service_ms.
        sleep = f"        __import__('time').sleep({service_ms / 1000})\n"
        script.write_text(stub or STUB.replace("        seen.append(", sleep + "        seen.append("))
        self.stubs = [i.port for i in plan.instances]
        try:
            self._start(tmp, plan, script)
        except BaseException:
            self.stop()  # no stub left behind holding the caller's output open
            raise

    def _start(self, tmp: Path, plan: Plan, script: Path) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        for n, instance in enumerate(plan.instances):
            if self.model is None:
                argv = [sys.executable, str(script), instance.name, str(instance.port)]
            else:
                argv = ["taskset", "-c", str(cpus[n % len(cpus)]), str(llama_server_binary()), "--model",
                        str(self.model), "--host", "127.0.0.1", "--port", str(instance.port), "--parallel",
                        str(self.parallel), "--ctx-size", str(1024 * self.parallel), "--threads", "1",
                        "--threads-batch", "1", "--no-webui"]
            self.procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in self.stubs:
            wait_for(lambda port=port: _healthy(port), f"instance on {port}", timeout_s=120)  # type: ignore[misc]
        run = tmp / "run"
        run.mkdir()
        paths = paths_in(run, run / "haproxy.sock")
        text = render_haproxy(self.config, plan, paths, served=served_of(self.config),
                              engine=engine_of(self.config)).replace(
            "    option http-buffer-request\n",
            f"    option http-buffer-request\n    http-response set-header {QUEUE_HEADER} %Tw\n")
        write_config(paths, text)
        keys = [TenantKey(t.name, key_of(t.name)) for t in self.config.tenants]
        paths.keys[0].write_text(tenants.keys_text(keys))
        paths.state.write_text("1\n")
        self.procs.append(subprocess.Popen([HAPROXY, "-db", "-f", str(paths.config)], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL))
        wait_for(lambda: _accepts(self.port), "haproxy")
        time.sleep(3)  # the first health checks put every server UP

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def _healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False


_asked = itertools.count()


def prompt(real: bool) -> bytes:
    """The stubs' body; for a real engine, a prompt of its own each time (nothing cached)."""
    if not real:
        return body("alpha")
    words = " ".join(f"w{next(_asked)}x{n}" for n in range(60))
    return json.dumps({"messages": [{"role": "user", "content": words}], "max_tokens": 1, "model": "alpha"}).encode()


def once(port: int, data: bytes, key: str | None) -> tuple[float, int]:
    """One request on a new connection; seconds and the status."""
    took, status, _ = timed(port, data, key)
    return took, status


def timed(port: int, data: bytes, key: str | None) -> tuple[float, int, float | None]:
    """One request on a new connection; seconds, the status, and its seconds in HAProxy's
    queue (None: not answered by an instance)."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", "/v1/chat/completions", data, headers)
    response = conn.getresponse()
    response.read()
    conn.close()
    queued = response.getheader(QUEUE_HEADER)
    return time.perf_counter() - start, response.status, int(queued) / 1000 if queued is not None else None


MANY = [f'name = "tenant-{n:03d}"\nmax_in_flight = 64\nrequests_per_minute = 1000000\n' for n in range(100)]
LEASTCONN = 'affinity = "none"\n'  # the gate's cost alone; the prefix pick's (the default) is its own row


def gate_cost(tmp: Path, count: int) -> None:
    none, hundred = Door(tmp / "none", [], frontend=LEASTCONN), Door(tmp / "hundred", MANY, frontend=LEASTCONN)
    prefix = Door(tmp / "prefix", [], frontend='affinity = "prefix"\n')  # the prefix pick's cost, beside
    try:
        data, last = body("alpha"), key_of("tenant-099")
        times: dict[str, list[float]] = {"direct": [], "no tenants": [], "100 tenants": [], "prefix pick": []}
        for _ in range(count):  # interleaved, so that the machine's moods fall on all alike
            times["direct"].append(once(none.stubs[0], data, None)[0])
            times["no tenants"].append(once(none.port, data, None)[0])
            took, status = once(hundred.port, data, last)
            assert status == 200, status
            times["100 tenants"].append(took)
            times["prefix pick"].append(once(prefix.port, data, None)[0])
    finally:
        none.stop()
        hundred.stop()
        prefix.stop()
    print(f"gate cost, {count} requests each, a new connection each (ms):  p50     p99")
    for name, values in times.items():
        print(f"  {name:<12}  {pct(values, 0.5) * 1000:7.3f} {pct(values, 0.99) * 1000:7.3f}")
    p50 = {name: pct(values, 0.5) * 1000 for name, values in times.items()}
    print(f"  the tenants' rules add, p50: {p50['100 tenants'] - p50['no tenants']:.3f} ms (goal <= 0.5 ms)")
    print(f"  affinity = \"prefix\" (no tenants) adds, p50: {p50['prefix pick'] - p50['no tenants']:.3f} ms "
          "(the body's key read, hashed, and the Lua pick over 2 instances)")


def streamed(port: int, key: str | None) -> float:
    """One streamed answer read to its end on a new connection: seconds."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body("alpha"),
                 {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    assert response.status == 200 and data.count(b"data: ") == EVENTS + 2, (response.status, len(data))
    return time.perf_counter() - start


def stream_cost(tmp: Path, count: int) -> None:
    """With [[tenants]], each answer passes through the Lua filter that reads its token
    counts (token_count.py): its cost on a long stream, against the same door without."""
    none = Door(tmp / "stream-none", [], frontend=LEASTCONN, stub=STREAM_STUB)
    hundred = Door(tmp / "stream-hundred", MANY, frontend=LEASTCONN, stub=STREAM_STUB)
    try:
        last = key_of("tenant-099")
        times: dict[str, list[float]] = {"no tenants": [], "100 tenants": []}
        for _ in range(count):
            times["no tenants"].append(streamed(none.port, None))
            times["100 tenants"].append(streamed(hundred.port, last))
    finally:
        none.stop()
        hundred.stop()
    print(f"streams of {EVENTS} token events (~{EVENTS * 96 // 1024} KiB), {count} each, read whole (ms):  p50     p99")
    for name, values in times.items():
        print(f"  {name:<12}  {pct(values, 0.5) * 1000:7.3f} {pct(values, 0.99) * 1000:7.3f}")
    added = (pct(times["100 tenants"], 0.5) - pct(times["no tenants"], 0.5)) * 1000
    print(f"  the token count (and the gate) add, p50: {added:.3f} ms a stream, "
          f"{added * 1000 / EVENTS:.2f} us an event")


def isolation(tmp: Path, count: int, service_ms: int, model: Path | None = None, polite: bool = False,
              limit: int = 2) -> None:
    """`polite`: the flood's clients wait out each 429's Retry-After (1 s) before asking again,
    as the OpenAI clients do; otherwise they ask again at once. `limit`: the flood's
    max_in_flight (it keeps 10x that many in flight)."""
    tables = ['name = "quiet"\n', f'name = "flood"\nmax_in_flight = {limit}\n']
    door = Door(tmp / f"isolation-{limit}", tables, service_ms, parallel=2, model=model)
    real = model is not None
    stop = threading.Event()
    flood: dict[int, int] = {}
    lock = threading.Lock()

    def flooder() -> None:
        while not stop.is_set():
            status = once(door.port, prompt(real), key_of("flood"))[1]
            with lock:
                flood[status] = flood.get(status, 0) + 1
            if polite and status == 429:
                stop.wait(1.0)

    def quiet() -> tuple[list[float], int]:
        times, refused = [], 0
        for _ in range(count):
            took, status = once(door.port, prompt(real), key_of("quiet"))
            times.append(took)
            refused += status != 200
        return times, refused

    try:
        alone, refused_alone = quiet()
        threads = [threading.Thread(target=flooder) for _ in range(10 * limit)]  # 10x flood's limit
        for thread in threads:
            thread.start()
        time.sleep(1)
        beside, refused_beside = quiet()
        stop.set()
        for thread in threads:
            thread.join(60)
    finally:
        door.stop()
    upstreams = f"llama-server on {model.name}" if model is not None else f"upstreams take {service_ms} ms"
    retry = "waiting out Retry-After" if polite else "asking again at once after a 429"
    print(f"isolation: {upstreams}, 2 instances x 2 slots; quiet sends {count} one at a time, "
          f"flood keeps {10 * limit} in flight (limit {limit}), {retry}:")
    for name, values, refused in (("alone", alone, refused_alone), ("beside flood", beside, refused_beside)):
        print(f"  quiet {name:<13} p50 {pct(values, 0.5) * 1000:7.1f} ms  p99 {pct(values, 0.99) * 1000:7.1f} ms  "
              f"refused {refused}")
    print(f"  quiet p99 beside flood / alone: {pct(beside, 0.99) / pct(alone, 0.99):.2f}x (goal <= 1.2x); "
          f"flood's answers: {json.dumps(dict(sorted(flood.items())))}")


def priority(tmp: Path, count: int, service_ms: int, model: Path | None = None, reserve: int = 1) -> None:
    """The instances kept busy by a batch tenant; an interactive tenant's requests among its
    queued ones. The queue wait of each: its latency less the service time (a real engine's:
    the median of requests sent alone, measured first). `reserve`: tuning.interactive_reserve."""
    tables = ['name = "chat"\n', 'name = "bulk"\npriority = "batch"\n']
    door = Door(tmp / f"priority-{reserve}", tables, service_ms, parallel=2, model=model,
                tuning=f"interactive_reserve = {reserve}\n")
    real = model is not None
    if real:
        service_ms = int(pct([once(door.port, prompt(real), key_of("chat"))[0] for _ in range(10)], 0.5) * 1000)
    stop = threading.Event()
    waits: dict[str, list[float]] = {"chat": [], "bulk": []}
    queued: dict[str, list[float]] = {"chat": [], "bulk": []}
    lock = threading.Lock()

    def client(tenant: str, pause_s: float) -> None:
        while not stop.is_set():
            took, status, in_queue = timed(door.port, prompt(real), key_of(tenant))
            if status == 200:
                with lock:
                    waits[tenant].append(max(0.0, took - service_ms / 1000))
                    queued[tenant].append(in_queue or 0.0)
            time.sleep(pause_s)

    # 12 batch clients on 4 slots keep the queue 8 deep; one interactive client asks now and then.
    threads = [threading.Thread(target=client, args=("bulk", 0.0)) for _ in range(12)]
    threads.append(threading.Thread(target=client, args=("chat", service_ms / 1000)))
    try:
        for thread in threads:
            thread.start()
        began = time.monotonic()
        while len(waits["chat"]) < count:
            time.sleep(0.2)
        stop.set()
        took_s = time.monotonic() - began
        for thread in threads:
            thread.join(60)
    finally:
        door.stop()
    upstreams = f"llama-server on {model.name} ({service_ms} ms alone)" if model else f"upstreams take {service_ms} ms"
    print(f"priority, interactive_reserve = {reserve}: {upstreams}, 2 instances x 2 slots, 12 batch clients "
          f"without pause, one interactive client ({len(waits['chat'])} requests; batch {len(waits['bulk'])}, "
          f"{len(waits['bulk']) / took_s:.2f}/s); p50 (goal: ratio <= 0.2):")
    for what, figures in (("in HAProxy's queue (%Tw)", queued), ("latency less the service time", waits)):
        p50 = {name: pct(values, 0.5) * 1000 for name, values in figures.items()}
        print(f"  {what:<30} interactive {p50['chat']:7.1f} ms  batch {p50['bulk']:7.1f} ms  "
              f"ratio {p50['chat'] / max(p50['bulk'], 1e-9):.2f}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--service-ms", type=int, default=50)
    parser.add_argument("--engine", choices=["stub", "llama-server"], default="stub")
    parser.add_argument("--size", default="small", help="the generated model for --engine llama-server")
    parser.add_argument("--polite", action="store_true", help="the flood waits out each 429's Retry-After")
    parser.add_argument("--reserves", type=lambda v: [int(n) for n in v.split(",")], default=[0, 1],
                        help="tuning.interactive_reserve values for the priority section, side by side")
    parser.add_argument("--only", choices=["isolation", "priority"], help="one section of the run")
    parser.add_argument("--flood-limits", type=lambda v: [int(n) for n in v.split(",")], default=[2],
                        help="the flood tenant's max_in_flight values for the isolation section, one after another")
    args = parser.parse_args()
    model = generated_model(args.size) if args.engine == "llama-server" else None
    with tempfile.TemporaryDirectory() as tmp:
        if model is None and args.only is None:  # the gate's cost is HAProxy's alone
            gate_cost(Path(tmp), 300 if args.quick else 2000)
            stream_cost(Path(tmp), 30 if args.quick else 200)
        for limit in args.flood_limits if args.only in (None, "isolation") else []:
            isolation(Path(tmp), 50 if args.quick else 200, args.service_ms, model, args.polite, limit)
        for reserve in args.reserves if args.only in (None, "priority") else []:
            priority(Path(tmp), 30 if args.quick else 100, args.service_ms * 4, model, reserve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
