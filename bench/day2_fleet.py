#!/usr/bin/env python3
"""Day 2 at 16 instances over the stand-ins (issue 60, part 2): a roll-out of every
instance and a kill -9 of one, under steady load, every request's outcome counted.

The fleet is bench/monitor_fleet.py's 16 (the captured 64amd64-4s2n4ca2co, 8 nodes, 2
instances a node) as bench/fleet.py starts it: the daemon's own loop in its own process
(bench/standin/fleet_daemon.py), the real HAProxy with the rendered haproxy.cfg and Lua,
the stand-ins at bench/standin/calibration.json's rates (the medium model on this host).
The model file is a copy of the shared one in this run's own directory, so that a new one
can be moved over it.

This process sends an open-loop stream of chat requests (--rate a second, --stream-share of
them streamed, --tokens tokens each, one of 16 system prompts) through the front door,
each on its own connection; meanwhile, after --before-s:

1. the roll-out, the daemon's own mechanism: `--how mv`: a copy of the model file moved
   over the configured path (docs/models.md: the daemon sees another file, waits 5 s for it
   to hold still, and restarts every instance onto it one at a time, each drained first);
   `--how restart`: what `numa-infer restart` does (its request file beside the state file,
   then SIGUSR1; the CLI itself refuses to signal a process not named `numa-infer run`).
   Over once every instance has left the rotation and is back in it.
2. --gap-s later, once HAProxy counts a request at it (unless --no-kill-busy), the kill:
   `kill -9` of the PID the state file gives for --kill. Here every stand-in runs alone in
   a process of its own (fleet_daemon.py's --own-process all; in bench/fleet.py they share
   one): a restart gives an instance a new PID, as the daemon expects of one, and the kill
   is a real SIGKILL of one instance's process: the kernel closes its listener and
   connections, the daemon sees its PID gone.
3. --after-s more load.

Printed: requests by phase (before, roll-out, kill: from the kill until the instance is
back in rotation, after), their latency p50/p99, failures by kind (HTTP status, reset,
refused, cut: a body or stream that ended early, timeout); the roll-out's time end to
end; each instance's time out of rotation (HAProxy's own view, read every 0.2 s); the
slots busy (HAProxy's in-flight requests) meanwhile.

    .venv/bin/python bench/day2_fleet.py [--instances 16] [--slots 4] [--rate 8] [--tokens 40] \\
        [--how mv|restart] [--before-s 20] [--gap-s 10] [--after-s 20] [--kill infer@3.1] [--no-kill-busy]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fleet import Fleet, pct, shared_assets, unpack  # noqa: E402
from bench.frontdoor_capacity import chat_payload, read_response  # noqa: E402
from bench.monitor_fleet import FLEETS  # noqa: E402
from bench.standin.fleet_daemon import OWN_PROCESS_ENV  # noqa: E402
from numad_infer.frontdoor.haproxy import HaproxyError, RuntimeAPI  # noqa: E402
from numad_infer.frontdoor.routing import BACKEND  # noqa: E402
from numad_infer.supervision import restart_request  # noqa: E402

# -- the load: open loop, each request on its own connection, its outcome kept ------------------


@dataclass
class Outcome:
    sent: float  # time.monotonic()
    took: float
    kind: str  # "ok", "http 502", "reset", "refused", "cut", "timeout", or the exception's name
    stream: bool


async def ask(port: int, i: int, stream: bool, tokens: int, timeout_s: float) -> str:
    """One chat request through the front door: "ok" only for a 200 whose whole answer came
    (a stream to its [DONE], a body with its choices)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout_s)
        try:
            writer.write(chat_payload(i, None, tokens, stream))
            status, body, _ = await asyncio.wait_for(read_response(reader), timeout_s)
        finally:
            writer.close()
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except asyncio.IncompleteReadError:
        return "cut"
    except (OSError, ValueError) as exc:
        return type(exc).__name__
    if status != 200:
        return f"http {status}"
    # read_response takes a chunked body's early end for its end: the last event tells
    whole = b"data: [DONE]" in body if stream else b'"choices"' in body
    return "ok" if whole else "cut"


