#!/usr/bin/env python3
"""Routing by `model` at the front door (issue 31), with a real HAProxy on the rendered
haproxy.cfg over stub upstreams (tiny HTTP servers that answer at once, so what is
measured is the front door alone):

1. added latency, p50 and p99: the same chat request (about 1 KB, `model` last) sent
   direct to an upstream, through the front door of a single `[model]` (no routing), and
   through the front door of two `[[models]]` (the body's `model` read, then routed),
   interleaved; the cost of routing is two models' p50 less one model's;
2. correctness: 1,000 requests mixing both models' names and aliases, sent 8 at a time;
   each upstream records the X-Test-Id of every request it got, and a request that reached
   an instance of another model than the one it named is counted as wrong.

    .venv/bin/python bench/routing.py [--quick]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numad_infer.config.load import parse_config  # noqa: E402
from numad_infer.config.models import served_models as served_of  # noqa: E402
from numad_infer.engines import engine_of  # noqa: E402
from numad_infer.frontdoor.haproxy_config import paths_in, render_haproxy, write_config  # noqa: E402
from tests.daemon_harness import free_port_block  # noqa: E402
from tests.engines.test_builtin_engines import plan_for  # noqa: E402
from tests.daemon_harness import wait_for  # noqa: E402
from tests.frontdoor.harness import HAPROXY, _accepts  # noqa: E402

# Answers every POST at once with its own name, keeps each request's X-Test-Id, and lists
# them on GET /seen (GET / is the health check).
STUB = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

name, port = sys.argv[1], int(sys.argv[2])
seen = []

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def _answer(self, doc):
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._answer(seen if self.path == "/seen" else {"ok": True})
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        seen.append(self.headers.get("X-Test-Id", "-"))
        self._answer({"served_by": name})

class Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # HAProxy's health checks reset their connections

Server(("127.0.0.1", port), Handler).serve_forever()
"""

TWO = ('[[models]]\nname = "alpha"\naliases = ["gpt-4o-mini"]\npath = "/a.gguf"\n'
       '[[models]]\nname = "beta"\naliases = ["b:latest"]\npath = "/b.gguf"\n')
ONE = '[model]\npath = "/a.gguf"\nname = "alpha"\n'
OF_MODEL = {"alpha": "alpha", "gpt-4o-mini": "alpha", "beta": "beta", "b:latest": "beta"}


class Door:
    """HAProxy on the rendered haproxy.cfg for `text`, and one stub per planned instance."""

    def __init__(self, tmp: Path, text: str) -> None:
        base = free_port_block(5)
        self.config = parse_config(f'{text}[server]\nbase_port = {base + 1}\n[frontend]\nlisten = "127.0.0.1:{base}"\n',
                                   "/etc/numa-infer.toml")
        self.port = base
        plan = plan_for(tmp / "plan", self.config)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stubs: dict[int, str] = {}  # port -> the model it serves
        script = tmp / "stub.py"
        script.write_text(STUB)
        for instance in plan.instances:
            self.procs.append(subprocess.Popen([sys.executable, str(script), instance.name, str(instance.port)]))
            self.stubs[instance.port] = instance.model or "alpha"
        for port in self.stubs:
            wait_for(lambda port=port: _accepts(port), f"stub on {port}")  # type: ignore[misc]
        run = tmp / "run"
        run.mkdir()
        paths = paths_in(run, run / "haproxy.sock")
        write_config(paths, render_haproxy(self.config, plan, paths, served=served_of(self.config),
                                           engine=engine_of(self.config)))
        paths.state.write_text("1\n")
        self.procs.append(subprocess.Popen([HAPROXY, "-db", "-f", str(paths.config)], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL))
        wait_for(lambda: _accepts(self.port), "haproxy")
        time.sleep(3)  # the first health checks put every server UP

    def seen(self) -> dict[int, list[str]]:
        out = {}
        for port in self.stubs:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/seen")
            out[port] = json.loads(conn.getresponse().read())
            conn.close()
        return out

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def body(model: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "lorem ipsum " * 80}], "max_tokens": 1,
                       "model": model}).encode()


def once(port: int, data: bytes, test_id: str = "-") -> tuple[float, dict]:
    """One request on a new connection, as most clients send them; seconds and the answer."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", data, {"Content-Type": "application/json", "X-Test-Id": test_id})
    response = conn.getresponse()
    answer = json.loads(response.read())
    took = time.perf_counter() - start
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {answer}")
    return took, answer


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def latency(one: Door, two: Door, count: int) -> None:
    direct_port = next(iter(one.stubs))
    times: dict[str, list[float]] = {"direct": [], "one model": [], "two models": []}
    for n in range(count):  # interleaved, so that the machine's moods fall on all three alike
        times["direct"].append(once(direct_port, body("alpha"))[0])
        times["one model"].append(once(one.port, body("alpha"))[0])
        times["two models"].append(once(two.port, body("beta" if n % 2 else "gpt-4o-mini"))[0])
    print(f"latency, {count} requests each (ms):  p50     p99")
    for name, values in times.items():
        print(f"  {name:<12}  {pct(values, 0.5) * 1000:7.3f} {pct(values, 0.99) * 1000:7.3f}")
    p50 = {name: pct(values, 0.5) * 1000 for name, values in times.items()}
    print(f"  added by the front door, p50: one model {p50['one model'] - p50['direct']:.3f} ms, "
          f"two models {p50['two models'] - p50['direct']:.3f} ms; routing adds "
          f"{p50['two models'] - p50['one model']:.3f} ms")


def correctness(two: Door, count: int) -> None:
    rng = random.Random(31)
    asked = {f"r{n}": rng.choice(list(OF_MODEL)) for n in range(count)}
    with ThreadPoolExecutor(8) as pool:
        sent = pool.map(lambda item: once(two.port, body(item[1]), item[0])[1], asked.items())
        answers = dict(zip(asked, sent, strict=True))
    wrong = 0
    got = 0
    for port, test_ids in two.seen().items():
        for test_id in test_ids:
            if test_id in asked:
                got += 1
                wrong += OF_MODEL[asked[test_id]] != two.stubs[port]
    answered_wrong = sum(not a["served_by"].startswith(f"infer@{OF_MODEL[asked[t]]}-") for t, a in answers.items())
    print(f"correctness: {count} requests ({', '.join(sorted(OF_MODEL))}, 8 at a time): {got} reached an upstream, "
          f"{wrong} at another model's instance (upstreams' logs), {answered_wrong} answered by another model")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "one").mkdir()
        (Path(tmp) / "two").mkdir()
        one = Door(Path(tmp) / "one", ONE)
        two = Door(Path(tmp) / "two", TWO)
        try:
            latency(one, two, 300 if args.quick else 2000)
            correctness(two, 1000)
        finally:
            one.stop()
            two.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
