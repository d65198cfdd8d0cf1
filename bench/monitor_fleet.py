#!/usr/bin/env python3
"""The daemon's own CPU over a stand-in fleet at rest (issue 60, part 2): the real daemon
loop (bench/standin/fleet_daemon.py) over 16 and 64 instances planned from captured machines,
the front door on, no requests; its process's CPU seconds over --seconds, at each
monitor.interval_s, as a share of a core and per pass.

    .venv/bin/python bench/monitor_fleet.py [--seconds 60] [--intervals 5,2] [--instances 16,64]

What differs from a real host: every stand-in instance is one process (fleet_host.py), so
each instance's affinity, drift and memory readings read the same process's threads and
maps; bench/monitor_cost.py measures the affinity pass over separate processes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from bench.fleet import shared_assets, unpack  # noqa: E402
from bench.frontdoor_capacity import Door, calibration  # noqa: E402

FLEETS = ((16, "64amd64-4s2n4ca2co", 2), (64, "256ia64-64n2s2c", 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--intervals", default="5,2", help="monitor.interval_s values")
    parser.add_argument("--instances", default="16,64", help="fleet sizes, among 16 and 64")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mon-", dir="/tmp"))
    calib = calibration(tmp / "cal.json", 10.0)
    assets = shared_assets(calib)
    sizes = {int(x) for x in args.instances.split(",")}
    for count, capture, per_node in (fleet for fleet in FLEETS if fleet[0] in sizes):
        fsroot = unpack(capture, tmp / "captures")
        for interval in (float(x) for x in args.intervals.split(",")):
            door = Door(f"mon{count}", fsroot, per_node, 1, "prefix", False, *assets, calib, 512, interval)
            try:
                t0 = time.monotonic()
                door.wait_ready(count, 1, timeout_s=300)
                ready = time.monotonic() - t0
                time.sleep(interval * 2)
                p = psutil.Process(door.proc.pid)
                c0, w0 = sum(p.cpu_times()[:2]), time.monotonic()
                time.sleep(args.seconds)
                c1, w1 = sum(p.cpu_times()[:2]), time.monotonic()
                print(f"{count} instances, monitor.interval_s {interval:g}: daemon CPU "
                      f"{100 * (c1 - c0) / (w1 - w0):.1f} % of a core at rest, "
                      f"{1000 * (c1 - c0) / ((w1 - w0) / interval):.0f} ms a pass; ready in {ready:.0f} s", flush=True)
            finally:
                door.stop()


if __name__ == "__main__":
    main()
