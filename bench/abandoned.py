#!/usr/bin/env python3
"""Clients that leave non-streaming requests (issue 39, part 4), side by side in one run:
HAProxy on numa-infer's own haproxy.cfg in front of one real llama-server (the generated
medium model, 1 thread, `server.parallel` slots), without and with the daemon's watch
(`frontdoor/abandon_watch.py`, the same class the daemon runs).

N clients each send a non-streaming completion that would take about `--seconds` to
generate, and close their connection `--leave-after` seconds later without reading. Per
case: how many requests reached the instance (HAProxy's counter: a queued one whose client
left is still sent without the watch), how long the instance kept computing after the last
client left (until its CPU use falls idle), and the CPU seconds it spent meanwhile. The
instance's own CPU time is the measure so that nothing asks the engine anything while it
decides (a /slots read delays its check of a closed connection: docs/frontdoor.md).

    .venv/bin/python bench/abandoned.py [--clients 20] [--seconds 30] [--leave-after 1]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numad_infer.config.load import parse_config  # noqa: E402
from numad_infer.config.models import served_models as served_of  # noqa: E402
from numad_infer.engines import engine_of  # noqa: E402
from numad_infer.frontdoor.abandon_watch import AbandonWatch  # noqa: E402
from numad_infer.frontdoor.checked_config import put_lua  # noqa: E402
from numad_infer.frontdoor.haproxy import RuntimeAPI  # noqa: E402
from numad_infer.frontdoor.haproxy_config import paths_in, render_haproxy  # noqa: E402
from tests.daemon_harness import free_port_block, generated_model, llama_server_binary, wait_for  # noqa: E402
from tests.e2e.test_abandoned import ask_then_leave  # noqa: E402
from tests.frontdoor.harness import HAPROXY, plan_for  # noqa: E402

IDLE_CPU = 0.05  # CPU seconds per second under which the instance counts as idle
LIMIT_S = 900.0  # the longest a case waits for the instance to fall idle


class _Door:
    """What AbandonWatch reads of the daemon's front door."""

    def __init__(self, listen: str, api: RuntimeAPI) -> None:
        self.listen, self.api = listen, api
        # HAProxy runs as this user here: the connections it accepts are this user's.
        self.runner = types.SimpleNamespace(haproxy_uids=frozenset({0, os.getuid()}))


def _idle_after(proc: psutil.Process, since: float) -> tuple[float, float]:
    """(seconds from `since` until the process's CPU use fell idle, its CPU seconds meanwhile)."""
    start_cpu = sum(proc.cpu_times()[:2])
    last = start_cpu
    while time.monotonic() - since < LIMIT_S:
        time.sleep(0.25)
        now = sum(proc.cpu_times()[:2])
        if now - last < IDLE_CPU * 0.25:
            return time.monotonic() - 0.25 - since, now - start_cpu
        last = now
    return float("inf"), last - start_cpu


def _case(watch_on: bool, args: argparse.Namespace, tmp: Path, model: Path) -> str:
    base = free_port_block(2)
    config = parse_config(f'[model]\npath = "{model}"\ncontext_size = 1024\n[placement]\nnodes = [0]\n'
                          f'[server]\nbase_port = {base + 1}\nparallel = {args.parallel}\n'
                          f'[frontend]\nlisten = "127.0.0.1:{base}"\n', "/etc/numa-infer.toml")
    plan = plan_for(tmp / f"plan-{watch_on}", config)
    instance = plan.instances[0]
    paths = paths_in(tmp / f"run-{watch_on}", tmp / f"run-{watch_on}" / "haproxy.sock")
    paths.config.parent.mkdir(parents=True)
    put_lua(paths)
    paths.state.write_text("1\n")
    text = render_haproxy(config, plan, paths, served=served_of(config), engine=engine_of(config))
    # One instance only (the plan is for a 2-node stand-in machine): the others' server lines
    # out (the surge and hold servers stay: the pick's use-server rules name them).
    others = [f":{i.port}" for i in plan.instances if i is not instance]
    text = "\n".join(line for line in text.splitlines()
                     if not (line.lstrip().startswith("server ") and any(line.endswith(o) for o in others))) + "\n"
    paths.config.write_text(text)
    server = subprocess.Popen([str(llama_server_binary()), "--model", str(model), "--host", "127.0.0.1",
                               "--port", str(instance.port), "--ctx-size", str(1024 * args.parallel),
                               "--parallel", str(args.parallel), "--threads", "1", "--threads-batch", "1",
                               "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    errors = tmp / f"haproxy-{watch_on}.err"
    haproxy = subprocess.Popen([HAPROXY, "-db", "-f", str(paths.config)], stdout=subprocess.DEVNULL,
                               stderr=errors.open("w"))
    api = RuntimeAPI(str(paths.socket))
    watch = AbandonWatch(_Door(f"127.0.0.1:{base}", api))
    try:
        wait_for(lambda: api.backend("instances").instances and all(  # the surge and hold servers aside
            s.status == "UP" for s in api.backend("instances").instances.values()), "the instance UP", 180,
            detail=lambda: errors.read_text()[-2000:])
        if watch_on:
            watch.start()
        clients = [threading.Thread(target=ask_then_leave, args=(base, False, args.tokens, args.leave_after))
                   for _ in range(args.clients)]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
        left = time.monotonic()
        busy_s, cpu_s = _idle_after(psutil.Process(server.pid), left)
        reached = sum(s.served for s in api.backend("instances").servers.values())
    finally:
        watch.stop()
        for proc in (haproxy, server):
            proc.kill()
            proc.wait()
    name = "with the watch" if watch_on else "HAProxy alone"
    busy = f"{busy_s:6.1f} s" if busy_s != float("inf") else f">{LIMIT_S:.0f} s"
    return (f"{name:15s} reached the instance {reached:3d} of {args.clients}   busy after the last client left "
            f"{busy}   CPU {cpu_s:6.1f} s   per request that reached it {cpu_s / max(reached, 1):5.2f} s   "
            f"stopped by the watch {sum(watch.ended.values())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0, help="what a request would take alone, about")
    parser.add_argument("--leave-after", type=float, default=1.0)
    parser.add_argument("--cases", default="off,on")
    args = parser.parse_args()
    model = generated_model("medium")
    # Tokens a request asks: --seconds of decoding at the rate measured here first.
    args.tokens = max(16, int(args.seconds * _tokens_per_s(model)))
    print(f"# {args.clients} clients, each leaves a non-streaming request after {args.leave_after:g} s; one "
          f"llama-server, medium model, 1 thread, {args.parallel} slots; {args.tokens} tokens asked "
          f"(~{args.seconds:g} s alone)")
    with tempfile.TemporaryDirectory(prefix="numa-infer-abandoned-") as tmp:
        for case in args.cases.split(","):
            print(_case(case == "on", args, Path(tmp), model), flush=True)


def _tokens_per_s(model: Path) -> float:
    port = free_port_block(1)
    server = subprocess.Popen([str(llama_server_binary()), "--model", str(model), "--host", "127.0.0.1",
                               "--port", str(port), "--ctx-size", "1024", "--threads", "1", "--no-webui"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import urllib.request
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200,
                 "llama-server", 180)
        body = json.dumps({"prompt": "Once upon a time", "n_predict": 64, "ignore_eos": True}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body),
                                    timeout=120) as answer:
            return float(json.loads(answer.read())["timings"]["predicted_per_second"])
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
