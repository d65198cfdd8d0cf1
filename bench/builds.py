#!/usr/bin/env python3
"""llama-server builds side by side on this host: prompt (pp) and decode (tg) tokens/s of
each build on the generated model as f16, Q8_0, Q4_0 and Q4_K_M, weight repacking on and
off, one after the other in one run (issue 20's "Numbers").

Builds: scripts/build-llama-server's (its x86 variants, the best loaded at start) and any
other llama-server binaries named with --build NAME=PATH (e.g. today's static AVX2 build).
Per row, one server per build, all started as numa-infer starts them (no mmap, so llama.cpp
repacks Q4_0/Q8_0/Q4_K for the kernels it chose) and asked in turn, one request at a time,
--reps times each for a ~256-token prompt and 32 generated tokens with end-of-sequence
ignored and no prompt cache; the figures are the servers' own timings (prompt_per_second,
predicted_per_second), medians.

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

from numad_infer.host.cpufeatures import from_backend_log  # noqa: E402
from numad_infer.model.gguf import decode_bytes  # noqa: E402
from numad_infer.validate.host_check import RUN_TRIES  # noqa: E402
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


class Server:
    """One build's llama-server on one model, started as numa-infer starts it."""

    def __init__(self, binary: Path, model: Path, threads: int, repack: bool, log_dir: Path) -> None:
        self.binary, self.port = binary, free_port_block(1)
        log = log_dir / f"{binary.parent.name}-{model.stem}-{'repack' if repack else 'norepack'}.log"
        argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                "-tb", str(threads), "-c", "1024", "-np", "1", "--load-mode", "none", "--no-webui",
                *([] if repack else ["--no-repack"])]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.pp: list[float] = []
        self.tg: list[float] = []
        self.prompt_tokens = 0
        self.failed: str | None = None

    def died(self) -> str | None:
        if self.proc.poll() is None:
            return None
        return f"exit {self.proc.returncode}" + (" (SIGILL)" if self.proc.returncode in (-4, 132) else "")

    def wait_ready(self, deadline: float) -> None:
        while self.failed is None:
            self.failed = self.died()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.failed = "no answer within 600 s"
            time.sleep(0.2)

    def ask(self, keep: bool) -> None:
        """One completion; its timings kept unless it is the warm-up."""
        if self.failed is not None:
            return
        body = json.dumps({"prompt": PROMPT, "n_predict": 32, "temperature": 0, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                timings = json.load(resp)["timings"]
        except OSError as exc:
            self.failed = f"request failed: {exc}" + (f"; {self.died()}" if self.died() else "")
            return
        if keep:
            self.pp.append(timings["prompt_per_second"])
            self.tg.append(timings["predicted_per_second"])
            self.prompt_tokens = timings["prompt_n"]

    def result(self) -> Run | str:
        if self.failed is not None:
            return self.failed
        # The variant ggml loads (logged at verbosity 4 when the backends load; none: static).
        # Its log thread may lose the line when the process exits at once: asked a few times.
        cpu = None
        for _ in range(RUN_TRIES):
            listed = subprocess.run([str(self.binary), "-lv", "4", "--list-devices"], capture_output=True, text=True,
                                    timeout=60)
            cpu = from_backend_log(listed.stdout + listed.stderr)
            if cpu is not None:
                break
        return Run(statistics.median(self.pp), statistics.median(self.tg), self.prompt_tokens,
                   cpu.variant if cpu and cpu.variant else "static")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def measure(builds: dict[str, Path], model: Path, threads: int, repack: bool, reps: int,
            log_dir: Path) -> dict[str, Run | str]:
    """Every build's server on `model` at once, asked in turn (A B A B ...), one request at a
    time: an idle llama-server sleeps, so each request has the CPUs to itself, and a
    neighbour's load on this shared host falls on every build alike instead of on whichever
    ran during it. Medians of `reps` after one warm-up each; a crash is a row, not an abort."""
    servers = {name: Server(path, model, threads, repack, log_dir) for name, path in builds.items()}
    try:
        deadline = time.monotonic() + 600
        for server in servers.values():
            server.wait_ready(deadline)
        for rep in range(reps + 1):  # the first round is the warm-up
            for server in servers.values():
                server.ask(keep=rep > 0)
        return {name: server.result() for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()


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
            runs = measure(builds, model, args.threads, repack, args.reps, log_dir)
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
