#!/usr/bin/env python3
"""llama-server builds side by side on this host: prompt (pp) and decode (tg) tokens/s of
each build on the generated model as f16, Q8_0, Q4_0 and Q4_K_M, weight repacking on and
off, one after the other in one run (issue 20's "Numbers").

Builds: scripts/build-llama-server's (every x86 variant, the best loaded at start) and any
other llama-server binaries named with --build NAME=PATH (e.g. today's static AVX2 build).
Each run is one server, started as numa-infer starts it (no mmap, so llama.cpp repacks
Q4_0/Q8_0/Q4_K for the kernels it chose), asked --reps times for a ~256-token prompt and 32
generated tokens with end-of-sequence ignored and no prompt cache; the figures are the
server's own timings (prompt_per_second, predicted_per_second), medians.

    .venv/bin/python bench/builds.py [--size medium] [--threads 2] [--reps 3]
        [--build avx2=~/.cache/numa-infer/llama-server/<old key>/llama-server]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numad_infer.cpufeatures import from_backend_log  # noqa: E402
from numad_infer.ggufheader import decode_bytes  # noqa: E402
from tests.daemon_harness import free_port_block, generated_model, llama_server_binary  # noqa: E402

MODELS = ("f16", "Q8_0", "Q4_0", "Q4_K_M")
# ~256 prompt tokens on the generated models' tokenizer (3 tokens per "wordN").
PROMPT = " ".join(f"word{i % 97}" for i in range(85))


@dataclass(frozen=True)
class Run:
    pp: float  # prompt tokens/s
    tg: float  # generated tokens/s
    prompt_tokens: int
    variant: str  # the CPU backend the server loaded ("static" for a one-backend build)


def measure(binary: Path, model: Path, threads: int, repack: bool, reps: int, log_dir: Path) -> Run | str:
    """One server on `model`; the medians of `reps` requests, or why it failed (a crash is a row)."""
    port = free_port_block(1)
    log = log_dir / f"{binary.parent.name}-{model.stem}-{'repack' if repack else 'norepack'}.log"
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-c", "1024", "-np", "1", "--load-mode", "none", "--no-webui",
            *([] if repack else ["--no-repack"])]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        body = json.dumps({"prompt": PROMPT, "n_predict": 32, "temperature": 0, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                return f"exit {proc.returncode}" + (" (SIGILL)" if proc.returncode in (-4, 132) else "")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                return "no answer within 600 s"
            time.sleep(0.2)
        pp, tg, n_prompt = [], [], 0
        for _ in range(reps + 1):  # the first is warm-up
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=600) as resp:
                    timings = json.load(resp)["timings"]
            except OSError as exc:
                return f"request failed: {exc}" + (f"; exit {proc.poll()}" if proc.poll() is not None else "")
            pp.append(timings["prompt_per_second"])
            tg.append(timings["predicted_per_second"])
            n_prompt = timings["prompt_n"]
        # The variant ggml loads (logged at verbosity 4 when the backends load; none: static).
        listed = subprocess.run([str(binary), "-lv", "4", "--list-devices"], capture_output=True, text=True, timeout=60)
        cpu = from_backend_log(listed.stdout + listed.stderr)
        return Run(statistics.median(pp[1:]), statistics.median(tg[1:]), n_prompt,
                   cpu.variant if cpu and cpu.variant else "static")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--build", action="append", default=[], metavar="NAME=PATH",
                        help="another llama-server binary to compare (repeatable)")
    args = parser.parse_args()
    builds = {"variants": llama_server_binary()}
    for item in args.build:
        name, _, path = item.partition("=")
        builds[name] = Path(os.path.expanduser(path))
    log_dir = Path(tempfile.mkdtemp(prefix="numa-infer-bench-builds-"))
    started = time.monotonic()
    print(f"# host: {os.cpu_count()} CPUs; {args.threads} threads; model {args.size}; ~256-token prompt, 32 tokens "
          f"generated (EOS ignored); medians of {args.reps}; logs in {log_dir}", flush=True)
    print("| model | MiB read/token | repack | test | " + " | ".join(builds) + " | "
          + " | ".join(f"variants / {b}" for b in builds if b != "variants") + " |")
    print("|---|---|---|---|" + "---|" * (2 * len(builds) - 1))
    for name in args.models.split(","):
        model = generated_model(args.size, None if name == "f16" else name)
        read = decode_bytes(str(model)) / 2**20
        for repack in (True, False):
            runs = {b: measure(path, model, args.threads, repack, args.reps, log_dir) for b, path in builds.items()}
            for test in ("pp", "tg"):
                cells, ratios = [], []
                for b, r in runs.items():
                    cells.append(r if isinstance(r, str) else f"{getattr(r, test):.1f} ({r.variant})")
                base = runs["variants"]
                for b, r in runs.items():
                    if b == "variants":
                        continue
                    ok = not isinstance(r, str) and not isinstance(base, str)
                    ratios.append(f"{getattr(base, test) / getattr(r, test):.2f}x" if ok else "-")
                print(f"| {name} | {read:.0f} | {'on' if repack else 'off'} | {test} | " + " | ".join(cells) + " | "
                      + " | ".join(ratios) + " |", flush=True)
    print(f"# {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
