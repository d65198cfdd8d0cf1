#!/usr/bin/env python3
"""Aggregate decode throughput under concurrency: llama-server (server.parallel slots)
against llama-cpp-python, one instance each, started by numa-infer on the same CPUs
(this host's own topology) with the same generated model, one after the other in one run.

For C = 1, 2, 4, 8 concurrent clients, each sending completions of --tokens tokens to the
instance directly: aggregate tokens/s (completion tokens / wall time). Also each engine's
single-client decode rate (prompt time subtracted) and that rate as a share of the
memory read bandwidth measured in the same run (decode reads every weight once per step).

    .venv/bin/python bench/engines.py [--size medium] [--tokens 64] [--parallel 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving import PROMPT, bandwidth_gbs, decode_rate, host_machine  # noqa: E402
from tests.daemon_harness import DaemonRun, generated_model  # noqa: E402


def completion(port: int, tokens: int) -> int:
    body = json.dumps({"prompt": PROMPT, "max_tokens": tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as resp:
        return json.load(resp)["usage"]["completion_tokens"]


def aggregate(port: int, clients: int, rounds: int, tokens: int) -> float:
    """`clients` threads, each `rounds` completions back to back: total tokens / wall time."""
    done: list[int] = []
    lock = threading.Lock()

    def client() -> None:
        for _ in range(rounds):
            got = completion(port, tokens)
            with lock:
                done.append(got)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(done) == clients * rounds, f"{clients * rounds - len(done)} request(s) failed"
    return sum(done) / (time.monotonic() - started)


def measure(engine: str, model: Path, tmp: Path, args: argparse.Namespace) -> tuple[dict[int, float], float, int]:
    (tmp / engine).mkdir()
    run = DaemonRun(tmp / engine, model, machine=host_machine(), interval_s=5.0, engine=engine,
                    context_size=512, frontend='listen = ""\n')
    if engine == "llama-server":
        run.server_extra = f"parallel = {args.parallel}"
        run.write_config()
    try:
        state = run.all_healthy(1, timeout=600)
        inst = state["instances"][0]
        completion(inst["port"], 4)  # warm up
        rates = {c: aggregate(inst["port"], c, args.rounds, args.tokens) for c in (1, 2, 4, 8)}
        single = decode_rate(inst["port"], args.tokens, 3)
        return rates, single, inst["threads"]
    finally:
        run.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-bench-engines-"))
    model = generated_model(args.size)
    weights = model.stat().st_size
    print(f"# host: {os.cpu_count()} CPUs; model {args.size}: {weights / 2**20:.0f} MiB; {args.tokens} tokens per "
          f"request, {args.rounds} per client; llama-server with {args.parallel} slots", flush=True)
    results = {}
    for engine in ("llama-cpp-python", "llama-server"):
        results[engine] = measure(engine, model, tmp, args)
        rates, single, threads = results[engine]
        print(f"{engine:17s} ({threads} threads): " + "  ".join(f"C={c}: {r:6.1f}" for c, r in rates.items())
              + f" tokens/s; single-client decode {single:.1f} tokens/s", flush=True)
    (py_rates, py_single, _), (ls_rates, ls_single, _) = results["llama-cpp-python"], results["llama-server"]
    print("ratio llama-server / llama-cpp-python: " + "  ".join(f"C={c}: {ls_rates[c] / py_rates[c]:.2f}x" for c in py_rates)
          + f"; single-client decode {ls_single / py_single:.2f}x")
    bw = bandwidth_gbs(os.cpu_count() or 1)
    for engine, single in (("llama-cpp-python", py_single), ("llama-server", ls_single)):
        print(f"{engine} single-client decode reads ~{weights * single / 1e9:.1f} GB/s of weights = "
              f"{weights * single / 1e9 / bw:.0%} of the measured {bw:.1f} GB/s read bandwidth")
    best = max(ls_rates.values())
    print(f"llama-server at its best (C={max(ls_rates, key=ls_rates.get)}): {weights * best / 1e9:.1f} GB/s-equivalent "
          f"of weights = {weights * best / 1e9 / bw:.0%} of the bandwidth (one read serves every slot's token)")


if __name__ == "__main__":
    main()
