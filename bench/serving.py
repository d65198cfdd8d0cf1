#!/usr/bin/env python3
"""Decode speed: an instance started by numa-infer vs `python -m llama_cpp.server` with its
defaults, one after the other on this machine, on a generated model large enough that
decoding is memory-bound; and the decode rate against a memory bandwidth measured in the
same run.

    .venv/bin/python bench/serving.py [--size medium] [--tokens 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numad_infer.engines import get as engine_named  # noqa: E402
from numad_infer.model.gguf import decode_bytes, stop_token_ids  # noqa: E402
from numad_infer.topology.sysfs import read_topology  # noqa: E402
from tests import fakesys  # noqa: E402
from tests.daemon_harness import DaemonRun, generated_model  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog because"


def wait_ready(port: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"server on {port} never answered")


def decode_rate(port: int, tokens: int, runs: int, no_stop: dict[str, object] | None = None) -> float:
    """Tokens/s of generation: time of `tokens` tokens minus time of 1 token (prompt + first).
    `no_stop`: Engine.no_stop_fields, so every request gets the tokens it asks for."""
    def timed(n: int) -> float:
        body = json.dumps({"prompt": PROMPT, "max_tokens": n, "temperature": 0, **(no_stop or {})}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        start = time.monotonic()
        with urllib.request.urlopen(req, timeout=600) as resp:
            got = json.load(resp)["usage"]["completion_tokens"]
        assert got == n, f"asked {n} tokens, got {got}"
        return time.monotonic() - start

    timed(4)  # warm up
    rates = []
    for _ in range(runs):
        one, many = timed(1), timed(tokens)
        rates.append((tokens - 1) / (many - one))
    return statistics.median(rates)


def bandwidth_gbs(threads: int) -> float:
    """Read bandwidth with `threads` numpy readers over 1 GiB (numpy releases the GIL in sum)."""
    from concurrent.futures import ThreadPoolExecutor
    data = np.ones((threads, (1 << 30) // 8 // threads))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda row: row.sum(), data))
        best = 0.0
        for _ in range(5):
            start = time.perf_counter()
            list(pool.map(lambda row: row.sum(), data))
            best = max(best, data.nbytes / (time.perf_counter() - start))
    return best / 1e9


def host_machine() -> fakesys.FakeMachine:
    """This host's own topology, as a sysfs tree the daemon can be pointed at."""
    topo = read_topology("/")
    return fakesys.FakeMachine(
        nodes={n.id: fakesys.FakeNode(n.cpus, n.memory_total_bytes // 1024, tuple(n.distances.values())) for n in topo.nodes},
        siblings=tuple(c for n in topo.nodes for c in n.cores), l3=tuple(n.cpus for n in topo.nodes if n.cpus), offline=())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="medium")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-serving-"))
    model = generated_model(args.size)  # readable by the servers' user (numa-infer, or nobody without it, when run as root)
    # Bytes a decoded token reads (layers, output projection, one embedding row), not the file.
    weights = decode_bytes(str(model))
    no_stop = engine_named("llama-cpp-python").no_stop_fields(stop_token_ids(str(model)))
    topo = read_topology("/")
    print(f"# host: {os.cpu_count()} CPUs, {len(topo.nodes)} NUMA node(s); model {args.size}: {model.stat().st_size / 2**20:.0f} MiB"
          f" ({weights / 2**20:.0f} MiB read per token);"
          f" {args.tokens} tokens, median of {args.runs}")

    # numa-infer: the plan for this machine (one instance per node, threads = physical cores).
    (tmp / "ni").mkdir()
    run = DaemonRun(tmp / "ni", model, machine=host_machine(), interval_s=5.0)
    try:
        state = run.all_healthy(len([n for n in topo.nodes if n.cpus]), timeout=600)
        first = state["instances"][0]
        ni_rate = decode_rate(first["port"], args.tokens, args.runs, no_stop)
        ni_threads = first["threads"]
    finally:
        run.stop()

    # llama-cpp-python's server with its defaults (mmap on, n_threads = cpu_count // 2, no pinning).
    port = run.base_port + 100
    server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(port)
        default_rate = decode_rate(port, args.tokens, args.runs, no_stop)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    default_threads = max(os.cpu_count() // 2, 1)

    bw_one, bw_all = bandwidth_gbs(1), bandwidth_gbs(os.cpu_count() or 1)
    print(f"numa-infer instance ({ni_threads} threads, pinned, mmap off):   {ni_rate:7.2f} tokens/s")
    print(f"llama_cpp.server defaults ({default_threads} threads, mmap on):      {default_rate:7.2f} tokens/s")
    print(f"ratio numa-infer / defaults: {ni_rate / default_rate:.2f}x")
    print(f"memory read bandwidth measured: {bw_one:.1f} GB/s (1 thread), {bw_all:.1f} GB/s ({os.cpu_count()} threads)")
    need = weights * ni_rate / 1e9
    print(f"numa-infer decode reads ~{need:.1f} GB/s of weights = {need / bw_all:.0%} of the {os.cpu_count()}-thread ceiling")
    print(f"defaults decode reads ~{weights * default_rate / 1e9:.1f} GB/s = {weights * default_rate / 1e9 / bw_all:.0%} of it")


if __name__ == "__main__":
    main()
