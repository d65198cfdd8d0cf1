#!/usr/bin/env python3
"""Prompt reuse at the front door (issue 38): the same fleet (the real daemon, process
backend, llama-server, two instances on this host, the front door) run once per
`frontend.affinity`, side by side in one run:

1. multi-turn: C concurrent conversations of T turns each, every one opening with the
   same system prompt (about 1,000 tokens on the generated model's tokenizer), each turn
   a new user message of its own on top of the whole history so far. Per mode: the time
   to the first token of turns >= 2 (p50, p90), of the first turns, the tokens per
   second (prompt and generated) of the whole workload, and the requests each instance
   got (its share against the mean); and of the later turns' TTFT, the engine's own time
   reading the prompt (timings.prompt_ms) and the rest (the wait for a slot), apart;
2. no reuse: random prompts that share nothing, C at a time: throughput and p99 latency.

    .venv/bin/python bench/prefix.py [--modes none,prefix] [--conversations 4] [--turns 4]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving import host_machine  # noqa: E402
from tests.daemon_harness import DaemonRun, generated_model  # noqa: E402

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
         "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey")


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(count))


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    generated: int
    prompt_s: float = 0.0  # the engine's own time reading the prompt (timings.prompt_ms)


@dataclass
class Workload:
    turns: list[Turn] = field(default_factory=list)
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def chat(port: int, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, float, str, dict[str, float]]:
    """One streamed chat completion through the front door: the time to its first content
    chunk, its whole time, the text, and what the engine said of the prompt."""
    body = json.dumps({"model": "bench", "messages": messages, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {response.read()[:200]!r}")
    first = None
    text: list[str] = []
    timings: dict[str, float] = {}
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if first is None:
            first = time.monotonic() - started
        for choice in chunk.get("choices", []):
            text.append((choice.get("delta") or {}).get("content") or "")
        if "timings" in chunk:
            timings = {"prompt": chunk["timings"].get("prompt_n", 0), "cached": chunk["timings"].get("cache_n", 0),
                       "generated": chunk["timings"].get("predicted_n", 0),
                       "prompt_ms": chunk["timings"].get("prompt_ms", 0.0)}
    conn.close()
    return first or 0.0, time.monotonic() - started, "".join(text), timings


def conversation(port: int, index: int, system: str, turns: int, user_words: int, max_tokens: int,
                 out: Workload, think_s: float = 0.0) -> None:
    rng = random.Random(1000 + index)
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        # A user's time between turns, the same in every mode (seeded): without it the
        # conversations move in lockstep, and least connections alone sends each one back to
        # the same instance every turn (conversation c on instance c mod 2), which no real
        # clients do.
        time.sleep(rng.uniform(0, think_s))
        messages.append({"role": "user", "content": f"conversation {index} turn {turn}: {words(rng, user_words)}"})
        try:
            ttft, total, text, timings = chat(port, messages, max_tokens)
        except (OSError, RuntimeError, ValueError) as exc:
            print(f"# conversation {index} turn {turn} failed: {exc}")
            with out.lock:
                out.failed += 1
            return
        messages.append({"role": "assistant", "content": text})
        with out.lock:
            out.turns.append(Turn(index, turn, ttft, total, int(timings.get("prompt", 0) + timings.get("cached", 0)),
                                  int(timings.get("cached", 0)), int(timings.get("generated", 0)),
                                  timings.get("prompt_ms", 0.0) / 1000))


def no_reuse(port: int, index: int, requests: int, prompt_words: int, max_tokens: int, out: Workload,
             latencies: list[float]) -> None:
    rng = random.Random(5000 + index)
    for k in range(requests):
        messages = [{"role": "user", "content": f"{rng.random()} {words(rng, prompt_words)}"}]
        try:
            _, total, _, timings = chat(port, messages, max_tokens)
        except (OSError, RuntimeError, ValueError):
            with out.lock:
                out.failed += 1
            continue
        with out.lock:
            latencies.append(total)
            out.turns.append(Turn(index, k, 0.0, total, int(timings.get("prompt", 0) + timings.get("cached", 0)),
                                  int(timings.get("cached", 0)), int(timings.get("generated", 0))))


def counts(run: DaemonRun) -> dict[str, int]:
    """Requests each instance answered, as the front door timed them (status)."""
    state = run.state() or {"instances": []}
    return {i["name"]: (i.get("time_to_first_token") or {}).get("count", 0) for i in state["instances"]}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_mode(mode: str, args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, object]:
    (tmp / mode).mkdir()
    # "prefix@3": the prefix affinity with tuning.prefix_wait_s = 3; "prefix~1.5": with
    # tuning.prefix_balance_factor = 1.5 (sweeps in one run).
    head, _, factor = mode.partition("~")
    affinity, _, wait = head.partition("@")
    waits = (f"prefix_wait_s = {float(wait)}\n" if wait else "") + (
        f"prefix_balance_factor = {float(factor)}\n" if factor else "")
    run = DaemonRun(tmp / mode, model, machine=host_machine(), engine="llama-server", interval_s=2.0,
                    context_size=args.context, placement=f"instances_per_node = {args.instances}\n",
                    frontend=f'listen = "127.0.0.1:{{port}}"\naffinity = "{affinity}"\n', tuning=waits)
    try:
        run.all_healthy(args.instances, timeout=600)
        if args.parallel != 1:  # a reload: the harness starts the daemon with the default
            run.server_extra = f"parallel = {args.parallel}\n"
            run.write_config(f"instances_per_node = {args.instances}\n")
            assert run.cli("reload").returncode == 0
            run.wait(lambda s: len(s["instances"]) == args.instances and all(
                i["state"] == "healthy" and i.get("slots") == args.parallel for i in s["instances"]), 600,
                f"{args.parallel} slots each")
        run.wait(lambda s: all(i.get("rotation") == "UP" for i in s["instances"]), 120, "every instance in rotation")
        port = run.frontend_port
        chat(port, [{"role": "user", "content": "warm up"}], 2)
        time.sleep(3)  # the warm-up's timing reaches status before the counts are taken
        before = counts(run)
        system = f"You are a careful assistant. {words(random.Random(7), args.system_words)}"
        multi = Workload()
        started = time.monotonic()
        threads = [threading.Thread(target=conversation, args=(port, c, system, args.turns, args.user_words,
                                                               args.max_tokens, multi, args.think_s))
                   for c in range(args.conversations)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        multi_s = time.monotonic() - started
        time.sleep(3)
        after = counts(run)
        per_instance = {name: after.get(name, 0) - before.get(name, 0) for name in after}
        plain = Workload()
        latencies: list[float] = []
        started = time.monotonic()
        threads = [threading.Thread(target=no_reuse, args=(port, c, args.plain_requests, args.plain_words,
                                                           args.max_tokens, plain, latencies))
                   for c in range(args.conversations)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        plain_s = time.monotonic() - started
    finally:
        run.stop()
    if args.verbose:
        for t in sorted(multi.turns, key=lambda t: (t.conversation, t.turn)):
            print(f"# {mode}: conversation {t.conversation} turn {t.turn}: prompt {t.prompt_tokens}, cached "
                  f"{t.cached_tokens}, TTFT {t.ttft_s:.2f}s (prompt read {t.prompt_s:.2f}s)")
    later = [t.ttft_s for t in multi.turns if t.turn >= 1]
    # TTFT = the wait for a slot (the front door's queue, a home's wait) + reading the prompt
    # + the first token: the engine's prompt time, and the rest, apart.
    reading = [t.prompt_s for t in multi.turns if t.turn >= 1]
    waiting = [max(t.ttft_s - t.prompt_s, 0.0) for t in multi.turns if t.turn >= 1]
    firsts = [t.ttft_s for t in multi.turns if t.turn == 0]
    tokens = sum(t.prompt_tokens + t.generated for t in multi.turns)
    prompt_tokens = sum(t.prompt_tokens for t in multi.turns)
    mean = statistics.mean(per_instance.values()) if per_instance else 0
    return {
        "mode": mode, "later_p50": pct(later, 0.5), "later_p90": pct(later, 0.9), "first_p50": pct(firsts, 0.5),
        "read_p50": pct(reading, 0.5), "wait_p50": pct(waiting, 0.5),
        "multi_tokens_s": tokens / multi_s, "multi_s": multi_s, "failed": multi.failed + plain.failed,
        "cached_share": sum(t.cached_tokens for t in multi.turns) / max(prompt_tokens, 1),
        "per_instance": per_instance, "max_over_mean": max(per_instance.values()) / mean if mean else float("nan"),
        "plain_tokens_s": sum(t.prompt_tokens + t.generated for t in plain.turns) / plain_s,
        "plain_p50": pct(latencies, 0.5), "plain_p99": pct(latencies, 0.99),
        "prompt_tokens_turn1": statistics.mean(t.prompt_tokens for t in multi.turns if t.turn == 0) if firsts else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="none,prefix",
                        help="frontend.affinity values, the first the baseline; prefix@S: prefix_wait_s = S; "
                        "prefix~F: prefix_balance_factor = F")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=180)  # ~950 tokens
    parser.add_argument("--user-words", type=int, default=30)  # ~150 tokens
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--plain-requests", type=int, default=4, help="no-reuse requests per client")
    parser.add_argument("--plain-words", type=int, default=120)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=1, help="server.parallel: slots per instance")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--size", default="medium")
    parser.add_argument("--quant", default="Q4_K_M")
    parser.add_argument("--think-s", type=float, default=0.0,
                        help="each turn waits up to this long first (uniform, seeded): a user's time between turns")
    parser.add_argument("--verbose", action="store_true", help="each turn's prompt, cached tokens and TTFT")
    args = parser.parse_args()
    model = generated_model(args.size, args.quant)
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-prefix-"))
    print(f"# {args.size} {args.quant}, {args.instances} instances (llama-server), "
          f"{args.parallel} slot(s) each, {args.conversations} conversations x {args.turns} turns, system prompt "
          f"{args.system_words} words, "
          f"{args.user_words} words a turn, up to {args.think_s:g} s between turns, "
          f"{args.max_tokens} tokens an answer")
    results = [run_mode(mode, args, model, tmp) for mode in args.modes.split(",")]
    base = results[0]
    print(f"# first turn's prompt: {base['prompt_tokens_turn1']:.0f} tokens")
    print(f"{'affinity':<10} {'TTFT t>=2 p50':>14} {'p90':>7} {'TTFT t=1 p50':>13} {'cached':>7} {'tok/s':>7} "
          f"{'max/mean':>9} {'no-reuse tok/s':>15} {'p99':>7} failed {'read p50':>9} {'rest p50':>9}  "
          "requests per instance")
    for r in results:
        print(f"{r['mode']:<10} {r['later_p50']:>13.2f}s {r['later_p90']:>6.2f}s {r['first_p50']:>12.2f}s "
              f"{r['cached_share']:>7.0%} {r['multi_tokens_s']:>7.1f} {r['max_over_mean']:>9.2f} "
              f"{r['plain_tokens_s']:>15.1f} {r['plain_p99']:>6.2f}s {r['failed']:>6} {r['read_p50']:>8.2f}s "
              f"{r['wait_p50']:>8.2f}s  {r['per_instance']}")
    for r in results[1:]:
        print(f"ratio {r['mode']} / {base['mode']}: TTFT of turns >= 2 p50 {base['later_p50'] / r['later_p50']:.2f}x "
              f"better; multi-turn tokens/s {r['multi_tokens_s'] / base['multi_tokens_s']:.2f}x; no-reuse tokens/s "
              f"{r['plain_tokens_s'] / base['plain_tokens_s']:.2f}x, p99 {r['plain_p99'] / base['plain_p99']:.2f}x; "
              f"of the TTFT, the prompt's reading p50 {base['read_p50'] / r['read_p50']:.2f}x better, the rest (the "
              f"wait for a slot) {base['wait_p50'] / max(r['wait_p50'], 1e-3):.2f}x")


if __name__ == "__main__":
    main()
