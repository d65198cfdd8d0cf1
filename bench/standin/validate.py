#!/usr/bin/env python3
"""The stand-in against the real llama-server, where both run: bench/prefix.py's workload
(its `run_mode`: the real daemon, process backend, the front door, N instances on the fake
2-node topology) once with llama-server and once with the stand-in as `server.llama_server`,
interleaved over `--runs`, the order alternating. Per turn: the time to first token (the
median over the conversations, then over the runs; and the median of every run's turns
pooled) and the ratio stand-in / real (goal: within 15 %); of the later turns, the cached
share of prompt tokens (goal: within 5 points).

The stand-in is started by the daemon as llama-server would be: a wrapper script that runs
`python -m bench.standin --calibration FILE` with the daemon's arguments.

A shared host's speed moves by tens of percent within minutes (the other machines on it:
the same 1,024-token read took 2.8 s and 3.8 s twenty minutes apart), the real server's with
it, the stand-in's not. So before each pair of runs a probe (calibrate.prefill_now: that
read on 2 real servers at once, ~15 s) measures the host now, and the stand-in of that pair
runs at the calibration's rates scaled by it: the calibration gives the shapes (by prompt
length, by busy slots), the probe the host's speed of the moment. `--fixed`: no probe.

    .venv/bin/python -m bench.standin.validate [--calibration bench/standin/calibration.json | --calibrate] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import bench.prefix as prefix  # noqa: E402
from bench.standin.calibrate import prefill_now  # noqa: E402
from tests import daemon_harness  # noqa: E402
from tests.daemon_harness import generated_model, llama_server_binary, server_python, shared_dir  # noqa: E402


def standin_calibration() -> Path:
    """The calibration the wrapper script's stand-ins read when they start."""
    return shared_dir() / "standin" / "calibration.json"


def standin_binary(calibration: Path, jitter: float = 0.0) -> Path:
    """A program the daemon can start as llama-server (as its servers' user: in the shared,
    world-readable directory) that runs the stand-in on this checkout."""
    where = shared_dir() / "standin"
    where.mkdir(exist_ok=True)
    where.chmod(0o755)
    cal = standin_calibration()
    shutil.copyfile(calibration, cal)
    cal.chmod(0o644)
    script = where / "llama-server"
    script.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT} PYTHONDONTWRITEBYTECODE=1 exec {server_python()} "
                      f"-m bench.standin --calibration {cal} --jitter {jitter} \"$@\"\n")
    script.chmod(0o755)
    return script


class Recorded(prefix.Workload):
    """bench/prefix.py's Workload, each one kept: run_mode returns only its summary."""

    made: list["Recorded"] = []

    def __init__(self) -> None:
        super().__init__()
        Recorded.made.append(self)


def run(mode: str, engine: Path, args: argparse.Namespace, model: Path, tmp: Path) -> tuple[dict[str, Any], list[prefix.Turn]]:
    daemon_harness._llama_server = engine  # what engine_keys() names as server.llama_server
    Recorded.made = []
    original = prefix.Workload
    setattr(prefix, "Workload", Recorded)  # noqa: B010
    try:
        summary = prefix.run_mode(mode, args, model, tmp)
    finally:
        setattr(prefix, "Workload", original)  # noqa: B010
    return summary, Recorded.made[0].turns  # the first one made is the multi-turn workload


PROBE_TOKENS = 1024  # a first turn's prompt (bench/prefix.py: ~1,000 tokens of system prompt)


def calibrated_s(calibration: dict[str, Any]) -> float:
    """What the calibration says reading PROBE_TOKENS into an empty slot takes."""
    lengths = sorted(int(k) for k in calibration["prefill_tps"])
    nearest = min(lengths, key=lambda n: abs(n - PROBE_TOKENS))
    return PROBE_TOKENS / float(calibration["prefill_tps"][str(nearest)])


def scaled(calibration: dict[str, Any], factor: float) -> dict[str, Any]:
    """The calibration at a host `factor` times as fast: every rate times it, every cost per
    token divided by it (the shapes, by length and busy slots, as measured)."""
    out = dict(calibration)
    out["prefill_tps"] = {k: v * factor for k, v in calibration["prefill_tps"].items()}
    out["decode_tps"] = {k: v * factor for k, v in calibration["decode_tps"].items()}
    out["cached_ms_per_token"] = calibration.get("cached_ms_per_token", 0.0) / factor
    out["scaled_by"] = factor
    return out


def per_turn(turns: list[prefix.Turn], count: int) -> list[float]:
    return [statistics.median([t.ttft_s for t in turns if t.turn == k] or [float("nan")]) for k in range(count)]


