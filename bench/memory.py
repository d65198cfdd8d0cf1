#!/usr/bin/env python3
"""The memory estimate against the real thing: per instance, what the plan counts
(numad_infer/model/memory.py: the weights from the GGUF tensor table, the KV cache from the
header's dimensions and the engine's context, the engine's measured overhead) against the
resident memory of a real server started with numa-infer's own command line
(Engine.argv), on the generated models quantized as operators run them.

For each model: the server is started, /health (the engine's liveness route) answers 200,
then its RSS (psutil) and anonymous RSS (RssAnon in /proc/PID/status: what is the
process's own, not the program's and libraries' pages from the page cache) are read; then
one completion whose prompt nearly fills a slot (its compute buffers touched, as under
load) and both are read again. Ratio = measured / estimate: below 1 the estimate counts
more than the process holds (the per-node check errs on the safe side).

    .venv/bin/python bench/memory.py [--sizes small,medium] [--quants Q4_0,Q8_0,Q4_K_M]
        [--context 512] [--parallel 2] [--engines llama-server]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numad_infer.config.load import parse_config  # noqa: E402
from numad_infer.engines import get as engine_named  # noqa: E402
from numad_infer.model.gguf import read_header  # noqa: E402
from numad_infer.model.memory import MemoryEstimate, estimate  # noqa: E402
from numad_infer.plan.model import Instance, Policy  # noqa: E402
from tests.daemon_harness import free_port_block, generated_model, llama_server_binary  # noqa: E402

MiB = 1 << 20


@dataclass(frozen=True)
class Resident:
    rss: int
    anon: int


def resident(pid: int) -> Resident:
    anon = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
    return Resident(psutil.Process(pid).memory_info().rss, anon)


def config_for(engine: str, model: Path, context: int, parallel: int):
    program = (f'llama_server = "{llama_server_binary()}"\nparallel = {parallel}\n' if engine == "llama-server"
               else f'python = "{sys.executable}"\n')
    return parse_config(f'[model]\npath = "{model}"\ncontext_size = {context}\n[server]\nengine = "{engine}"\n'
                        f'{program}[frontend]\nlisten = ""\n', "bench")


def wait_ready(proc: subprocess.Popen[bytes], port: int, path: str, log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"no answer on {path} within 600 s; see {log}")


def fill_a_slot(port: int, context: int) -> None:
    """One completion whose prompt takes most of a slot's context, so that the batch's compute
    buffers are all used: the generated models' tokenizers take 3-5 tokens a word, so the
    prompt shrinks until the server takes it."""
    count = max(8, (context - 64) // 3)
    while True:
        words = " ".join(f"word{i % 97}" for i in range(count))
        body = json.dumps({"prompt": words, "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                resp.read()
                return
        except urllib.error.HTTPError as exc:  # longer than a slot's context
            if exc.code != 400 or count <= 8:
                raise
            count = count * 4 // 5


def estimate_of(engine_name: str, model: Path, context: int, parallel: int) -> MemoryEstimate:
    """The plan's estimate for one instance of `model`, as validation computes it."""
    engine = engine_named(engine_name)
    header = read_header(str(model))
    context_of = engine.context(config_for(engine_name, model, context, parallel))
    return estimate(header.weight_bytes(), header.dims, context_of, engine.overhead)


def measure(engine_name: str, model: Path, context: int, parallel: int,
            log_dir: Path) -> tuple[MemoryEstimate, Resident, Resident]:
    engine = engine_named(engine_name)
    config = config_for(engine_name, model, context, parallel)
    guess = estimate_of(engine_name, model, context, parallel)
    threads = min(2, os.cpu_count() or 1)
    instance = Instance("bench@0", 0, tuple(range(threads)), tuple((c,) for c in range(threads)), (0,), Policy.BIND,
                        threads, free_port_block(1), threads)
    log = log_dir / f"{engine_name}-{model.stem}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(engine.argv(config, instance), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, instance.port, engine.liveness_path, log)
        time.sleep(1.0)  # the last allocations after the route answers
        loaded = resident(proc.pid)
        fill_a_slot(instance.port, context)
        used = resident(proc.pid)
    finally:
        stop(proc)
    return guess, loaded, used


def stop(proc: subprocess.Popen[bytes], grace_s: float = 60) -> None:
    """SIGTERM, then SIGKILL after `grace_s`: a server freeing GBs may take a while."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--quants", default="Q4_0,Q8_0,Q4_K_M")
    parser.add_argument("--context", type=int, default=512, help="model.context_size (per slot)")
    parser.add_argument("--parallel", type=int, default=2, help="server.parallel (llama-server's slots)")
    parser.add_argument("--engines", default="llama-server")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="numa-infer-bench-memory-"))
    print(f"# host: {os.cpu_count()} CPUs; context {args.context} per slot, llama-server with {args.parallel} slots; "
          f"server logs in {log_dir}; MiB; ratio = measured / estimate")
    print(f"{'model':<14} {'engine':<16} {'weights':>8} {'KV':>6} {'overhead':>8} {'estimate':>8} | "
          f"{'RSS':>6} {'ratio':>5} {'anon':>6} | {'after a prompt: RSS':>19} {'ratio':>5} {'anon':>6}")
    for size in args.sizes.split(","):
        for quant in args.quants.split(","):
            model = generated_model(size, quant)
            for engine in args.engines.split(","):
                guess, loaded, used = measure(engine, model, args.context, args.parallel, log_dir)
                print(f"{size + ' ' + quant:<14} {engine:<16} {guess.weights / MiB:8.1f} {guess.kv_cache / MiB:6.1f} "
                      f"{guess.overhead / MiB:8.1f} {guess.total / MiB:8.1f} | {loaded.rss / MiB:6.1f} "
                      f"{loaded.rss / guess.total:5.2f} {loaded.anon / MiB:6.1f} | {used.rss / MiB:19.1f} "
                      f"{used.rss / guess.total:5.2f} {used.anon / MiB:6.1f}", flush=True)


if __name__ == "__main__":
    main()
