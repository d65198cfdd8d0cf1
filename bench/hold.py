#!/usr/bin/env python3
"""One instance on the host, restarted under load (issue 40): the real daemon (process
backend), HAProxy and llama-server with the generated medium model, one instance
(`placement.nodes = [0]`), 4 clients sending one request after another (half of them
streaming, 12 tokens each). Per case, in one run: `numa-infer restart` (a surge where the
memory allows, the default), the same with `frontend.surge = false` (a hold), a new model
file moved into place (`mv`), and kill -9 of the instance (a repair: always a hold). For
each: the requests sent, those that failed (and how many of them were 503s), the longest
a request took, the median, and how the daemon covered the restart (status's
`restart_cover`: surge or hold).

`kill-sdk`: kill -9 again, with 4 of OpenAI's own clients as the only load, so that the
request the killed process was answering is one of theirs.

A fifth client in the other cases is OpenAI's own Python client with its defaults (non-streaming; it sends a
502 or a refused connection again, twice, after a backoff): what it saw, on its own line.

For a surge, also the cost of the overlap: the clients' tokens per second per request
(12 tokens / its time) for the requests that ended while the copy started beside the
instance (both on the same CPUs), against those that ended in the seconds before.

    .venv/bin/python bench/hold.py [--cases restart,restart-hold,mv,kill,kill-sdk]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.daemon_harness import DaemonRun, daemons, generated_model, shared_dir  # noqa: E402
from tests.e2e.test_frontdoor import Load, SdkClient, healthy_behind_frontdoor  # noqa: E402

class Phases(threading.Thread):
    """When the instance's surge entered each phase, from status (`restart_cover`), every 0.1 s."""

    def __init__(self, run: DaemonRun) -> None:
        super().__init__(daemon=True)
        self.run_ = run
        self.seen: dict[str, float] = {}
        self.cover = ""
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            state = self.run_.state()
            said = (state or {}).get("instances", [{}])[0].get("restart_cover") or ""
            self.cover = said or self.cover
            for phase in ("starting", "joining", "serving", "leaving", "done"):
                if f": {phase}" in said or f"({phase}" in said:
                    self.seen.setdefault(phase, time.monotonic())


def _rate(outcomes: list, start: float, end: float) -> tuple[float | None, int]:
    """Median tokens/s per request, for the complete requests answered within [start, end]
    (a request of ~2 s ran mostly in a window of a few seconds that it ended in)."""
    rates = [o.tokens / o.seconds for o in outcomes if o.complete and start <= o.started + o.seconds <= end
             and o.seconds > 0]
    return (statistics.median(rates) if rates else None), len(rates)


def _sdk_case(run: DaemonRun, act: Callable[[int], None]) -> str:
    """`act` with 4 of OpenAI's own clients (defaults: non-streaming here, a 502 sent again
    twice after a backoff) as the only load: the request the killed process had is one of theirs."""
    state = healthy_behind_frontdoor(run, count=1)
    (old,) = [i["pid"] for i in state["instances"]]
    clients = [SdkClient(run.frontend_port) for _ in range(4)]
    for client in clients:
        client.start()
    time.sleep(4.0)
    act(old)
    run.wait(lambda s: s["instances"][0]["pid"] not in (None, old) and s["instances"][0]["state"] == "healthy"
             and s["instances"][0].get("rotation") == "UP", 180, "the instance back")
    time.sleep(3.0)
    for client in clients:
        client.done.set()
    for client in clients:
        client.join(120)
    seconds = sorted(t for c in clients for t in c.seconds)
    failed = [f for c in clients for f in c.failed]
    return (f"{len(seconds) + len(failed):5d} requests  {len(failed):4d} failed  longest {seconds[-1]:5.2f} s  "
            f"p50 {statistics.median(seconds):5.2f} s  (4 OpenAI clients, max_retries = 2)"
            + (f"\n           {failed[:2]}" if failed else ""))


def _case(run: DaemonRun, act: Callable[[int], None]) -> str:
    state = healthy_behind_frontdoor(run, count=1)
    (old,) = [i["pid"] for i in state["instances"]]
    load = Load(run.frontend_port, clients=4, per_client=100_000, max_tokens=12).start()
    sdk = SdkClient(run.frontend_port)  # a fifth client: OpenAI's own, with its default retries
    sdk.start()
    time.sleep(4.0)  # serving under load first
    phases = Phases(run)
    phases.start()
    acted = time.monotonic()
    act(old)
    run.wait(lambda s: s["instances"][0]["pid"] not in (None, old) and s["instances"][0]["state"] == "healthy"
             and s["instances"][0].get("rotation") == "UP" and "starting" not in (s["instances"][0].get(
                 "restart_cover") or "") and "serving)" not in (s["instances"][0].get("restart_cover") or ""),
             180, "the instance back")
    time.sleep(3.0)
    phases.done.set()
    load.stop()
    sdk.done.set()
    outcomes = load.wait()
    sdk.join(120)
    failed = [o for o in outcomes if not o.complete]
    seconds = sorted(o.seconds for o in outcomes)
    cover = phases.cover.split(":")[0] or "none said"
    line = (f"{len(outcomes):5d} requests  {len(failed):4d} failed ({sum(o.status == 503 for o in failed)} of them 503)"
            f"  longest {seconds[-1]:5.2f} s  p50 {statistics.median(seconds):5.2f} s  ({cover})"
            f"\n           OpenAI's client (max_retries = 2): {sdk.answered} answered, {len(sdk.failed)} failed")
    if cover == "surge" and "starting" in phases.seen:
        alone, n_alone = _rate(outcomes, acted - 4.0, acted)
        overlap_end = phases.seen.get("serving", phases.seen.get("joining", time.monotonic()))
        shared, n_shared = _rate(outcomes, phases.seen["starting"], overlap_end)
        if alone and shared:
            line += (f"\n           while its copy started ({overlap_end - phases.seen['starting']:.1f} s): "
                     f"{shared:.1f} tok/s per request ({n_shared} requests) vs {alone:.1f} alone ({n_alone}): "
                     f"{shared / alone:.2f}x")
        else:
            line += f"\n           overlap {overlap_end - phases.seen['starting']:.1f} s: too short for a request"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="restart,restart-hold,mv,kill,kill-sdk")
    args = parser.parse_args()
    source = generated_model("medium")
    print("one instance, 4 clients, llama-server, medium model:")
    for case in args.cases.split(","):
        model = shared_dir() / f"hold-bench-{os.getpid()}.gguf"
        model.write_bytes(source.read_bytes())
        model.chmod(0o644)
        with tempfile.TemporaryDirectory() as tmp, daemons(Path(tmp), model) as start:
            surge = "surge = false\n" if case == "restart-hold" else ""
            run = start(engine="llama-server", placement="nodes = [0]",
                        frontend=f'listen = "127.0.0.1:{{port}}"\n{surge}')

            def act(pid: int, case: str = case, run: DaemonRun = run, model: Path = model) -> None:
                if case.startswith("restart"):
                    assert run.cli("restart", "--timeout", "120").returncode == 0
                elif case == "mv":
                    staged = model.with_name(model.name + ".new")
                    staged.write_bytes(model.read_bytes())
                    staged.chmod(0o644)
                    os.replace(staged, model)
                else:
                    os.kill(pid, signal.SIGKILL)
            print(f"  {case:8s} {(_sdk_case if case.endswith('-sdk') else _case)(run, act)}")
        model.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
