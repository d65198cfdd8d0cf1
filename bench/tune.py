#!/usr/bin/env python3
"""`numa-infer tune` against an exhaustive sweep, and its bandwidth figure against known tools,
in one run on this machine.

1. `numa-infer tune --json` on the generated model (this host's own topology, no daemon):
   its pick for placement.threads.
2. An exhaustive sweep of every thread count from 1 to the node's logical CPUs, measured
   the same way (same servers, same samples): the best decode rate. Goal: tune's pick
   decodes within 5 % of the sweep's best.
3. Read bandwidth of the node's CPUs from its memory: numad_infer.tune.bandwidth (what tune
   reports) beside numpy (a sum per CPU, bench/serving.py), sysbench memory (read) and
   mbw (memcpy, single thread), where installed (apt-get install sysbench mbw).

    .venv/bin/python bench/tune.py [--size medium] [--model Q4_K_M] [--samples 5] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving import bandwidth_gbs, host_machine  # noqa: E402
from numad_infer.host.identity import BackendKind  # noqa: E402
from numad_infer.topology.sysfs import read_topology  # noqa: E402
from numad_infer.tune import bandwidth  # noqa: E402
from numad_infer.tune.choice import Candidate  # noqa: E402
from numad_infer.tune.measure import Measurer, Settings  # noqa: E402
from tests.daemon_harness import free_port  # noqa: E402
from numad_infer.validate.pipeline import load  # noqa: E402
from tests import fakesys  # noqa: E402
from tests.daemon_harness import engine_keys, generated_model  # noqa: E402


def known_tools(threads: int) -> list[str]:
    lines = []
    if shutil.which("sysbench"):
        out = subprocess.run(["sysbench", "memory", "--memory-block-size=512M", "--memory-total-size=32G",
                              "--memory-oper=read", f"--threads={threads}", "run"], capture_output=True, text=True).stdout
        found = re.search(r"\(([\d.]+) MiB/sec\)", out)
        if found:
            lines.append(f"sysbench memory read, {threads} threads, 512 MiB block each: "
                         f"{float(found.group(1)) * 2**20 / 1e9:.1f} GB/s")
    else:
        lines.append("sysbench: not installed (apt-get install sysbench)")
    if shutil.which("mbw"):
        out = subprocess.run(["mbw", "-q", "-n", "5", "-t", "0", "512"], capture_output=True, text=True).stdout
        found = re.search(r"AVG.*Copy: ([\d.]+) MiB/s", out)
        if found:
            copy = float(found.group(1)) * 2**20 / 1e9
            lines.append(f"mbw memcpy, 1 thread: {copy:.1f} GB/s copied = {2 * copy:.1f} GB/s read + written")
    else:
        lines.append("mbw: not installed (apt-get install mbw)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium")
    parser.add_argument("--model", default="Q4_K_M", help="f16 (as generated) or a quantization: Q4_K_M, Q8_0, Q4_0")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-bench-tune-"))
    tmp.chmod(0o755)
    model = generated_model(args.size, None if args.model == "f16" else args.model)
    fsroot = fakesys.write_tree(tmp / "fs", host_machine())
    config_path = tmp / "numa-infer.toml"
    config_path.write_text(f'[model]\npath = "{model}"\ncontext_size = 1024\n[server]\n{engine_keys("llama-cpp-python")}'
                           f'base_port = {free_port()}\n[frontend]\nlisten = ""\n')
    topo = read_topology(str(fsroot))
    node = topo.nodes[0]
    logical = len(node.cpus)
    print(f"# host: {os.cpu_count()} CPUs, node 0: {len(node.cores)} cores, {logical} logical CPUs; model {args.size} "
          f"({model.stat().st_size / 2**20:.0f} MiB); {args.samples} samples, {args.tokens} tokens", flush=True)

    done = subprocess.run([sys.executable, "-m", "numad_infer", "--config", str(config_path), "--fsroot", str(fsroot),
                           "--state-file", str(tmp / "state.json"), "tune", "--json", "--samples", str(args.samples),
                           "--tokens", str(args.tokens)], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"tune failed: {done.stderr[-800:]}")
    report = json.loads(done.stdout)
    pick = next(c for c in report["choices"] if c["key"] == "placement.threads")
    print("tune: " + "  ".join(f"{c['threads']} threads {c['decode_tokens_per_s']['median']:.1f} tok/s"
                               for c in report["candidates"]) + f"; pick {pick['value']} ({pick['verdict']})")

    loaded = load(str(config_path), BackendKind.PROCESS)  # checked as the daemon checks it: key, engine, user
    measurer = Measurer(loaded, loaded.allowed, tmp, Settings(args.samples, args.tokens, 300.0),
                        progress=lambda text: None)
    port = free_port()
    sweep = {n: measurer.measure(0, Candidate(n, "sweep"), port) for n in range(1, logical + 1)}
    best = max(sweep, key=lambda n: sweep[n].decode.median)
    print("sweep: " + "  ".join(f"{n} threads {r.decode} tok/s" for n, r in sweep.items()))
    ratio = sweep[pick["value"]].decode.median / sweep[best].decode.median
    print(f"tune's pick ({pick['value']} threads) decodes at {ratio:.1%} of the sweep's best ({best} threads); "
          f"goal >= 95%")

    cpus = node.cpus
    ours = bandwidth.measure(cpus, node.id, samples=args.samples)
    single = bandwidth.measure(cpus[:1], node.id, samples=args.samples)
    print(f"numad_infer.tune.bandwidth (memchr per CPU, what tune reports): {ours.gbs:.1f} GB/s with {len(cpus)} readers "
          f"(samples {', '.join(f'{s:.1f}' for s in ours.samples_gbs)}); {single.gbs:.1f} GB/s with 1")
    numpy_gbs = statistics.median(bandwidth_gbs(len(cpus)) for _ in range(3))
    print(f"numpy sum, {len(cpus)} threads: {numpy_gbs:.1f} GB/s; ratio ours / numpy {ours.gbs / numpy_gbs:.2f}")
    for line in known_tools(len(cpus)):
        print(line)


if __name__ == "__main__":
    main()
