#!/usr/bin/env python3
"""The front door (HAProxy) against the instances driven directly, side by side in one run:

1. added latency of a 1-token completion, p50 and p99 (front door vs direct, interleaved),
   and of a stream's first token, with the daemon's own time-to-first-token histogram;
2. aggregate tokens/s with C = 1, 2, 4, 8 concurrent clients, through the front door vs
   the same instances with the clients spread over them by hand (client i -> instance i % 2);
3. affinity: time to first token of a conversation's second turn (a long shared prompt
   prefix) with `affinity = "header"` vs none.

Runs the real daemon (process backend, fake 2-node topology: instance k on CPU k) with
real llama-cpp-python servers on generated models.

    .venv/bin/python bench/frontdoor.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.daemon_harness import DaemonRun, generated_model  # noqa: E402


def post(port: int, body: dict, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)


def first_token_s(port: int, prompt: str, headers: dict[str, str]) -> float:
    """Seconds until the first streamed token arrives (the prompt's prefill dominates it)."""
    body = {"prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    start = time.monotonic()
    with urllib.request.urlopen(req, timeout=600) as resp:
        first = None
        for line in resp:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - start
        return first if first is not None else float("nan")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def start_daemon(tmp: Path, model: Path, frontend: str = 'listen = "127.0.0.1:{port}"\n', context: int = 256) -> DaemonRun:
    tmp.mkdir(parents=True)
    run = DaemonRun(tmp, model, interval_s=1.0, frontend=frontend, context_size=context)
    run.wait(lambda s: (s.get("frontdoor") or {}).get("up") and len(s["instances"]) == 2
             and all(i["state"] == "healthy" and i.get("rotation") == "UP" for i in s["instances"]), 180, "ready")
    return run


def latency(run: DaemonRun, count: int) -> None:
    ports = [i["port"] for i in run.state()["instances"]]
    body = {"prompt": "hi", "max_tokens": 1, "temperature": 0}
    for _ in range(20):  # warm both paths
        post(run.frontend_port, body)
        post(ports[0], body)
    direct, front = [], []
    for k in range(count):
        for target, into in ((ports[k % 2], direct), (run.frontend_port, front)):
            start = time.perf_counter()
            post(target, body)
            into.append((time.perf_counter() - start) * 1000)
    print(f"\n1. 1-token completion, {count} each, interleaved (ms)")
    print(f"   {'path':<12}{'p50':>8}{'p99':>8}")
    for name, values in (("direct", direct), ("front door", front)):
        print(f"   {name:<12}{pct(values, 0.5):>8.2f}{pct(values, 0.99):>8.2f}")
    print(f"   added by the front door: p50 {pct(front, 0.5) - pct(direct, 0.5):+.2f} ms, "
          f"p99 {pct(front, 0.99) - pct(direct, 0.99):+.2f} ms (goal: <= 1 ms p50)")


def streamed_first_token(run: DaemonRun, count: int) -> None:
    """A stream's first token, front door vs direct, and what the daemon's histogram
    (from HAProxy's timing of each request) says for the front door's."""
    ports = [i["port"] for i in run.state()["instances"]]
    direct, front = [], []
    for k in range(count):
        for target, into in ((ports[k % 2], direct), (run.frontend_port, front)):
            into.append(first_token_s(target, "hi", {}) * 1000)
    seen = [i.get("time_to_first_token") or {} for i in run.state()["instances"]]
    total, n = sum(h.get("sum", 0.0) for h in seen), sum(h.get("count", 0) for h in seen)
    print(f"\n1b. a stream's first token, {count} each, interleaved (ms)")
    print(f"   {'path':<12}{'p50':>8}{'p99':>8}")
    for name, values in (("direct", direct), ("front door", front)):
        print(f"   {name:<12}{pct(values, 0.5):>8.2f}{pct(values, 0.99):>8.2f}")
    print(f"   added by the front door: p50 {pct(front, 0.5) - pct(direct, 0.5):+.2f} ms; the daemon's "
          f"numa_infer_time_to_first_token_seconds mean over all front door requests: "
          f"{1000 * total / max(n, 1):.2f} ms ({n} requests)")


def throughput(run: DaemonRun, clients_list: list[int], per_client: int, tokens: int, rounds: int) -> None:
    ports = [i["port"] for i in run.state()["instances"]]
    body = {"prompt": "The quick brown fox", "max_tokens": tokens, "temperature": 0}

    def drive(targets: list[int]) -> float:
        done = [0]
        lock = threading.Lock()

        def client(port: int) -> None:
            for _ in range(per_client):
                got = post(port, body)["usage"]["completion_tokens"]
                with lock:
                    done[0] += got

        threads = [threading.Thread(target=client, args=(p,)) for p in targets]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return done[0] / (time.monotonic() - start)

    print(f"\n2. aggregate tokens/s, {per_client} requests x {tokens} tokens per client, median of {rounds} rounds "
          "(direct and front door alternate within each round)")
    print(f"   {'clients':>7}{'direct':>10}{'front door':>12}{'ratio':>8}{'ratio range':>16}")
    for c in clients_list:
        pairs = []
        for _ in range(rounds):
            direct = drive([ports[i % 2] for i in range(c)])
            front = drive([run.frontend_port] * c)
            pairs.append((direct, front))
        ratios = sorted(f / d for d, f in pairs)
        direct = statistics.median(d for d, _ in pairs)
        front = statistics.median(f for _, f in pairs)
        print(f"   {c:>7}{direct:>10.1f}{front:>12.1f}{statistics.median(ratios):>8.2f}"
              f"{ratios[0]:>9.2f}-{ratios[-1]:.2f}")
    print("   (goal: ratio >= 0.95; with C = 1 both paths use one instance at a time; on this 2-CPU host HAProxy,"
          " the clients and both instances share the same two CPUs)")


def affinity(tmp: Path, model: Path, rounds: int) -> None:
    # A long shared prefix: what a chat's second turn repeats. llama-cpp-python keeps the
    # last prompt's KV cache, so the same instance answers the second turn without
    # re-reading the prefix; another instance must prefill it again.
    prefix_a = " ".join(f"word{i % 97}" for i in range(120))  # ~580 tokens with the small model's vocabulary
    prefix_b = " ".join(f"term{i % 89}" for i in range(120))
    print(f"\n3. time to first token (median, s) of {rounds} x 2 conversations of 2 turns, ~580-token shared "
          "prefix; turns A1 B1 B2 A2")
    print(f"   {'affinity':<10}{'turn 1':>10}{'turn 2':>10}")
    for mode in ("none", "header"):
        run = start_daemon(tmp / f"aff-{mode}", model,
                           frontend=f'listen = "127.0.0.1:{{port}}"\naffinity = "{mode}"\n', context=1024)
        try:
            firsts, seconds = [], []
            for r in range(rounds):
                # Two conversations interleaved: without affinity leastconn sends each turn
                # wherever, so a turn often lands on the instance holding the other one.
                convs = [(f"conv-{r}-a", prefix_a + f" topic {r} alpha"), (f"conv-{r}-b", prefix_b + f" topic {r} beta")]
                for sid, text in convs:
                    firsts.append(first_token_s(run.frontend_port, text + " question one", {"X-Session-Id": sid}))
                # Second turns in the other order (B then A): the order in which round
                # robin over idle instances sends each to the instance the other used.
                for sid, text in reversed(convs):
                    seconds.append(first_token_s(run.frontend_port, text + " question one answer question two",
                                                 {"X-Session-Id": sid}))
            print(f"   {mode:<10}{statistics.median(firsts):>10.3f}{statistics.median(seconds):>10.3f}")
        finally:
            run.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-bench-frontdoor-"))
    models = {size: generated_model(size) for size in ("tiny", "small")}  # readable by the servers' user
    print("machine: 2 instances (fake 2-node topology: instance k pinned to CPU k), loopback; "
          f"HAProxy {subprocess.run(['haproxy', '-v'], capture_output=True, text=True).stdout.split()[2]}")
    run = start_daemon(tmp / "tiny", models["tiny"])
    try:
        latency(run, 100 if args.quick else 500)
        streamed_first_token(run, 40 if args.quick else 200)
    finally:
        run.stop()
    run = start_daemon(tmp / "small", models["small"])
    try:
        throughput(run, [1, 2, 4, 8], 2 if args.quick else 6, 32, 1 if args.quick else 5)
    finally:
        run.stop()
    affinity(tmp, models["small"], 2 if args.quick else 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
