#!/usr/bin/env python3
"""A chaos soak that counts: steady client load through the front door while one random
fault strikes every few seconds; prints what the clients saw and how fast the fleet healed.

    .venv/bin/python bench/chaos.py [--minutes 10] [--every 8] [--clients 4] [--seed 1]
                                    [--faults kill-instance,drip-admin,...] [--stop-s 20] [--drip-s 20]
                                    [--models 2]

Real daemon (process backend), real llama-cpp-python servers (the test harness's engine)
on a tiny generated model, real HAProxy, the fake 2-node topology of the host tests
(node 0 = CPU 0, node 1 = CPU 1). Every fault kind chosen strikes once, in a random
order, then random ones; the next strikes only once the fleet healed from the last.

--models 2 (issue 31): two [[models]], alpha on node 0 and beta on node 1 (one instance
each), the clients split between them, each asking its model by name. Every count is kept
per model; a fault on an instance is put down to that instance's model, and the requests of
the other model that failed after it are counted on a line of their own (goal 0).
reload-one then drops beta's table and restores it.

The faults:
- kill-instance: SIGKILL of an instance;
- stop-instance: SIGSTOP of an instance, SIGCONT after --stop-s;
- affinity-drift: every thread of an instance allowed both CPUs;
- memory-drift: migratepages of an instance (the host has one real node: a reading only);
- reload-one: a reload that drops node 1's instance, then one that plans it again;
- reload-invalid: a reload of a file that is not TOML;
- kill-haproxy: SIGKILL of HAProxy;
- kill-daemon: SIGKILL of the daemon, respawned after 1 s as a supervisor would (under
  the process backend the instances die with it (PDEATHSIG): an outage by design, its
  failures counted apart);
- drip-admin: for --drip-s, HAProxy's admin socket (the daemon's runtime API) is a server
  that answers one byte every 1.9 s (under the API's 2 s deadline); HAProxy serves on,
  so no request should fail;
- drip-instance: for --drip-s, one instance answers its liveness route (the daemon's probe
  and HAProxy's check) with a header one byte every 0.9 s (under the probe's 1 s timeout);
  its other routes serve on. The instances then run behind a relay in their own process
  (bench/drip_relay.py says how, and what that changes).

Besides what the clients saw, the soak watches the daemon's state file (every 0.1 s) and
reports, per fault kind, the longest gap between two status updates from the strike until
the heal, against a goal of 2 x monitor.interval_s + tuning.probe_timeout_s: a pass held
by a peer shows there. A fault counts as healed on the first pass that began after it
was over (for the drip faults: after the peer stopped dripping) and found the fleet whole.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numad_infer.backends.process import SOCKET_DIR_NAME  # noqa: E402
from numad_infer.engines.llama_cpp_python import LlamaCppPython  # noqa: E402
from numad_infer.frontdoor.haproxy import RuntimeAPI  # noqa: E402
from tests import daemon_harness  # noqa: E402
from tests.daemon_harness import DaemonRun, generated_model, shared_dir  # noqa: E402
from tests.peers import Peer, drip  # noqa: E402

FAULTS = ("kill-instance", "stop-instance", "affinity-drift", "reload-one", "reload-invalid", "kill-haproxy",
          "kill-daemon", "memory-drift", "drip-admin", "drip-instance")

# A drip is one byte just before a timeout per receive would fire: only a deadline for the
# whole call ends it (numad_infer/util/peer.py).
ADMIN_DRIP_EVERY_S = 0.95 * RuntimeAPI("").timeout_s  # the front door's runtime API deadline: 2 s
PROBE_TIMEOUT_S = 1.0  # the harness's tuning.probe_timeout_s (read back from its config for the goal)
INSTANCE_DRIP_EVERY_S = 0.9 * PROBE_TIMEOUT_S
SAMPLE_EVERY_S = 0.1  # how often the watcher reads the state file


@dataclass
class Tally:
    """What the clients saw, under one lock."""
    sent: int = 0
    ok: int = 0
    before_first_byte: Counter = field(default_factory=Counter)  # cause -> count
    in_flight: Counter = field(default_factory=Counter)
    cut_streams: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    fault: str = "none"  # the fault struck last: the likely cause of what fails now
    # --models 2: the model these requests ask for, and the model whose instance the last
    # fault struck ("" for a fault on what every model shares: HAProxy, the daemon, reloads).
    model: str = ""
    fault_model: str = ""
    other_model_failed: Counter = field(default_factory=Counter)  # failures during another model's fault
    own_model_failed: int = 0  # failures after a fault on an instance of this very model

    def strike(self, fault: str, model: str = "") -> None:
        """A fault struck (on an instance of `model`, when it names one)."""
        with self.lock:
            self.fault, self.fault_model = fault, model

    def add(self, outcome: str, cause: str = "") -> bool:
        """Count one outcome; True when the request was answered in full."""
        with self.lock:
            self.sent += 1
            if outcome != "ok" and self.fault_model and self.fault_model != self.model:
                self.other_model_failed[f"{cause or outcome} (after {self.fault} of {self.fault_model})"] += 1
            elif outcome != "ok" and self.fault_model:
                self.own_model_failed += 1
            if outcome == "ok":
                self.ok += 1
            elif outcome == "before":
                self.before_first_byte[f"{cause} (after {self.fault})"] += 1
            elif outcome == "in-flight":
                self.in_flight[f"{cause} (after {self.fault})"] += 1
            else:
                self.cut_streams += 1
                self.in_flight[f"stream cut without finish_reason (after {self.fault})"] += 1
        return outcome == "ok"


def one_request(port: int, stream: bool, tally: Tally) -> bool:
    """One completion; with --models 2 it names the tally's model."""
    asked = {"prompt": "numa node", "max_tokens": 16, "temperature": 0, "stream": stream}
    body = json.dumps(asked | ({"model": tally.model} if tally.model else {})).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    got_bytes = False
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            if not stream:
                got_bytes = True
                json.loads(response.read())
                return tally.add("ok")
            finished = False
            for raw in response:
                got_bytes = True
                line = raw.decode().strip()
                if line.startswith("data: {") and '"finish_reason": "' in line.replace('":"', '": "'):
                    finished = True
            return tally.add("ok" if finished else "cut")
    except urllib.error.HTTPError as exc:
        return tally.add("before", f"HTTP {exc.code}")
    # A body cut short (IncompleteRead) is an HTTPException, not an OSError: a client thread
    # must count it, not die of it.
    except (OSError, ValueError, http.client.HTTPException) as exc:
        cause = type(exc).__name__ if not isinstance(exc, urllib.error.URLError) else f"{exc.reason}"
        return tally.add("in-flight" if got_bytes else "before", str(cause)[:60])


