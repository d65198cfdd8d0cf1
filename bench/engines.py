#!/usr/bin/env python3
"""Prompt processing, decode and aggregate throughput under concurrency: llama-server
(server.parallel slots) against llama-cpp-python, one instance each, started by numa-infer
on the same CPUs (this host's own topology), on the generated model quantized to Q4_K_M
(what operators run most) and unquantized f16, one after the other in one run.

Per engine and model: prompt tokens/s (a long prompt against a short one, as tune does),
single-client decode tokens/s (streamed, as tune does) and that rate as a share of the
memory read bandwidth measured in the same run by tune's method (numad_infer.tune.bandwidth, one
reader per CPU the instance runs on), counting the bytes a decoded token reads
(numad_infer.model.gguf: the layers, the output projection, one embedding row), for each
--threads count (e.g. 1,all: one thread and numa-infer's default); then, at the first, for
C = 1, 2, 4, 8 concurrent clients, each sending completions of --tokens tokens to the
instance directly, aggregate tokens/s (completion tokens / wall time). Every request
suppresses end-of-sequence (Engine.no_stop_fields), so each gets the tokens it asked for.

    .venv/bin/python bench/engines.py [--size medium] [--models Q4_K_M,f16] [--tokens 64]
        [--parallel 4] [--rounds 2] [--clients 1,2,4,8] [--threads all]
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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving import PROMPT, bandwidth_gbs, host_machine  # noqa: E402
from numad_infer.tune import bandwidth  # noqa: E402
from numad_infer.engines import get as engine_named  # noqa: E402
from numad_infer.model.gguf import decode_bytes, stop_token_ids  # noqa: E402
from numad_infer.tune.client import Client  # noqa: E402
from tests.daemon_harness import DaemonRun, generated_model  # noqa: E402


def completion(port: int, tokens: int, no_stop: dict[str, object]) -> int:
    body = json.dumps({"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, **no_stop}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as resp:
        return json.load(resp)["usage"]["completion_tokens"]


def aggregate(port: int, clients: int, rounds: int, tokens: int, no_stop: dict[str, object]) -> float:
    """`clients` threads, each `rounds` completions back to back: total tokens / wall time."""
    done: list[int] = []
    lock = threading.Lock()

    def client() -> None:
        for _ in range(rounds):
            got = completion(port, tokens, no_stop)
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


@dataclass(frozen=True)
class Measured:
    threads: int
    prompt: float  # tokens/s, median
    decode: float  # tokens/s, single client, median
    aggregate: dict[int, float]  # clients -> tokens/s


def measure(engine: str, model: Path, tmp: Path, args: argparse.Namespace, threads: int | None) -> Measured:
    # Every request gets the tokens it asks for, whatever the model would say.
    no_stop = engine_named(engine).no_stop_fields(stop_token_ids(str(model)))
    where = tmp / f"{engine}-{model.stem}-{threads or 'all'}"
    where.mkdir()
    # threads None: numa-infer's default (the node's physical cores).
    placement = f"threads = {threads}\nthreads_batch = {threads}" if threads else ""
    run = DaemonRun(where, model, placement=placement, machine=host_machine(), interval_s=5.0, engine=engine,
                    context_size=1024, frontend='listen = ""\n')
    if engine == "llama-server":
        run.server_extra = f"parallel = {args.parallel}"
        run.write_config(placement)  # the whole file again: the placement too
    try:
        state = run.all_healthy(1, timeout=600)
        inst = state["instances"][0]
        client = Client("127.0.0.1", inst["port"], None, no_stop)
        completion(inst["port"], 4, no_stop)  # warm up
        # ~200 prompt tokens: the generated models' tokenizer splits "wordN" into ~3 tokens.
        prompt = statistics.median(client.prompt_rate(64) for _ in range(args.samples))
        decode = statistics.median(client.decode_rate(args.tokens) for _ in range(args.samples))
        rates = {c: aggregate(inst["port"], c, args.rounds, args.tokens, no_stop) for c in args.clients}
        return Measured(inst["threads"], prompt, decode, rates)
    finally:
        run.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium")
    parser.add_argument("--models", default="Q4_K_M,f16",
                        help="comma-separated: f16 (the generated model as is) or a quantization (Q4_K_M, Q8_0, Q4_0)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", default="1,2,4,8", help="comma-separated concurrency levels ('' for none)")
    parser.add_argument("--threads", default="all",
                        help="comma-separated thread counts per instance, 'all' for numa-infer's default (e.g. 1,all); "
                             "the concurrency levels run at the first only")
    args = parser.parse_args()
    thread_counts = [None if t == "all" else int(t) for t in args.threads.split(",")]
    args.clients = [int(c) for c in args.clients.split(",") if c]
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-bench-engines-"))
    bw = bandwidth_gbs(os.cpu_count() or 1)
    # What `tune` measures and `status` divides by (numad_infer.tune.bandwidth: one reader per CPU
    # the instance runs on), for each thread count: decode efficiency is against that.
    cpus = sorted(os.sched_getaffinity(0))
    tune_bw = {n: bandwidth.measure(cpus[:n or len(cpus)], 0, samples=3).gbs for n in thread_counts}
    print(f"# host: {os.cpu_count()} CPUs; read bandwidth {bw:.1f} GB/s (numpy, all CPUs), tune's "
          + ", ".join(f"{g:.1f} GB/s with {n or len(cpus)} reader(s)" for n, g in tune_bw.items())
          + f"; {args.tokens} tokens per "
          f"request, {args.rounds} per client; llama-server with {args.parallel} slots; medians of {args.samples}",
          flush=True)
    for name in args.models.split(","):
        model = generated_model(args.size, None if name == "f16" else name)
        read = decode_bytes(str(model))
        print(f"## model {args.size} {name}: {model.stat().st_size / 2**20:.0f} MiB, {read / 2**20:.0f} MiB read per "
              f"decoded token", flush=True)
        results: dict[str, Measured] = {}
        for index, threads in enumerate(thread_counts):
            for engine in ("llama-cpp-python", "llama-server"):
                m = measure(engine, model, tmp, args if index == 0 else argparse.Namespace(**{**vars(args), "clients": []}),
                            threads)
                if index == 0:
                    results[engine] = m
                print(f"{engine:17s} ({m.threads} threads): prompt {m.prompt:7.1f} tok/s  decode {m.decode:6.1f} tok/s "
                      f"= {read * m.decode / 1e9:.1f} GB/s = {read * m.decode / 1e9 / tune_bw[threads]:.0%} of tune's "
                      f"{tune_bw[threads]:.1f} GB/s ({read * m.decode / 1e9 / bw:.0%} of numpy's)"
                      + ("; " + "  ".join(f"C={c}: {r:6.1f}" for c, r in m.aggregate.items()) + " tok/s"
                         if m.aggregate else ""), flush=True)
        py, ls = results["llama-cpp-python"], results["llama-server"]
        print(f"ratio llama-server / llama-cpp-python: prompt {ls.prompt / py.prompt:.2f}x  decode "
              f"{ls.decode / py.decode:.2f}x" + "".join(f"  C={c}: {ls.aggregate[c] / py.aggregate[c]:.2f}x"
                                                       for c in py.aggregate))
        if ls.aggregate:
            best = max(ls.aggregate, key=ls.aggregate.get)
            print(f"llama-server at its best (C={best}): {read * ls.aggregate[best] / 1e9:.1f} GB/s-equivalent of "
                  f"weights = {read * ls.aggregate[best] / 1e9 / bw:.0%} of the bandwidth (one read serves every slot)")


if __name__ == "__main__":
    main()