class Load:
    """--rate requests a second from a thread of its own (its own asyncio loop), until the
    `with` ends; each sent at its time whatever the others' (open loop)."""

    def __init__(self, port: int, args: argparse.Namespace) -> None:
        self.port, self.args = port, args
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    async def _one(self, i: int, stream: bool) -> None:
        sent = time.monotonic()
        kind = await ask(self.port, i, stream, self.args.tokens, self.args.timeout_s)
        self.outcomes.append(Outcome(sent, time.monotonic() - sent, kind, stream))

    async def _run(self) -> None:
        rng = random.Random(1)
        tasks: set[asyncio.Task[None]] = set()
        t0, i = time.monotonic(), 0
        while not self._stop.is_set():
            delay = t0 + i / self.args.rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._one(i, rng.random() < self.args.stream_share))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        await asyncio.gather(*tasks)


def phase_of(t: float, marks: dict[str, float]) -> str:
    """The phase `t` falls in: "before", or the last mark at or before it."""
    passed = [name for name, at in marks.items() if at <= t]
    return passed[-1] if passed else "before"


def phase_table(outcomes: list[Outcome], marks: dict[str, float]) -> str:
    """Requests by the phase they were sent in: count, failures by kind, latency of the answered."""
    lines = [f"{'phase':<9} {'requests':>8} {'failed':>6} {'p50 s':>6} {'p99 s':>6}  failures by kind"]
    for phase in ["before", *marks, "all"]:
        got = [o for o in outcomes if phase in ("all", phase_of(o.sent, marks))]
        ok = [o.took for o in got if o.kind == "ok"]
        kinds: dict[str, int] = {}
        for o in got:
            if o.kind != "ok":
                kinds[o.kind] = kinds.get(o.kind, 0) + 1
        lines.append(f"{phase:<9} {len(got):>8} {len(got) - len(ok):>6} {pct(ok, 0.5):>6.2f} {pct(ok, 0.99):>6.2f}  "
                     + (", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "-"))
    for o in sorted((o for o in outcomes if o.kind != "ok"), key=lambda o: o.sent)[:20]:
        phase = phase_of(o.sent, marks)
        since = o.sent - marks[phase] if phase in marks else 0.0
        lines.append(f"#   failed: {o.kind}, {'stream' if o.stream else 'whole'}, sent {since:.2f} s into "
                     f"{phase}, ended after {o.took:.2f} s")
    return "\n".join(lines)


# -- HAProxy's own view of the rotation, read every 0.2 s ------------------------------------------


class Rotation:
    """Each server's spans out of rotation (not ready and UP, HAProxy's `show stat`), and the
    requests at the instances, from a thread of its own until the `with` ends."""

    def __init__(self, socket: str, servers: list[str], every_s: float = 0.2) -> None:
        self.api, self.servers, self.every_s = RuntimeAPI(socket), servers, every_s
        self.left: dict[str, float] = {}  # server -> when it left the rotation (out now)
        self.spans: dict[str, list[tuple[float, float]]] = {s: [] for s in servers}
        self.busy: list[tuple[float, int]] = []
        self.at: dict[str, int] = {}  # server -> requests at it, as last read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> Rotation:
        self.api.backend(BACKEND)  # raises here, not silently in the thread, where the socket is wrong
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                stat = self.api.backend(BACKEND)
            except HaproxyError:
                continue  # HAProxy reloading: the next read tells
            now = time.monotonic()
            with self._lock:
                for name in self.servers:
                    server = stat.servers.get(name)
                    self.at[name] = server.in_flight if server is not None else 0
                    if server is None or not server.in_rotation:
                        self.left.setdefault(name, now)
                    elif name in self.left:
                        self.spans[name].append((self.left.pop(name), now))
                self.busy.append((now, stat.in_flight))

    def out_spans(self, server: str) -> list[tuple[float, float]]:
        with self._lock:
            return list(self.spans[server])

    def all_in(self, servers: list[str]) -> bool:
        with self._lock:
            return bool(self.busy) and not any(s in self.left for s in servers)

    def now_out(self) -> list[str]:
        with self._lock:
            return sorted(self.left)

    def first_out(self, since: float) -> float:
        with self._lock:
            starts = [a for spans in self.spans.values() for a, _ in spans if a >= since]
            return min(starts + [t for t in self.left.values() if t >= since], default=float("nan"))

    def busy_text(self, marks: dict[str, float], slots: int) -> str:
        by: dict[str, list[int]] = {}
        for t, n in self.busy:
            by.setdefault(phase_of(t, marks), []).append(n)
        return ", ".join(f"{p} {sum(v) / len(v) / slots:.0%} (max {max(v)})" for p, v in by.items())


def roll_out(fleet: Fleet, how: str, model: Path) -> float:
    """Start the roll-out the daemon's own way; the time it was asked for."""
    if how == "mv":
        fresh = model.with_name(model.name + ".new")
        shutil.copyfile(model, fresh)  # a new inode: the daemon sees another file at the path
        fresh.chmod(0o644)
        at = time.monotonic()
        os.replace(fresh, model)
        return at
    state = fleet.state()
    assert state is not None
    restart_request.write(fleet.state_file, ())  # () = every instance, as `numa-infer restart` with no names
    at = time.monotonic()
    os.kill(int(state["daemon"]["pid"]), signal.SIGUSR1)
    return at


def kill(fleet: Fleet, name: str) -> tuple[float, int]:
    """kill -9 of the instance's own process, by the PID the daemon reports for it."""
    state = fleet.state() or {}
    pids = {i["name"]: i.get("pid") for i in state.get("instances", [])}
    shared = {pid for n, pid in pids.items() if n != name}
    pid = pids.get(name)
    if not pid or pid in shared:
        raise RuntimeError(f"{name} has no process of its own (pids: {pids}): see --kill")
    os.kill(int(pid), signal.SIGKILL)
    return time.monotonic(), int(pid)


def wait_rolled(rotation: Rotation, servers: list[str], since: float, timeout_s: float) -> float:
    """Every server out of rotation at some time after `since` and all back in: the last's return."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = {s: [span for span in rotation.out_spans(s) if span[1] > since] for s in servers}
        if all(spans.values()) and rotation.all_in(servers):
            return max(span[1] for done in spans.values() for span in done)
        time.sleep(0.5)
    raise RuntimeError(f"the roll-out was not over in {timeout_s:g} s: {rotation.now_out()} out of rotation")


def wait_back(rotation: Rotation, server: str, since: float, timeout_s: float) -> float:
    """The server's first return to rotation after it left it past `since`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [span for span in rotation.out_spans(server) if span[1] > since]
        if done and rotation.all_in([server]):
            return done[0][1]
        time.sleep(0.2)
    raise RuntimeError(f"{server} was not back in rotation {timeout_s:g} s after the kill")


def stats_socket(fleet: Fleet) -> str:
    rendered = (fleet.state_file.parent / "haproxy.cfg").read_text()
    found = re.search(r"^\s*stats socket (\S+)", rendered, re.M)
    assert found, "no stats socket in the rendered haproxy.cfg"
    return found.group(1).strip('"').removeprefix("unix@")


def scenario(fleet: Fleet, args: argparse.Namespace, model: Path, names: list[str]) -> None:
    servers = [n.replace("@", "-") for n in names]  # haproxy_config.server_name
    with Rotation(stats_socket(fleet), servers) as rotation, Load(fleet.port, args) as load:
        time.sleep(args.before_s)
        asked = roll_out(fleet, args.how, model)
        rolled = wait_rolled(rotation, servers, asked, args.timeout_rollout_s)
        time.sleep(args.gap_s)
        victim, deadline = args.kill.replace("@", "-"), time.monotonic() + 30
        while args.kill_busy and rotation.at.get(victim, 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # a kill under load: while HAProxy counts a request at it
        busy_then = rotation.at.get(victim, 0)
        killed, pid = kill(fleet, args.kill)
        back = wait_back(rotation, victim, killed, 120)
        time.sleep(args.after_s)
    marks = {"roll-out": asked, "gap": rolled, "kill": killed, "after": back}
    print(f"# roll-out ({args.how}): {rolled - asked:.1f} s end to end, from the request to the last instance "
          f"back in rotation; the first left rotation {rotation.first_out(asked) - asked:.1f} s after it")
    print(f"# kill -9 of {args.kill} (pid {pid}), {busy_then} request(s) at it at HAProxy's last read: "
          f"back in rotation {back - killed:.1f} s later")
    out = {s: sum(b - a for a, b in rotation.out_spans(s) if asked <= b <= rolled + 1) for s in servers}
    ordered = sorted(out.values())
    print(f"# out of rotation during the roll-out, per instance: min {ordered[0]:.1f} s, median "
          f"{ordered[len(ordered) // 2]:.1f} s, max {ordered[-1]:.1f} s; "
          + ", ".join(f"{s} {v:.1f}" for s, v in out.items()))
    print(f"# slots busy (HAProxy in flight / {len(names) * args.slots}): "
          + rotation.busy_text(marks, len(names) * args.slots))
    print(phase_table(load.outcomes, marks))


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=16, choices=[f[0] for f in FLEETS])
    parser.add_argument("--slots", type=int, default=4, help="server.parallel")
    parser.add_argument("--rate", type=float, default=8.0, help="requests a second (open loop)")
    parser.add_argument("--tokens", type=int, default=40, help="max_tokens of each request")
    parser.add_argument("--stream-share", type=float, default=0.5, help="share of the requests streamed")
    parser.add_argument("--how", choices=["mv", "restart"], default="mv", help="what rolls every instance out")
    parser.add_argument("--kill", default="infer@3.1", help="the instance killed (kill -9 of its process)")
    parser.add_argument("--kill-busy", action=argparse.BooleanOptionalAction, default=True,
                        help="kill only once HAProxy counts a request at the instance (up to 30 s)")
    parser.add_argument("--before-s", type=float, default=20.0)
    parser.add_argument("--gap-s", type=float, default=10.0, help="load between the roll-out's end and the kill")
    parser.add_argument("--after-s", type=float, default=20.0)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="a request's whole time")
    parser.add_argument("--timeout-rollout-s", type=float, default=600.0)
    parser.add_argument("--monitor-s", type=float, default=2.0, help="monitor.interval_s")
    parser.add_argument("--jitter", type=float, default=0.1)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--calibration", default=str(ROOT / "bench" / "standin" / "calibration.json"))
    return parser.parse_args(argv)


def main() -> None:
    args = options()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # the `finally` stops the fleet
    count, capture, per_node = next(f for f in FLEETS if f[0] == args.instances)
    tmp = Path(tempfile.mkdtemp(prefix="day2-", dir="/tmp"))
    tmp.chmod(0o755)
    fleet: Fleet | None = None
    try:
        shared_model, engine = shared_assets(Path(args.calibration))
        model = tmp / "model.gguf"
        shutil.copyfile(shared_model, model)  # its own: the roll-out moves a new file over it
        model.chmod(0o644)
        # Each instance in a process of its own (read by the daemon Fleet starts, fleet_daemon.py):
        # a restart gives it a new PID, which the daemon waits for, and a kill -9 kills one.
        os.environ[OWN_PROCESS_ENV] = "all"
        fleet = Fleet(f"day2-{count}", unpack(capture, tmp / "captures"), per_node, args.slots, "prefix", model,
                      engine, Path(args.calibration), args.jitter, args.context, monitor_s=args.monitor_s,
                      prefix="day2")
        names = list(fleet.wait_ready(count, args.slots, timeout_s=300).values())
        if args.kill not in names:
            raise SystemExit(f"--kill {args.kill}: no such instance; the instances are {', '.join(sorted(names))}")
        print(f"# {count} stand-ins x {args.slots} slots ({capture}), {args.rate:g} req/s, {args.tokens} tokens, "
              f"{args.stream_share:.0%} streamed; monitor.interval_s {args.monitor_s:g}; load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        scenario(fleet, args, model, sorted(names))
        print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    except BaseException:
        if fleet is not None:
            print(fleet.logs()[-3000:], file=sys.stderr)
        raise
    finally:
        if fleet is not None:
            fleet.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
