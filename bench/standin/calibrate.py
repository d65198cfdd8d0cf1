#!/usr/bin/env python3
"""The stand-in's rates, measured on the real llama-server on this host: one server on the
generated model bench/prefix.py uses (medium Q4_K_M), `--instances` of them (2) at once,
each with `--threads` threads (1) pinned to a CPU of its own as numa-infer pins the
instances of the fake 2-node topology, every measurement made on all at once (they share
the host as the workload's instances do), then

- the tokenizer: text bytes per token of a bench/prefix.py conversation (its template
  applied, /tokenize), for the stand-in's tokenizer;
- prefill: prompt_ms of prompts of a few lengths read into an empty slot (random token
  ids, nothing cached), the median of `--samples`;
- reading after a cached prefix: 64 tokens after 512 and 1,024 cached, what that takes
  beyond reading 64 into an empty slot, per cached token (the median);
- decode: each slot's tokens/s with 1..np slots generating at once (prompts of
  `--decode-context` tokens: attention over the context is part of a step; each prompt
  read beforehand, so no prompt shares a batch with the decoding), from the server's own
  timings (predicted_n - 1 steps in predicted_ms);
- a cached token's bytes: a slot saved (/slots?action=save: n_written / n_saved), the unit
  of --cache-ram's bound;
- the load time: start to /health 200.

    .venv/bin/python -m bench.standin.calibrate [--out bench/standin/calibration.json] [-np 4]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.prefix import words  # noqa: E402
from tests.daemon_harness import free_port, generated_model, llama_server_binary  # noqa: E402

T = TypeVar("T")


def call(port: int, method: str, path: str, body: object | None = None, timeout: float = 600) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data


def completion(port: int, tokens: list[int], n_predict: int) -> dict[str, float]:
    status, doc = call(port, "POST", "/completion", {"prompt": tokens, "n_predict": n_predict, "ignore_eos": True,
                                                     "temperature": 0, "cache_prompt": True})
    if status != 200:
        raise RuntimeError(f"/completion: {status} {doc}")
    timings: dict[str, float] = doc["timings"]
    return timings


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 31000) for _ in range(n)]


def bytes_per_token(port: int) -> float:
    rng = random.Random(7)
    messages = [{"role": "system", "content": f"You are a careful assistant. {words(rng, 180)}"},
                {"role": "user", "content": f"conversation 0 turn 0: {words(rng, 30)}"}]
    _, templated = call(port, "POST", "/apply-template", {"messages": messages})
    text = templated["prompt"]
    _, tokens = call(port, "POST", "/tokenize", {"content": text})
    return len(text.encode()) / len(tokens["tokens"])


def on_all(ports: list[int], work: Callable[[int], list[T]]) -> list[T]:
    """`work` on every server at once (a thread each): all their results."""
    results: list[T] = []
    lock = threading.Lock()

    def one(port: int) -> None:
        got = work(port)
        with lock:
            results.extend(got)
    threads = [threading.Thread(target=one, args=(p,)) for p in ports]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@contextlib.contextmanager
def servers(binary: Path, model: Path, instances: int, threads: int, parallel: int, context: int,
            saves: Path) -> Iterator[list[int]]:
    """`instances` llama-servers, each pinned to a CPU of its own (as numa-infer pins the
    fake 2-node topology's instances), healthy: their ports. Stopped on the way out."""
    cpus = sorted(os.sched_getaffinity(0))
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    with open(saves / "server.log", "w") as log:
        try:
            for k in range(instances):
                port, cpu = free_port(), cpus[k % len(cpus)]
                procs.append(subprocess.Popen(
                    [str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                     "--ctx-size", str(context * parallel), "--parallel", str(parallel),
                     "--threads", str(threads), "--threads-batch", str(threads), "--load-mode", "none",
                     "--metrics", "--no-webui", "--cache-ram", "0", "--slot-save-path", str(saves)],
                    stdout=log, stderr=subprocess.STDOUT, preexec_fn=functools.partial(os.sched_setaffinity, 0, {cpu})))
                ports.append(port)
            for port, proc in zip(ports, procs):
                while True:
                    try:
                        if call(port, "GET", "/health", timeout=5)[0] == 200:
                            break
                    except OSError:
                        pass
                    if proc.poll() is not None:
                        raise SystemExit(f"llama-server exited: {(saves / 'server.log').read_text()[-2000:]}")
                    time.sleep(0.05)
            yield ports
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)