def cached_share(turns: list[prefix.Turn]) -> float:
    later = [t for t in turns if t.turn >= 1]
    return sum(t.cached_tokens for t in later) / max(sum(t.prompt_tokens for t in later), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calibration", default=str(Path(__file__).with_name("calibration.json")))
    parser.add_argument("--calibrate", action="store_true",
                        help="calibrate first, in this run (calibrate.py's defaults), and use that: on a shared host "
                        "the real server's speed moves with the load, the stand-in's does not")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jitter", type=float, default=0.1,
                        help="the stand-in's step times vary by this much (its --jitter), as the host's do")
    parser.add_argument("--mode", default="prefix", help="frontend.affinity (bench/prefix.py's --modes, one)")
    # bench/prefix.py's workload options, its defaults
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=180)
    parser.add_argument("--user-words", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--plain-requests", type=int, default=2)
    parser.add_argument("--plain-words", type=int, default=120)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--size", default="medium")
    parser.add_argument("--quant", default="Q4_K_M")
    parser.add_argument("--think-s", type=float, default=0.0)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--fixed", action="store_true",
                        help="the calibration's rates as they are in every run; default: before each pair of runs, "
                             "the host's prefill speed now (calibrate.prefill_now) scales them")
    args = parser.parse_args()
    model = generated_model(args.size, args.quant)
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-standin-validate-"))
    if args.calibrate:
        args.calibration = str(tmp / "calibration.json")
        subprocess.run([sys.executable, "-m", "bench.standin.calibrate", "--size", args.size, "--quant", args.quant,
                        "--out", args.calibration], check=True, cwd=ROOT)
    engines = {"llama-server": llama_server_binary(), "stand-in": standin_binary(Path(args.calibration), args.jitter)}
    calibration = json.loads(Path(args.calibration).read_text())
    calibrated = calibrated_s(calibration)
    print(f"# {args.size} {args.quant}, {args.instances} instances, {args.parallel} slot(s) each, affinity "
          f"{args.mode}, {args.conversations} conversations x {args.turns} turns, {args.runs} interleaved runs; "
          f"calibration {args.calibration}, stand-in jitter {args.jitter:g}; load average {os.getloadavg()[0]:.2f}")
    results: Runs = {name: [] for name in engines}
    for r in range(args.runs):
        if not args.fixed:
            now = prefill_now(args.size, args.quant, args.instances, PROBE_TOKENS)
            factor = calibrated / now
            standin_calibration().write_text(json.dumps(scaled(calibration, factor), indent=1) + "\n")
            print(f"# run {r + 1}: the host reads {PROBE_TOKENS} tokens in {now:.2f} s now "
                  f"({calibrated:.2f} s at calibration): the stand-in's rates x {factor:.2f}",
                  flush=True)
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            (tmp / f"{r}-{name}").mkdir()
            summary, turns = run(args.mode, engines[name], args, model, tmp / f"{r}-{name}")
            results[name].append((summary, turns))
            print(f"# run {r + 1} {name:<12} TTFT by turn {' '.join(f'{x:.2f}' for x in per_turn(turns, args.turns))}"
                  f"  cached (turns >= 2) {cached_share(turns):.0%}  no-reuse p99 {summary['plain_p99']:.2f}s"
                  f"  failed {summary['failed']}", flush=True)
    report(results, args.turns)


Runs = dict[str, list[tuple[dict[str, Any], list[prefix.Turn]]]]


def report(results: Runs, turns: int) -> None:
    """Per turn, two medians: of the per-run medians (each over one run's conversations: a
    few, so one queue position moves it by a whole prompt), and of every run's turns pooled
    (the same turns, one median: what moves is the engine, not a run's order of arrivals)."""
    table = {}
    for name, runs in results.items():
        by_turn = [statistics.median(per_turn(t, turns)[k] for _, t in runs) for k in range(turns)]
        pooled = per_turn([turn for _, t in runs for turn in t], turns)
        later = statistics.median(s["later_p50"] for s, _ in runs)
        share = statistics.median(cached_share(t) for _, t in runs)
        plain = statistics.median(s["plain_p50"] for s, _ in runs)
        table[name] = (by_turn, pooled, later, share, plain)
    print(f"{'engine':<26}" + "".join(f"{'TTFT t=' + str(k + 1):>10}" for k in range(turns))
          + f"{'t>=2 p50':>10}{'cached':>8}{'no-reuse p50':>14}")
    for name, (by_turn, pooled, later, share, plain) in table.items():
        print(f"{name + ', run medians':<26}" + "".join(f"{x:>9.2f}s" for x in by_turn)
              + f"{later:>9.2f}s{share:>8.0%}{plain:>13.2f}s")
        print(f"{name + ', pooled':<26}" + "".join(f"{x:>9.2f}s" for x in pooled))
    real, stand = table["llama-server"], table["stand-in"]
    worst = {}
    for label, column in (("median of run medians", 0), ("pooled", 1)):
        ratios = [s / r for s, r in zip(stand[column], real[column], strict=True)]
        worst[label] = max(abs(x - 1) for x in ratios)
        print(f"ratio stand-in / llama-server, {label}: TTFT by turn " + " ".join(f"{x:.2f}x" for x in ratios))
    points = (stand[3] - real[3]) * 100
    print(f"ratio stand-in / llama-server: turns >= 2 p50 {stand[2] / real[2]:.2f}x, no-reuse p50 "
          f"{stand[4] / real[4]:.2f}x; cached share {points:+.1f} points")
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    verdicts = "; ".join(f"{label} {'met' if w <= 0.15 else 'MISSED'} (worst {w:.0%})" for label, w in worst.items())
    print(f"goal: every turn within 15 %: {verdicts}; cached share within 5 points "
          f"({'met' if abs(points) <= 5 else 'MISSED'})")


if __name__ == "__main__":
    main()
