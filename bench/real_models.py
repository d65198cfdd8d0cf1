#!/usr/bin/env python3
"""Models the size operators run: the 1B- and 8B-class shapes of tools/make_model.py
(`--size 1b`, `--size 8b`, quantized to Q4_K_M), started as numa-infer starts an instance
(the engine's own command line, Engine.argv: `--load-mode none`, the weights read into the
instance's memory, not mapped), one instance on this host's CPUs. Per model:

- load: from the exec to the first 200 on the engine's liveness route, twice: the first
  with the file just written or read (the page cache holds it), the second the same;
  numa-infer reads the whole file at every start, so the load is the file's read plus the
  copy into the instance's own memory;
- memory: the plan's estimate (model/memory.py: weights from the tensor table, the KV
  cache for the context, the engine's overhead) against the RSS and anonymous RSS after
  the load and after a prompt that fills the slot (its compute buffers touched);
- rates (after the memory: the server's prompt cache keeps a replaced prompt's state, which
  the estimate leaves out as growth with use): one prompt of --prompt-tokens words read
  (the server's own prompt_per_second) and --tokens generated (predicted_per_second), as
  the stand-in's calibration reads them.

    NUMA_INFER_MODEL_CACHE=/var/tmp/numa-infer-models .venv/bin/python bench/real_models.py \\
        [--sizes 1b,8b] [--context 4096] [--prompt-tokens 512] [--tokens 32]

Never in CI: making the 8B file takes minutes and 16 GB of scratch disk (the cache keeps
it, named by tools/make_model.py's hash).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.memory import MiB, Resident, config_for, estimate_of, fill_a_slot, resident, stop, wait_ready  # noqa: E402
from numad_infer.engines import get as engine_named  # noqa: E402
from numad_infer.plan.model import Instance, Policy  # noqa: E402
from tests.daemon_harness import free_port_block, generated_model  # noqa: E402


def rates(port: int, prompt_words: int, tokens: int) -> tuple[int, float, int, float]:
    """One completion: (prompt tokens, their tokens/s, generated tokens, their tokens/s),
    as the server's own `timings` say."""
    words = " ".join(f"word{i % 97}" for i in range(prompt_words))
    body = json.dumps({"prompt": words, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                       "cache_prompt": False}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as resp:
        timings = json.loads(resp.read())["timings"]
    return (int(timings["prompt_n"]), float(timings["prompt_per_second"]), int(timings["predicted_n"]),
            float(timings["predicted_per_second"]))


def one_start(model: Path, context: int, log: Path, measure: bool, prompt_words: int, tokens: int) -> dict:
    engine = engine_named("llama-server")
    config = config_for("llama-server", model, context, 1)
    threads = os.cpu_count() or 1
    instance = Instance("bench@0", 0, tuple(range(threads)), tuple((c,) for c in range(threads)), (0,),
                        Policy.BIND, threads, free_port_block(1), threads)
    started = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(engine.argv(config, instance), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, instance.port, engine.liveness_path, log)
        result: dict = {"load_s": time.monotonic() - started}
        if measure:
            time.sleep(1.0)  # the last allocations after the route answers
            result["loaded"] = resident(proc.pid)
            fill_a_slot(instance.port, context)
            result["used"] = resident(proc.pid)
            # After the memory: the rate prompt replaces the fill's in the slot, and the server's
            # prompt cache keeps the fill's state (what the estimate leaves out: it grows with use).
            result["rates"] = rates(instance.port, prompt_words, tokens)
        return result
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1b,8b")
    parser.add_argument("--context", type=int, default=4096, help="model.context_size (one slot)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="words in the rate prompt (~1 token each)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated for the decode rate")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="numa-infer-bench-real-"))
    print(f"# host: {os.cpu_count()} CPUs, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB;"
          f" context {args.context}, one slot; llama-server as numa-infer starts it; logs in {log_dir}")
    print(f"{'model':<10} {'file MiB':>8} {'load s':>13} | {'estimate':>8} {'RSS':>7} {'ratio':>5} {'anon':>7} | "
          f"{'filled RSS':>10} {'ratio':>5} | {'prefill tok/s':>13} {'decode tok/s':>12}")
    for size in args.sizes.split(","):
        made = time.monotonic()
        model = generated_model(size, "Q4_K_M")
        made_s = time.monotonic() - made
        guess = estimate_of("llama-server", model, args.context, 1)
        log = log_dir / f"{size}.log"
        first = one_start(model, args.context, log, True, args.prompt_tokens, args.tokens)
        second = one_start(model, args.context, log, False, args.prompt_tokens, args.tokens)
        loaded: Resident = first["loaded"]
        used: Resident = first["used"]
        prompt_n, prefill, predicted_n, decode = first["rates"]
        loads = f"{first['load_s']:6.1f} {second['load_s']:6.1f}"
        print(f"{size + ' Q4_K_M':<10} {model.stat().st_size / MiB:8.0f} {loads} | "
              f"{guess.total / MiB:8.0f} {loaded.rss / MiB:7.0f} {loaded.rss / guess.total:5.2f} "
              f"{loaded.anon / MiB:7.0f} | {used.rss / MiB:10.0f} {used.rss / guess.total:5.2f} | "
              f"{prefill:13.1f} {decode:12.2f}   (prompt {prompt_n}, generated {predicted_n}; "
              f"file made or found in {made_s:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