def prefill_now(size: str = "medium", quant: str = "Q4_K_M", instances: int = 2, length: int = 1024,
                samples: int = 2) -> float:
    """The host's speed now: seconds to read `length` random tokens into an empty slot, on
    `instances` servers at once (calibrate's setting), the median of `samples` each. A
    shared host's speed moves by tens of percent within minutes (other machines on it):
    bench/standin/validate.py scales the stand-in's rates by this before each pair of runs."""
    rng = random.Random(length)
    with tempfile.TemporaryDirectory(prefix="standin-probe-") as saves, \
            servers(llama_server_binary(), generated_model(size, quant), instances, 1, 1, length + 64,
                    Path(saves)) as ports:
        on_all(ports, lambda port: [completion(port, random_tokens(rng, 32), 1)["prompt_ms"]])  # warm
        times = on_all(ports, lambda port: [completion(port, random_tokens(rng, length), 1)["prompt_ms"] / 1000
                                            for _ in range(samples)])
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).with_name("calibration.json")))
    parser.add_argument("--size", default="medium")
    parser.add_argument("--quant", default="Q4_K_M")
    parser.add_argument("-np", "--parallel", type=int, default=4, help="slots: decode measured at 1..np busy")
    parser.add_argument("--context", type=int, default=2048, help="tokens a slot")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--instances", type=int, default=2,
                        help="servers measured at once, each pinned to its own CPU (bench/prefix.py runs 2 on this "
                        "host: they share its memory and what else runs)")
    parser.add_argument("--lengths", default="1,64,256,512,1024,1536")
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the servers are stopped on the way out
    binary, model = llama_server_binary(), generated_model(args.size, args.quant)
    saves = tempfile.mkdtemp(prefix="standin-calibrate-")
    started = time.monotonic()
    rng = random.Random(1)
    rng_lock = threading.Lock()

    def tokens(n: int) -> list[int]:
        with rng_lock:
            return random_tokens(rng, n)
    with servers(binary, model, args.instances, args.threads, args.parallel, args.context, Path(saves)) as ports:
        load_s = time.monotonic() - started
        bpt = bytes_per_token(ports[0])

        def warm(port: int) -> list[float]:
            return [completion(port, tokens(32), 2)["prompt_n"]]
        on_all(ports, warm)
        prefill: dict[str, float] = {}
        raw_prefill: dict[str, list[float]] = {}
        for length in (int(x) for x in args.lengths.split(",")):
            if length >= args.context:
                continue
            times: list[float] = []
            for _ in range(args.samples):

                def read(port: int, n: int = length) -> list[float]:
                    return [completion(port, tokens(n), 1)["prompt_ms"] / 1000]
                times += on_all(ports, read)
            raw_prefill[str(length)] = times
            prefill[str(length)] = length / statistics.median(times)
            print(f"prefill {length:5d} tokens: {statistics.median(times) * 1000:8.1f} ms, "
                  f"{prefill[str(length)]:7.1f} tokens/s", flush=True)
        extra: list[float] = []
        for cached in (512, 1024):
            if cached + 64 >= args.context or "64" not in raw_prefill:
                continue

            def after(port: int, cached: int = cached) -> list[float]:
                out = []
                for _ in range(args.samples):
                    base = tokens(cached)
                    completion(port, base, 1)  # the slot now holds it
                    t = completion(port, base + tokens(64), 1)
                    out.append((t["prompt_ms"] / 1000 - statistics.median(raw_prefill["64"])) / t["cache_n"])
                return out
            extra += on_all(ports, after)
        cached_ms = max(statistics.median(extra) * 1000, 0.0) if extra else 0.0
        print(f"reading after a cached prefix: {cached_ms:.3f} ms more per cached token", flush=True)
        decode: dict[str, float] = {}
        for busy in range(1, args.parallel + 1):

            def generate(port: int, busy: int = busy) -> list[float]:
                prompts = [tokens(args.decode_context) for _ in range(busy)]
                for prompt in prompts:  # read first, one at a time: each then finds its prompt in its slot
                    completion(port, prompt, 1)
                rates: list[float] = []
                lock = threading.Lock()

                def one(prompt: list[int]) -> None:
                    got = completion(port, prompt, args.decode_tokens)
                    with lock:
                        rates.append((got["predicted_n"] - 1) / (got["predicted_ms"] / 1000))
                threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                return rates
            decode[str(busy)] = statistics.median(on_all(ports, generate))
            print(f"decode with {busy} busy slot(s): {decode[str(busy)]:6.1f} tokens/s each "
                  f"({busy * decode[str(busy)]:6.1f} in all)", flush=True)
        completion(ports[0], tokens(256), 1)
        kv = []
        for slot in call(ports[0], "GET", "/slots")[1]:
            status, saved = call(ports[0], "POST", f"/slots/{slot['id']}?action=save",
                                 {"filename": f"s{slot['id']}.bin"})
            if status == 200 and saved.get("n_saved"):
                kv.append(saved["n_written"] / saved["n_saved"])
        out = {"prefill_tps": prefill, "decode_tps": decode, "cached_ms_per_token": round(cached_ms, 4),
               "bytes_per_token": round(bpt, 3),
               "kv_bytes_per_token": int(round(max(kv))) if kv else 49152, "load_s": round(load_s, 2),
               "measured": {"host": platform.node(), "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M"),
                            "model": f"{args.size} {args.quant}", "threads": args.threads,
                            "instances": args.instances, "parallel": args.parallel,
                            "decode_context": args.decode_context, "prefill_s": raw_prefill,
                            "loadavg": os.getloadavg()}}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"text bytes per token {bpt:.2f}, a cached token {out['kv_bytes_per_token']} B, load {load_s:.2f} s; "
              f"load average {os.getloadavg()[0]:.2f}; written to {args.out}")


if __name__ == "__main__":
    main()