def client(port: int, stream: bool, tally: Tally, stop: threading.Event) -> None:
    while not stop.is_set():
        if not one_request(port, stream, tally):
            # As OpenAI's clients do: wait before trying again (the front door's 503 says
            # Retry-After: 1), rather than counting thousands of refusals a second.
            time.sleep(1.0)


@dataclass
class Strike:
    """One fault, from its strike to its heal (wall clock throughout, as the status is)."""
    fault: str
    at: float
    detail: str = ""
    target: str = ""  # the instance struck, by name
    model: str = ""  # --models 2: the model whose instance was struck ("" for what all share)
    end: Callable[[], str] | None = None  # ends a fault that lasts (a peer's drip); says what the peer did
    over: float = 0.0  # when the fault was over: `at`, or when the peer stopped dripping
    until: float = 0.0  # when the heal was seen, or given up on
    healed: bool = False
    heal_s: float = 0.0  # from `over` to the heal (monotonic clock)


@dataclass
class Publish:
    updated_at: float
    state: dict[str, Any]


class Watcher:
    """Reads the state file every SAMPLE_EVERY_S and keeps each new publish (a new
    updated_at). Two publishes within one sample are seen as one: a gap read here is never
    shorter than the daemon's."""

    def __init__(self, run: DaemonRun) -> None:
        self.run = run
        self.publishes: list[Publish] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        last = None
        while not self.stop.wait(SAMPLE_EVERY_S):
            state = self.run.state()
            updated = (state or {}).get("daemon", {}).get("updated_at")
            if state is not None and updated is not None and updated != last:
                last = updated
                self.publishes.append(Publish(updated, state))

    def longest_gap(self, start: float, end: float) -> float | None:
        """The longest time between two consecutive publishes, of those where the later one
        came in (start, end]: a gap the daemon was in while a fault was (the one the strike
        fell in too)."""
        times = sorted({p.updated_at for p in self.publishes})
        gaps = [b - a for a, b in itertools.pairwise(times) if start < b <= end]
        return max(gaps) if gaps else None

    def passes(self, start: float, end: float) -> list[dict[str, Any]]:
        """The states of the passes that began in [start, end]."""
        return [p.state for p in self.publishes
                if start <= (p.state["daemon"].get("pass_started_at") or 0) <= end]


