#!/usr/bin/env python3
"""One instance on the host, restarted under load (issue 40): the real daemon (process
backend), HAProxy and llama-server with the generated medium model, one instance
(`placement.nodes = [0]`), 4 clients sending one request after another (half of them
streaming, 12 tokens each). Per case, in one run: `numa-infer restart`, a new model file
moved into place (`mv`), and kill -9 of the instance. For each: the requests sent, those
that failed (and how many of them were 503s), the longest a request took, the median, and
whether the daemon held the model's requests (the journal's line).

    .venv/bin/python bench/hold.py [--cases restart,mv,kill]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.daemon_harness import DaemonRun, daemons, generated_model, shared_dir  # noqa: E402
from tests.e2e.test_frontdoor import Load, healthy_behind_frontdoor  # noqa: E402

HOLD_LINE = "(hold, up to frontend.queue_timeout_s"


def _case(run: DaemonRun, act: Callable[[int], None]) -> str:
    state = healthy_behind_frontdoor(run, count=1)
    (old,) = [i["pid"] for i in state["instances"]]
    load = Load(run.frontend_port, clients=4, per_client=100_000, max_tokens=12).start()
    time.sleep(3.0)  # serving under load first
    act(old)
    run.wait(lambda s: s["instances"][0]["pid"] not in (None, old) and s["instances"][0]["state"] == "healthy"
             and s["instances"][0].get("rotation") == "UP", 180, "the instance back")
    time.sleep(3.0)
    load.stop()
    outcomes = load.wait()
    failed = [o for o in outcomes if not o.complete]
    seconds = sorted(o.seconds for o in outcomes)
    held = "hold" if HOLD_LINE in run.logs() else "none said"
    return (f"{len(outcomes):5d} requests  {len(failed):4d} failed ({sum(o.status == 503 for o in failed)} of them 503)"
            f"  longest {seconds[-1]:5.2f} s  p50 {statistics.median(seconds):5.2f} s  ({held})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="restart,mv,kill")
    args = parser.parse_args()
    source = generated_model("medium")
    print("one instance, 4 clients, llama-server, medium model:")
    for case in args.cases.split(","):
        model = shared_dir() / f"hold-bench-{os.getpid()}.gguf"
        model.write_bytes(source.read_bytes())
        model.chmod(0o644)
        with tempfile.TemporaryDirectory() as tmp, daemons(Path(tmp), model) as start:
            run = start(engine="llama-server", placement="nodes = [0]")

            def act(pid: int, case: str = case, run: DaemonRun = run, model: Path = model) -> None:
                if case == "restart":
                    assert run.cli("restart", "--timeout", "120").returncode == 0
                elif case == "mv":
                    staged = model.with_name(model.name + ".new")
                    staged.write_bytes(model.read_bytes())
                    staged.chmod(0o644)
                    os.replace(staged, model)
                else:
                    os.kill(pid, signal.SIGKILL)
            print(f"  {case:8s} {_case(run, act)}")
        model.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
