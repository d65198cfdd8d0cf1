#!/usr/bin/env python3
"""Isolation between models (issue 31): two models loaded together, the big one under full
load; the small one's latency and decode tokens/s against the small one alone on the same
cores. Goal: >= 0.9x.

The real daemon (process backend), real HAProxy, real llama-server instances, on the fake
2-node topology of the host tests (tests/daemon_harness.py: node 0 = CPU 0, node 1 = CPU 1),
with two [[models]]: `big` (the generated medium model, ~430 MB f16, --big-slots slots) on
node 0 and `small` (the generated small model, ~40 MB f32, one slot) on node 1. Everything
is asked through the front door, by `model`.

Rounds alternate the two conditions, in the order A B, B A, A B...:
  (a) big idle: --requests completions of the small model, one at a time;
  (b) big fully loaded: as many clients as big has slots ask big without pause (from a
      second before the first of small's requests until after the last), while the small
      model is asked as in (a).
Per request: the latency seen by the client, and decode tokens/s as the server timed it
(`timings.predicted_per_second`; end-of-sequence suppressed so every answer has --tokens).

    .venv/bin/python bench/isolation.py [--rounds 6] [--requests 10] [--tokens 32] [--big-slots 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.daemon_harness import DaemonRun, generated_model  # noqa: E402


def models_toml(big: Path, small: Path, big_slots: int) -> str:
    return (f'[[models]]\nname = "big"\npath = "{big}"\ncontext_size = 512\nnodes = [0]\nparallel = {big_slots}\n'
            f'[[models]]\nname = "small"\npath = "{small}"\ncontext_size = 512\nnodes = [1]\nparallel = 1\n')


def ask(port: int, model: str, tokens: int) -> tuple[float, float | None, int]:
    """One completion through the front door: seconds, the server's decode tokens/s, tokens."""
    body = {"model": model, "prompt": "numa node", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.load(response)
    took = time.perf_counter() - start
    if answer.get("model") != model:
        raise RuntimeError(f"asked {model}, answered by {answer.get('model')}")
    tps = (answer.get("timings") or {}).get("predicted_per_second")
    return took, tps, int(answer["usage"]["completion_tokens"])


class Load:
    """`clients` threads asking `model` without pause, until stopped."""

    def __init__(self, port: int, model: str, clients: int, tokens: int) -> None:
        self.stop = threading.Event()
        self.tokens = 0
        self.errors = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(port, model, tokens), daemon=True)
                        for _ in range(clients)]
        self.started = time.perf_counter()
        for t in self.threads:
            t.start()

    def _loop(self, port: int, model: str, tokens: int) -> None:
        while not self.stop.is_set():
            try:
                _, _, n = ask(port, model, tokens)
            except Exception:  # counted; the load goes on
                with self.lock:
                    self.errors += 1
                time.sleep(0.2)
                continue
            with self.lock:
                self.tokens += n

    def end(self) -> float:
        """Stop, wait for the requests in flight; the load's tokens/s."""
        self.stop.set()
        for t in self.threads:
            t.join(300)
        return self.tokens / (time.perf_counter() - self.started)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each condition, alternating")
    parser.add_argument("--requests", type=int, default=10, help="small's requests per round")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    parser.add_argument("--big-slots", type=int, default=2, help="big's slots (and so its clients under load)")
    args = parser.parse_args()
    big, small = generated_model("medium"), generated_model("small")
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-isolation-"))
    run = DaemonRun(tmp, big, engine="llama-server", models=models_toml(big, small, args.big_slots), interval_s=1.0)
    results: dict[str, dict[str, list[float]]] = {c: {"latency": [], "tps": []} for c in ("alone", "loaded")}
    big_tps: list[float] = []
    load_errors = 0
    try:
        state = run.wait(lambda s: len(s["instances"]) == 2 and (s.get("frontdoor") or {}).get("up")
                         and all(i["state"] == "healthy" and i.get("rotation") == "UP" for i in s["instances"]),
                         300, "both models healthy and in rotation")
        cpus = {i["name"]: i["cpus"] for i in state["instances"]}
        port = run.frontend_port
        print(f"# host {os.cpu_count()} CPUs; instances {cpus}; big: medium f16 ({big.stat().st_size >> 20} MiB), "
              f"{args.big_slots} slots; small: small f32 ({small.stat().st_size >> 20} MiB), 1 slot; "
              f"{args.rounds} rounds x {args.requests} requests of {args.tokens} tokens per condition", flush=True)
        for _ in range(2):  # warm both (first requests page the weights in)
            ask(port, "big", args.tokens)
            ask(port, "small", args.tokens)
        for r in range(args.rounds):
            for condition in (("alone", "loaded") if r % 2 == 0 else ("loaded", "alone")):
                load = Load(port, "big", args.big_slots, args.tokens) if condition == "loaded" else None
                if load is not None:
                    time.sleep(1.0)  # every slot of big busy before small is asked
                for _ in range(args.requests):
                    took, tps, _ = ask(port, "small", args.tokens)
                    results[condition]["latency"].append(took)
                    if tps is not None:
                        results[condition]["tps"].append(tps)
                if load is not None:
                    big_tps.append(load.end())
                    load_errors += load.errors
            print(f"round {r + 1}/{args.rounds}: small p50 alone {pct(results['alone']['latency'], .5) * 1000:.1f} ms,"
                  f" loaded {pct(results['loaded']['latency'], .5) * 1000:.1f} ms", flush=True)
    finally:
        run.stop()
    alone, loaded = results["alone"], results["loaded"]
    print(f"\nsmall model, {len(alone['latency'])} requests per condition, {args.tokens} tokens each")
    print(f"{'':28}{'alone':>10}{'big loaded':>12}{'ratio':>8}")
    for name, q in (("latency p50 (ms)", .5), ("latency p99 (ms)", .99)):
        a, b = pct(alone["latency"], q) * 1000, pct(loaded["latency"], q) * 1000
        print(f"{name:<28}{a:>10.1f}{b:>12.1f}{a / b:>8.2f}  (alone / loaded: >= 0.9 is the goal)")
    if alone["tps"] and loaded["tps"]:
        a, b = statistics.median(alone["tps"]), statistics.median(loaded["tps"])
        print(f"{'decode tokens/s, median':<28}{a:>10.1f}{b:>12.1f}{b / a:>8.2f}  (loaded / alone: >= 0.9 is the goal)")
    else:
        print("decode tokens/s: the server reported no timings")
    print(f"big under load: {statistics.median(big_tps):.1f} tokens/s (median of rounds), "
          f"{load_errors} failed requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