class Chaos:
    def __init__(self, run: DaemonRun, rng: random.Random, stop_s: float, flags: Path | None,
                 dropped_model: str = "") -> None:
        """`dropped_model`: with --models 2, the [[models]] table reload-one drops and restores."""
        self.run, self.rng, self.stop_s = run, rng, stop_s
        self.flags = flags  # where drip_relay.py looks for its flag files (None: no relay)
        self.good_config = run.config.read_text()
        self.dropped_model = dropped_model
        self.model = ""  # the model whose instance the strike under way hit

    def instances(self) -> list[dict]:
        return (self.run.state() or {"instances": []})["instances"]

    def _reload_without(self, run, smaller: str) -> None:
        """A reload to a configuration with one instance fewer, then, once it is gone, back
        to the whole one, so that the next fault meets the whole fleet."""
        run.config.write_text(smaller)
        os.kill(run.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(self.instances()) != 1:
            time.sleep(0.1)
        run.config.write_text(self.good_config)
        os.kill(run.proc.pid, signal.SIGHUP)

    def some_pid(self) -> int | None:
        running = [i for i in self.instances() if i.get("pid")]
        if not running:
            return None
        inst = self.rng.choice(running)
        self.model = inst.get("model") or ""
        return int(inst["pid"])

    def strike(self, fault: str) -> Strike:
        struck = Strike(fault, time.time())
        self.model = ""
        if fault == "drip-admin":
            self.drip_admin(struck)
        elif fault == "drip-instance":
            self.drip_instance(struck)
        else:
            struck.detail = self.strike_once(fault)
        struck.model = self.model
        return struck

    def strike_once(self, fault: str) -> str:
        run = self.run
        if fault in ("kill-instance", "stop-instance", "affinity-drift", "memory-drift"):
            pid = self.some_pid()
            if pid is None:
                return "no instance running"
            if fault == "kill-instance":
                os.kill(pid, signal.SIGKILL)
            elif fault == "stop-instance":
                os.kill(pid, signal.SIGSTOP)
                threading.Timer(self.stop_s, lambda: _signal(pid, signal.SIGCONT)).start()
            elif fault == "affinity-drift":
                for tid in os.listdir(f"/proc/{pid}/task"):
                    _try(lambda: os.sched_setaffinity(int(tid), {0, 1}))
            else:
                # The host has one real node: a "remote" page cannot be made here, so this is
                # the daemon's memory reading under a migrate_pages it did not ask for.
                _try(lambda: os.system(f"migratepages {pid} 0 0 >/dev/null 2>&1"))
            return f"pid {pid}" + (f" ({self.model})" if self.model else "")
        if fault == "reload-one" and self.dropped_model:
            # Two models: a reload that removes one model (its instances drain and stop; the
            # other's stay, same pid and port), then one that adds it back.
            self.model = self.dropped_model
            table = model_table(self.good_config, self.dropped_model)
            self._reload_without(run, self.good_config.replace(table, ""))
            return f"model {self.dropped_model} dropped, back"
        if fault == "reload-one":
            # The host's fake nodes have one CPU each, so no reload can change one instance's
            # CPUs alone: drop node 1 (its instance leaves, finishing its requests), then plan
            # it again once it is gone, so the next fault meets the whole fleet.
            self._reload_without(run, self.good_config.replace("[placement]\n", "[placement]\nnodes = [0]\n"))
            return "node 1 dropped, back"
        if fault == "reload-invalid":
            current = run.config.read_text()
            run.config.write_text(current + "\n[placement\n")
            os.kill(run.proc.pid, signal.SIGHUP)
            time.sleep(1.0)
            run.config.write_text(current)  # the next reload (if any) reads a good file again
            return "invalid TOML"
        if fault == "kill-haproxy":
            for proc in psutil.Process(run.proc.pid).children():
                if proc.name() == "haproxy":
                    proc.kill()
                    return f"pid {proc.pid}"
            return "no haproxy running"
        if fault == "kill-daemon":
            run.proc.kill()
            run.proc.wait()
            time.sleep(1.0)  # a supervisor's RestartSec
            run.proc = run.spawn()
            return "daemon respawned"
        raise ValueError(fault)

    def drip_admin(self, struck: Strike) -> None:
        """The front door's user (who owns the socket's directory) puts a dripping server
        where the daemon's runtime API connects. The real socket is renamed aside, not
        removed: HAProxy keeps serving on it (the bound inode, not the name, is the socket),
        and clients never use it, so no request should fail."""
        admin = self.run.state_file.parent / SOCKET_DIR_NAME / "admin.sock"
        aside = admin.with_name(admin.name + ".real")
        os.rename(admin, aside)
        try:
            peer = Peer(drip(b"", b"# pxname,svname\n", ADMIN_DRIP_EVERY_S), unix_path=admin)
        except OSError:
            os.rename(aside, admin)
            raise
        ours = admin.stat().st_ino

        def end() -> str:
            try:
                mine = admin.stat().st_ino == ours
            except FileNotFoundError:
                mine = True
            if mine:
                os.rename(aside, admin)  # the real one back, in one step: never a moment without a socket
            else:  # a HAProxy started meanwhile made a new socket there: the old one is stale
                aside.unlink(missing_ok=True)
            peer.close()
            return f"{peer.connections} runtime API call(s) dripped to, {peer.sent} byte(s)"

        struck.detail, struck.end = f"{ADMIN_DRIP_EVERY_S:g}s a byte", end

    def drip_instance(self, struck: Strike) -> None:
        """One instance's liveness route drips (drip_relay.py, in the instance's own process)."""
        assert self.flags is not None, "drip-instance needs the relay"
        running = [i for i in self.instances() if i.get("pid")]
        if not running:
            struck.detail = "no instance running"
            return
        inst = self.rng.choice(running)
        self.model = inst.get("model") or ""
        flag = self.flags / f"drip-{inst['port']}"
        flag.touch()

        def end() -> str:
            flag.unlink(missing_ok=True)
            return ""

        struck.detail, struck.target, struck.end = f"{inst['name']} port {inst['port']}", inst["name"], end

    def healed(self, since: float) -> bool:
        """A live daemon's pass that began after `since` (wall clock) found all planned
        instances healthy, undrifted and in rotation, the front door up. A pass that read
        /proc before the fault and published after it says nothing about the fault."""
        state = self.run.state()
        if (not state or state["daemon"]["state"] != "running" or (state["daemon"].get("pass_started_at") or 0) <= since
                or self.run.proc.poll() is not None):
            return False
        front = state.get("frontdoor")
        return (len(state["instances"]) == 2 and front is not None and front["up"]
                and all(i["state"] == "healthy" and not i["drifting"] and i.get("rotation") == "UP"
                        for i in state["instances"]))


def what_status_said(struck: Strike, watcher: Watcher) -> str:
    """What the daemon published of a drip while it lasted: the fault was real, and seen."""
    passes = watcher.passes(struck.at, struck.over)
    longest = max((s["daemon"].get("pass_duration_s") or 0 for s in passes), default=0.0)
    said: Counter = Counter()
    if struck.fault == "drip-admin":
        admin = str(watcher.run.state_file.parent / SOCKET_DIR_NAME / "admin.sock")
        for state in passes:
            front = state.get("frontdoor") or {}
            if not front.get("up"):
                said[(front.get("error") or "no error said").replace(admin, "admin.sock")] += 1
        return f"front door not up in {sum(said.values())} of {len(passes)} passes" + (
            f" ({', '.join(f'{e!r} x{n}' for e, n in said.most_common(2))})" if said else "") + (
            f", the longest pass {longest:.2f}s")
    if struck.fault == "drip-instance":
        pids = set()
        for state in passes:
            inst = next((i for i in state["instances"] if i["name"] == struck.target), None)
            if inst is None:
                continue
            pids.add(inst.get("pid"))
            if inst["state"] != "healthy":
                said[f"{inst['state']}: {inst.get('error') or ''}"] += 1
        return (f"{struck.target} not healthy in {sum(said.values())} of {len(passes)} passes"
                + (f" ({', '.join(f'{e!r} x{n}' for e, n in said.most_common(2))})" if said else "")
                + f", {len(pids - {None})} pid(s), the longest pass {longest:.2f}s")
    return ""


def _signal(pid: int, sig: int) -> None:
    _try(lambda: os.kill(pid, sig))


def _try(action) -> None:
    try:
        action()
    except OSError:
        pass


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def placement_exact(run: DaemonRun) -> str:
    """Every thread of every instance allowed only its planned CPUs (read from /proc, not from status).
    Behind drip_relay.py (drip-instance) the relay is threads of the server's own process,
    so this still reads every thread that serves: the model's and the relay's."""
    wrong = []
    for inst in (run.state() or {"instances": []})["instances"]:
        for tid in os.listdir(f"/proc/{inst['pid']}/task"):
            allowed = os.sched_getaffinity(int(tid))
            if not allowed <= set(inst["cpus"]):
                wrong.append(f"{inst['name']} thread {tid} on {sorted(allowed)}")
    return "exact" if not wrong else "NOT exact: " + "; ".join(wrong[:4])


RELAY_WRAPPER = """#!/bin/sh
# server.python for bench/chaos.py: llama_cpp.server behind drip_relay.py for each instance,
# the real interpreter for everything else (the daemon's own checks).
if [ "$1" = "-m" ] && [ "$2" = "llama_cpp.server" ]; then
  shift 2
  exec {python} {relay} {flags} {liveness} {every} "$@"
fi
exec {python} "$@"
"""


def relayed_python(python: str) -> tuple[str, Path]:
    """A server.python that runs each instance behind drip_relay.py, and the directory of
    its flag files: in the shared directory, where the servers' user (nobody, under root)
    can read them."""
    directory = shared_dir()
    flags = directory / "drip-flags"
    flags.mkdir(mode=0o755, exist_ok=True)
    relay = directory / "drip_relay.py"
    relay.write_text((ROOT / "bench" / "drip_relay.py").read_text())
    wrapper = directory / "relayed-python"
    wrapper.write_text(RELAY_WRAPPER.format(python=python, relay=relay, flags=flags,
                                            liveness=LlamaCppPython.liveness_path, every=INSTANCE_DRIP_EVERY_S))
    for path in (relay, wrapper):
        path.chmod(0o755)
    return str(wrapper), flags


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=8.0, help="seconds between faults")
    parser.add_argument("--clients", type=int, default=4, help="half of them stream")
    parser.add_argument("--stop-s", type=float, default=20.0, help="how long a SIGSTOPped instance stays stopped")
    parser.add_argument("--drip-s", type=float, default=20.0, help="how long a peer drips (drip-admin, drip-instance)")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help="the fault kinds, comma-separated (each strikes once first, then random ones); "
                             "default: all of " + ",".join(FAULTS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--models", type=int, choices=(1, 2), default=1,
                        help="2: two [[models]] (alpha on node 0, beta on node 1), the clients split between them "
                             "by name, counts per model")
    args = parser.parse_args()
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if not faults or set(faults) - set(FAULTS):
        parser.error(f"--faults: unknown {sorted(set(faults) - set(FAULTS))}; known: {', '.join(FAULTS)}")
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-chaos-"))
    (tmp / "d").mkdir()
    flags = None
    if "drip-instance" in faults:
        wrapper, flags = relayed_python(daemon_harness.server_python())
        daemon_harness.server_python = lambda: wrapper  # what DaemonRun's config names as server.python
    two = args.models == 2
    run = DaemonRun(tmp / "d", generated_model("tiny"), interval_s=1.0, monitor="max_restarts = 1000", backoff_s=0.5,
                    models=TWO_MODELS if two else "")
    names = MODEL_NAMES if two else ("",)
    tallies = {name: Tally(model=name) for name in names}
    stop = threading.Event()
    strikes: list[Strike] = []
    watcher: Watcher | None = None
    current: Strike | None = None
    try:
        run.wait(lambda s: bool(s.get("frontdoor")) and s["frontdoor"]["up"] and len(s["instances"]) == 2
                 and all(i["state"] == "healthy" and i.get("rotation") == "UP" for i in s["instances"]), 180, "ready")
        watcher = Watcher(run)
        chaos = Chaos(run, rng, args.stop_s, flags, dropped_model=MODEL_NAMES[1] if two else "")
        # Half of them stream; with two models, clients 0 and 1 ask alpha, 2 and 3 beta, and so on.
        clients = [threading.Thread(target=client, args=(run.frontend_port, k % 2 == 1,
                                                         tallies[names[(k // 2) % len(names)]], stop), daemon=True)
                   for k in range(args.clients)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + args.minutes * 60
        print(f"# {args.minutes:g} min, a fault every {args.every:g}s, {args.clients} clients (half streaming), "
              f"seed {args.seed}; host {os.cpu_count()} CPUs; faults {','.join(faults)}"
              + (f"; models {', '.join(names)}" if two else "")
              + ("; instances behind drip_relay.py" if flags else ""), flush=True)
        order = rng.sample(faults, len(faults))  # every kind once first, in a random order
        while time.monotonic() < deadline:
            time.sleep(args.every)
            fault = order.pop(0) if order else rng.choice(faults)
            for tally in tallies.values():
                tally.strike(fault)
            over = time.monotonic()
            current = struck = chaos.strike(fault)
            for tally in tallies.values():
                tally.strike(fault, struck.model)  # the model whose instance it hit, now it is chosen
            struck.over, said = struck.at, ""
            if struck.end is not None:  # a drip: over when the peer stops
                time.sleep(args.drip_s)
                said = struck.end()
                struck.end, struck.over, over = None, time.time(), time.monotonic()
            current = None
            # Healed: every planned instance healthy, undrifted and in rotation again, on a
            # pass that began once the fault was over. The next fault waits for it (bounded),
            # so each heal time belongs to one fault.
            time.sleep(0.5)
            while time.monotonic() - over < 180 and not (healed := chaos.healed(struck.over)):
                time.sleep(0.1)
            struck.until, struck.healed, struck.heal_s = time.time(), healed, time.monotonic() - over
            strikes.append(struck)
            took = struck.heal_s
            since = f" after the drip ({args.drip_s:g}s) ended" if fault.startswith("drip-") else ""
            time.sleep(2 * SAMPLE_EVERY_S)  # the watcher has then read the publish that showed the heal
            gap = watcher.longest_gap(struck.at, struck.until)
            print(f"{fault:<15} {struck.detail:<22} healed after {took:6.1f}s{since}; longest status gap "
                  + (f"{gap:.2f}s" if gap is not None else "-")
                  + "".join(f"; {x}" for x in (said, what_status_said(struck, watcher)) if x), flush=True)
        stop.set()
        for c in clients:
            c.join(150)
        # The final check reads a settled fleet: a pass that began after the last fault's heal.
        settled_since = time.time()
        settle_deadline = time.monotonic() + 60
        while time.monotonic() < settle_deadline and not chaos.healed(settled_since):
            time.sleep(0.2)
        placement = placement_exact(run)
        server_pids = [i["pid"] for i in run.state()["instances"]]
        haproxy = [p.pid for p in psutil.Process(run.proc.pid).children() if p.name() == "haproxy"]
        interval_s = run.state()["daemon"]["interval_s"]
    finally:
        stop.set()
        if current is not None and current.end is not None:
            current.end()  # a drip cut short by an error: the daemon stops against real peers
        if watcher is not None:
            watcher.stop.set()
        code = run.stop()
    time.sleep(1.0)
    left = [pid for pid in [*server_pids, *haproxy] if psutil.pid_exists(pid)
            and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    probe_timeout_s = tomllib.loads(run.config.read_text())["tuning"]["probe_timeout_s"]
    if two:
        for name, tally in tallies.items():
            print(f"\n## model {name}: requests that asked for it")
            report_requests(tally)
            struck = Counter(s.fault for s in strikes if s.model == name)
            print(f"faults on its instances           {sum(struck.values())}"
                  + (f"  ({', '.join(f'{f} {n}' for f, n in sorted(struck.items()))})" if struck else ""))
            print(f"its requests failed after those   {tally.own_model_failed}   (of all its failures above)")
            others = Counter()
            for other in tallies.values():
                if other is not tally:
                    others.update(other.other_model_failed)
            print(f"requests of the other model failed during its faults: {sum(others.values())}   (goal 0)")
            for cause, n in others.most_common():
                print(f"    {n:5}  {cause}")
        print("\n## the fleet")
        report_faults(strikes, watcher, faults, placement, left, code, interval_s, probe_timeout_s)
    else:
        report(tallies[""], strikes, watcher, faults, placement, left, code, interval_s, probe_timeout_s)
    return 0


MODEL_NAMES = ("alpha", "beta")
TWO_MODELS = "".join(f'[[models]]\nname = "{name}"\npath = "{{model}}"\ncontext_size = 256\nnodes = [{node}]\n'
                     for node, name in enumerate(MODEL_NAMES))


def model_table(config: str, name: str) -> str:
    """The text of the [[models]] table named `name` in `config` (up to the next table)."""
    start = config.index(f'[[models]]\nname = "{name}"\n')
    end = config.find("\n[", start + 1)
    return config[start:] if end < 0 else config[start:end + 1]


# Failures before a first byte that no front door can prevent, by the fault before them.
# The rest is the goal's count (0): a client refused or dropped while nothing was wrong
# with the request itself.
_DROPPED = ("RemoteDisconnected", "ConnectionResetError", "[Errno 104]", "[Errno 32]")


def by_design(cause: str) -> str | None:
    """Why a failure before the first byte is out of the front door's reach, or None."""
    if cause.startswith("HTTP 502") and cause.endswith("(after kill-instance)"):
        return "the JSON 502 of a request an instance died answering (never replayed: issue 19, item 1)"
    if cause.endswith("(after kill-daemon)"):
        return "the process backend's instances and HAProxy die with their daemon (PDEATHSIG): an outage by design"
    if cause.startswith("HTTP 502") and cause.endswith("(after drip-instance)"):
        return ("the JSON 502 of a request the dripping instance was answering when the daemon restarted it "
                "as hung (failed on that instance itself)")
    if cause.startswith(_DROPPED) and cause.endswith("(after kill-haproxy)"):
        return "connections a SIGKILLed HAProxy had accepted die with it"
    return None


def report(tally: Tally, strikes: list[Strike], watcher: Watcher | None, faults: list[str], placement: str,
           left: list[int], code: int | None, interval_s: float, probe_timeout_s: float) -> None:
    report_requests(tally)
    report_faults(strikes, watcher, faults, placement, left, code, interval_s, probe_timeout_s)


def report_requests(tally: Tally) -> None:
    failed_before = sum(tally.before_first_byte.values())
    failed_in = sum(tally.in_flight.values()) - tally.cut_streams
    print(f"\nrequests sent                     {tally.sent}")
    print(f"answered in full                  {tally.ok}")
    designed: Counter = Counter()
    for cause, n in tally.before_first_byte.items():
        designed[by_design(cause) or ""] += n
    print(f"failed before their first byte    {failed_before}")
    for cause, n in tally.before_first_byte.most_common():
        print(f"    {n:5}  {cause}")
    for reason, n in designed.most_common():
        if reason:
            print(f"  of which {n:5}  {reason}")
    print(f"  the rest (goal 0)               {designed['']}")
    print(f"failed in flight                  {failed_in}")
    print(f"streams cut without finish_reason {tally.cut_streams}")
    for cause, n in tally.in_flight.most_common():
        print(f"    {n:5}  {cause}")


def report_faults(strikes: list[Strike], watcher: Watcher | None, faults: list[str], placement: str,
                  left: list[int], code: int | None, interval_s: float, probe_timeout_s: float) -> None:
    unhealed = Counter(s.fault for s in strikes if not s.healed)
    print(f"faults injected / healed          {len(strikes)} / {len(strikes) - sum(unhealed.values())}"
          + (f"  not healed: {dict(unhealed)}" if unhealed else ""))
    missing = [f for f in faults if f not in {s.fault for s in strikes}]
    if missing:
        print(f"fault kinds never struck          {', '.join(missing)}  (too short a run)")
    goal = 2 * interval_s + probe_timeout_s
    print(f"heal: from the strike, or for drip-* from the end of the drip, to the first pass begun after it "
          f"that found the fleet whole;\nstatus gap: the longest between two updates of the state file from the "
          f"strike to the heal, goal <= 2 x interval_s ({interval_s:g}s) + probe_timeout_s ({probe_timeout_s:g}s) "
          f"= {goal:g}s")
    print(f"{'fault':<16}{'n':>4}{'heal p50':>10}{'heal p99':>10}{'status gap':>12}  gap goal")
    everything: list[float] = []
    for fault in FAULTS:
        mine = [s for s in strikes if s.fault == fault]
        if not mine:
            continue
        values = [s.heal_s for s in mine if s.healed]
        everything += values
        gaps = [g for s in mine if watcher is not None and (g := watcher.longest_gap(s.at, s.until)) is not None]
        gap = max(gaps) if gaps else float("nan")
        verdict = ("none: the daemon was dead" if fault == "kill-daemon"
                   else "met" if gap <= goal else "NOT met")
        print(f"{fault:<16}{len(mine):>4}{pct(values, 50):>9.1f}s{pct(values, 99):>9.1f}s{gap:>11.2f}s  {verdict}")
    print(f"{'all':<16}{len(everything):>4}{pct(everything, 50):>9.1f}s{pct(everything, 99):>9.1f}s")
    print(f"final placement                   {placement}")
    print(f"processes left after the stop     {len(left)}   (goal 0){'  ' + str(left) if left else ''}")
    print(f"daemon exit status                {code}")


if __name__ == "__main__":
    sys.exit(main())
