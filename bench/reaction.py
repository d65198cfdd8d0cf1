#!/usr/bin/env python3
"""How fast the daemon reacts: affinity drift, a killed and a stopped instance, reloads,
and how long `numa-infer status` takes. Real daemon (process backend), real servers on a
tiny generated model, the fake 2-node topology of the host tests.

    .venv/bin/python bench/reaction.py [--interval 2] [--drifts 50] [--kills 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.daemon_harness import DaemonRun, generated_model  # noqa: E402


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def line(name: str, values: list[float], unit: str = "s") -> str:
    return (f"{name:<34} n={len(values):<3} p50 {pct(values, 50):7.3f}{unit}  p99 {pct(values, 99):7.3f}{unit}  "
            f"max {max(values):7.3f}{unit}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--drifts", type=int, default=50)
    parser.add_argument("--kills", type=int, default=5)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-bench-"))
    model = generated_model("tiny")  # readable by the servers' user (numa-infer, or nobody without it, when run as root)
    (tmp / "d").mkdir()
    # Enough restart budget for the repeated kills below (the default marks it failed after 5).
    # Repeated kills on purpose: no restart budget or backoff in the way of the reaction time.
    run = DaemonRun(tmp / "d", model, interval_s=args.interval, monitor="max_restarts = 1000", backoff_s=0)
    print(f"# host: {os.cpu_count()} CPUs; monitor.interval_s = {args.interval}; target p99 < interval + 0.1 s")
    try:
        state = run.all_healthy(2)
        # 0. What the daemon itself costs while it just monitors (its own CPU time, not the servers').
        def cpu_s() -> float:
            fields = open(f"/proc/{run.proc.pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        before, start = cpu_s(), time.monotonic()
        time.sleep(30)
        used, elapsed = cpu_s() - before, time.monotonic() - start
        passes = run.state()["daemon"].get("pass_duration_s")
        print(f"{'daemon CPU while monitoring':<34} {used / elapsed * 100:.2f}% of a core (2 instances, {elapsed:.0f}s); "
              f"last pass {passes * 1000:.1f} ms wall")
        # 1. affinity drift: one thread moved to the other instance's CPU.
        reactions = []
        for i in range(args.drifts):
            pid = run.instance(run.state(), "infer@1")["pid"]
            tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
            tid = tids[i % len(tids)]
            time.sleep((i * 0.37) % args.interval)  # spread injections over the pass phase
            start = time.monotonic()
            os.sched_setaffinity(tid, {0})
            while os.sched_getaffinity(tid) != {1}:
                if time.monotonic() - start > 5 * args.interval:
                    raise SystemExit(f"thread {tid} not re-pinned after {5 * args.interval}s")
                time.sleep(0.002)
            reactions.append(time.monotonic() - start)
        print(line("affinity drift -> re-pinned", reactions))

        # 2. killed and stopped instances -> healthy again.
        for label, sig in (("kill -9 -> healthy again", signal.SIGKILL), ("SIGSTOP -> healthy again", signal.SIGSTOP)):
            times = []
            for _ in range(args.kills):
                state = run.all_healthy(2)
                old = run.instance(state, "infer@0")["pid"]
                start = time.monotonic()
                os.kill(old, sig)
                run.wait(lambda s: (i := run.instance(s, "infer@0"))["state"] == "healthy" and i["pid"] not in (None, old),
                         120, label)
                times.append(time.monotonic() - start)
            print(line(label, times))

        # 3. reload: SIGHUP -> new plan applied (state file generation moves).
        def reload_once() -> float:
            before = run.state()["daemon"]["generation"]
            start = time.monotonic()
            os.kill(run.proc.pid, signal.SIGHUP)
            while (run.state() or {"daemon": {"generation": before}})["daemon"]["generation"] <= before:
                if time.monotonic() - start > 60:
                    raise SystemExit("reload not applied within 60 s")
                time.sleep(0.005)
            return time.monotonic() - start

        text = run.config.read_text()
        unchanged = [reload_once() for _ in range(10)]
        print(line("reload, no change", unchanged))
        removed, added = [], []
        for _ in range(5):
            run.config.write_text(text.replace("[placement]\n", "[placement]\nnodes = [0]\n"))
            removed.append(reload_once())
            run.config.write_text(text)
            added.append(reload_once())
            run.all_healthy(2)
        print(line("reload, one instance removed", removed))
        print(line("reload, one instance added (started)", added))

        # 4. `numa-infer status`, a fresh process each time.
        walls = []
        for _ in range(10):
            start = time.monotonic()
            subprocess.run([sys.executable, "-m", "numad_infer", "--state-file", str(run.state_file), "status"],
                           capture_output=True, cwd=ROOT)
            walls.append(time.monotonic() - start)
        print(line("numa-infer status (new process)", walls))
    finally:
        run.stop()


if __name__ == "__main__":
    main()
