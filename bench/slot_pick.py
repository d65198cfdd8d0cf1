#!/usr/bin/env python3
"""llama-server's slot pick and its prompt cache (issue 38; engines/llama_server.py,
LlamaServer._keeps_prompts): one llama-server per setting, side by side in one run, the
server's default pick (by prompt similarity, -sps 0.1) against numa-infer's (-sps 0: the
least recently used slot, its prompt saved to the cache, the best cached one taken).

1. multi-turn: C conversations taking turns one request at a time over S slots, all
   behind the same ~1,000-token system prompt: the share of the prompt tokens of turns
   >= 2 found cached (timings.cache_n), and their prompt time at p50;
2. no reuse: prompts that share nothing, sent to both servers in turn: the time of a
   request (what saving each prompt to the cache costs).

    .venv/bin/python bench/slot_pick.py [--slots 1] [--conversations 3] [--turns 4]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.prefix import words  # noqa: E402
from tests.daemon_harness import free_port_block, generated_model, llama_server_binary  # noqa: E402

SETTINGS = {"default (-sps 0.1)": ["--slot-prompt-similarity", "0.1"], "numa-infer (-sps 0)": ["--slot-prompt-similarity", "0"]}


def start(model: Path, port: int, slots: int, context: int, extra: list[str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([str(llama_server_binary()), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                             "--ctx-size", str(context * slots), "--parallel", str(slots), "--threads", "1",
                             "--cache-ram", "1024", "--no-webui", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"llama-server on port {port} never became healthy")


def chat(port: int, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, dict, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": messages, "max_tokens": max_tokens,
                                                             "ignore_eos": True, "temperature": 0}),
                 {"Content-Type": "application/json"})
    answer = json.loads(conn.getresponse().read())
    return time.monotonic() - started, answer["timings"], answer["choices"][0]["message"]["content"]


def multi_turn(port: int, args: argparse.Namespace) -> tuple[float, float]:
    """The cached share of turns >= 2's prompt tokens, and their prompt time at p50 (s)."""
    system = {"role": "system", "content": f"You are a careful assistant. {words(random.Random(7), args.system_words)}"}
    histories = [[system] for _ in range(args.conversations)]
    rngs = [random.Random(100 + c) for c in range(args.conversations)]
    cached = total = 0
    prompt_s: list[float] = []
    for turn in range(args.turns):
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": f"conversation {c} turn {turn}: {words(rngs[c], args.user_words)}"})
            _, timings, text = chat(port, history, args.max_tokens)
            history.append({"role": "assistant", "content": text})
            if turn >= 1:
                cached += timings["cache_n"]
                total += timings["cache_n"] + timings["prompt_n"]
                prompt_s.append(timings["prompt_ms"] / 1000)
    return cached / max(total, 1), statistics.median(prompt_s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=180)
    parser.add_argument("--user-words", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--plain-requests", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--size", default="medium")
    parser.add_argument("--quant", default="Q4_K_M")
    args = parser.parse_args()
    model = generated_model(args.size, args.quant)
    base = free_port_block(len(SETTINGS))
    servers = {name: (base + k, start(model, base + k, args.slots, args.context, extra))
               for k, (name, extra) in enumerate(SETTINGS.items())}
    try:
        print(f"# {args.size} {args.quant}, llama-server, {args.slots} slot(s), 1 thread, {args.conversations} "
              f"conversations x {args.turns} turns one request at a time, system prompt {args.system_words} words")
        shares = {}
        for name, (port, _) in servers.items():
            share, p50 = multi_turn(port, args)
            shares[name] = (share, p50)
            print(f"{name:22} turns >= 2: {share:.0%} of prompt tokens cached, prompt time p50 {p50:.2f}s")
        rng = random.Random(3)
        times: dict[str, list[float]] = {name: [] for name in servers}
        for k in range(args.plain_requests):
            messages = [{"role": "user", "content": f"{rng.random()} {words(rng, 120)}"}]
            order = list(servers.items()) if k % 2 else list(reversed(servers.items()))  # interleaved
            for name, (port, _) in order:
                times[name].append(chat(port, messages, 8)[0])
        for name, t in times.items():
            print(f"{name:22} no reuse: request p50 {statistics.median(t):.2f}s, mean {statistics.mean(t):.2f}s")
        (base_name, ours) = list(servers)
        print(f"ratio numa-infer / default: cached share {shares[ours][0] / max(shares[base_name][0], 1e-9):.2f}x, "
              f"prompt time p50 {shares[base_name][1] / shares[ours][1]:.2f}x better; no-reuse mean time "
              f"{statistics.mean(times[ours]) / statistics.mean(times[base_name]):.2f}x")
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
