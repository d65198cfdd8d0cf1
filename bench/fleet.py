#!/usr/bin/env python3
"""Prefix routing against least connections over a fleet of stand-ins (issue 59, parts 2
and 3): 2-16 instances behind the real HAProxy, its rendered haproxy.cfg and Lua, and the
daemon's own front-door control, planned from a captured topology of a real multi-socket
machine (tests/data/topologies, hwloc's captures), not from this host.

Per fleet (instances x slots) and mode (frontend.affinity "none", "prefix"), a fresh
daemon: bench/standin/fleet_daemon.py, `numa-infer run`'s Daemon in its own process with a
bench-side Backend that starts every planned instance, with its own llama-server argv, in
one stand-in process (bench/standin/fleet_host.py), unpinned. This process is the load
generator (one asyncio loop): per load, C conversations of T turns (each a shared system
prompt, then the whole history and a new user message), each turn after a think time
(uniform, seeded: the same in every mode), streamed; per turn the time to its first
token, the cached tokens (timings.cache_n of the last event) and the instance that
answered (the stand-in's system_fingerprint names its port). Loads are conversations per
slot (0.33: at most a third of the slots busy; 2: twice as many conversations as slots).

    .venv/bin/python bench/fleet.py [--instances 2,4,8,16] [--slots 1,4] [--modes none,prefix] \\
        [--loads 0.33,1,2] [--turns 4] [--think-s 0.5:2]

Per (instances, slots, load, mode) one row: later turns' TTFT p50/p90, first turns' TTFT
p50, the cached share of the later turns' prompt tokens, tokens/s (prompt and generated
over the load's wall time), home (the share of later turns the instance of the turn before
answered), the max/mean of requests per instance, failures; then prefix / none, measured
in the same run. The front door's limits are the defaults: frontend.connections_per_source
unset (no per-address cap), so one loopback address serves every client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.prefix import words  # noqa: E402

CAPTURES = (ROOT / "tests" / "data" / "topologies", ROOT.parent / "shared" / "topologies" / "hwloc-linux")
# Instances -> (a captured machine, placement.instances_per_node): its plan gives that many.
SETUPS: dict[int, tuple[str, int]] = {
    2: ("32em64t-2n8c+dax+nvme+mic+dimms", 1),  # 2 sockets, 2 nodes of 8 cores
    4: ("40intel64-4n10c+pci-conflicts", 1),  # 4 sockets, 4 nodes of 10 cores
    8: ("16amd64-8n2c", 1),  # 8 sockets (nodes) of 2 cores
    16: ("64amd64-4s2n4ca2co", 2),  # 4 sockets, 8 nodes, 2 instances a node
}


def _free_base(count: int) -> int:
    from tests.daemon_harness import free_port_block
    return free_port_block(count, also=(900,))


def unpack(name: str, into: Path) -> Path:
    """The capture's filesystem root (its sys/ and proc/), unpacked under `into`."""
    for where in CAPTURES:
        archive = where / f"{name}.tar.bz2"
        if archive.exists():
            target = into / name
            if not target.exists():
                target.mkdir(parents=True)
                subprocess.run(["tar", "xjf", str(archive), "-C", str(target)], check=True)
            (top,) = list(target.iterdir())
            return top
    raise FileNotFoundError(f"no capture {name}.tar.bz2 in {', '.join(map(str, CAPTURES))}")


def shared_assets(calibration: Path) -> tuple[Path, Path]:
    """A model file and a llama-server wrapper (the stand-in) the daemon's checks can run
    as the instances' user: the engine check runs `--version`/`--help` there."""
    from bench.standin.validate import standin_binary
    from tests.daemon_harness import generated_model
    return generated_model("small"), standin_binary(calibration)


class Fleet:
    """One daemon over one plan: started, waited for, stopped."""

    def __init__(self, name: str, fsroot: Path, instances_per_node: int, slots: int, mode: str,
                 model: Path, engine: Path, calibration: Path, jitter: float, context: int, *,
                 monitor_s: float = 2.0, ports: int = 32, prefix: str = "fleet",
                 more: Callable[[Path], str] | None = None) -> None:
        """`more`: configuration text to append, given the work directory (key files go there)."""
        # A short path: the front door's sockets live in the state directory, and a Unix
        # socket's path has 107 bytes at most (under pytest's deep temporary directories
        # `haproxy -c` refused the configuration, "exit 1").
        self.work = work = Path(tempfile.mkdtemp(prefix=f"{prefix}-{name}-", dir="/tmp"))
        work.chmod(0o755)  # HAProxy runs as its own user and reads haproxy.cfg here
        self.fsroot = fsroot
        self.base = _free_base(ports)
        self.port = self.base + 900
        self.config = work / "numa-infer.toml"
        self.state_file = work / "run" / "state.json"
        self.state_file.parent.mkdir()
        self.state_file.parent.chmod(0o755)
        self.config.write_text(
            f'[model]\npath = "{model}"\ncontext_size = {context}\n'
            f"[placement]\ninstances_per_node = {instances_per_node}\n"
            f'[server]\nbase_port = {self.base}\nengine = "llama-server"\nllama_server = "{engine}"\n'
            f"parallel = {slots}\n"
            f"[monitor]\ninterval_s = {monitor_s}\nrepair = false\n"  # nothing to re-pin: the CPUs are not this host's
            f'[frontend]\nlisten = "127.0.0.1:{self.port}"\naffinity = "{mode}"\n' + (more(work) if more else ""))
        self.log = open(work / "daemon.log", "w")  # noqa: SIM115 (closed by stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.standin.fleet_daemon", "--config", str(self.config), "--fsroot",
             str(fsroot), "--state-file", str(self.state_file), "--calibration", str(calibration),
             "--jitter", str(jitter)], stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)))

    def state(self) -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = json.loads(self.state_file.read_text())
            return doc
        except (OSError, ValueError):
            return None

    def wait_ready(self, count: int, slots: int, timeout_s: float = 120) -> dict[int, str]:
        """Every instance healthy with its slots and in rotation, the front door up: the
        instances' names by port."""
        deadline = time.monotonic() + timeout_s
        state = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited ({self.proc.returncode}): {self.logs()}")
            state = self.state()
            if state is not None:
                inst = state["instances"]
                front = state.get("frontdoor") or {}
                if (len(inst) == count and all(i["state"] == "healthy" and i.get("rotation") == "UP"
                                                and i.get("slots") == slots for i in inst)
                        and front.get("up") and not front.get("reloading")):
                    return {int(i["port"]): i["name"] for i in inst}
            time.sleep(0.2)
        raise RuntimeError(f"the fleet was not ready in {timeout_s:g} s: {json.dumps(state)[:2000]}\n{self.logs()}")

    def reload(self) -> int:
        """A reload that changes only haproxy.cfg (frontend.queue_timeout_s, 30 <-> 31 s), as
        `numa-infer reload` sends it: a new HAProxy worker, whose Lua starts with empty tables
        but for the homes the daemon hands it. The daemon's generation before it."""
        text = self.config.read_text()
        self.config.write_text(text.replace("queue_timeout_s = 31\n", "") if "queue_timeout_s = 31\n" in text
                               else text.replace("\naffinity =", "\nqueue_timeout_s = 31\naffinity =", 1))
        before = int((self.state() or {}).get("daemon", {}).get("generation", 0))
        self.proc.send_signal(signal.SIGHUP)
        return before

    def reloaded(self, before: int) -> bool:
        """The reload after generation `before` done, and its haproxy.cfg seen taken."""
        state = self.state() or {}
        reload = state.get("daemon", {}).get("last_reload") or {}
        return (int(state.get("daemon", {}).get("generation", 0)) > before and bool(reload.get("ok", True))
                and not (state.get("frontdoor") or {}).get("reloading", True))

    def logs(self) -> str:
        self.log.flush()
        return (self.work / "daemon.log").read_text()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.work, ignore_errors=True)


# -- the load generator ------------------------------------------------------------------------

@dataclass
class Turn:
    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    generated: int
    port: int | None
    sent: float = 0.0  # monotonic: the request's start
    ended: float = 0.0  # monotonic: its last event


@dataclass
class Result:
    turns: list[Turn] = field(default_factory=list)
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    reload: tuple[float, float] | None = None  # monotonic: the SIGHUP, and the new HAProxy seen taking over


async def chat(port: int, messages: list[dict[str, str]], max_tokens: int, timeout_s: float
               ) -> tuple[float, str, dict[str, Any], int | None]:
    """One streamed chat completion through the front door (HTTP/1.1, one connection):
    the time to its first content event, the text, the last event's timings, the port
    that answered (from system_fingerprint)."""
    body = json.dumps({"model": "bench", "messages": messages, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    started = time.monotonic()
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout_s)
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        status = head.split(b" ", 2)[1]
        if status != b"200":
            rest = await asyncio.wait_for(reader.read(300), timeout_s)
            raise RuntimeError(f"{status.decode()}: {(head + rest)[-300:]!r}")
        chunked = b"transfer-encoding: chunked" in head.lower()
        first: float | None = None
        text: list[str] = []
        timings: dict[str, Any] = {}
        answered: int | None = None
        buffer = b""
        while True:
            if chunked:
                size_line = await asyncio.wait_for(reader.readline(), timeout_s)
                size = int(size_line.strip().split(b";")[0] or b"0", 16)
                if size == 0:
                    break
                data = await asyncio.wait_for(reader.readexactly(size + 2), timeout_s)
                buffer += data[:-2]
            else:
                data = await asyncio.wait_for(reader.read(65536), timeout_s)
                if not data:
                    break
                buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                line = event.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if first is None:
                    first = time.monotonic() - started
                fingerprint = str(chunk.get("system_fingerprint", ""))
                if "-p" in fingerprint:
                    answered = int(fingerprint.rsplit("-p", 1)[1])
                for choice in chunk.get("choices", []):
                    text.append((choice.get("delta") or {}).get("content") or "")
                if "timings" in chunk:
                    timings = chunk["timings"]
        return first or 0.0, "".join(text), timings, answered
    finally:
        writer.close()


async def conversation(port: int, index: int, seed: int, system: str, args: argparse.Namespace,
                       out: Result) -> None:
    rng = random.Random(seed * 100003 + index)
    low, _, high = args.think_s.partition(":")
    think = (float(low), float(high or low))
    messages = [{"role": "system", "content": system}]
    for turn in range(args.turns):
        # the first turn starts anywhere in one think time: the conversations do not move in lockstep
        await asyncio.sleep(rng.uniform(0, think[1]) if turn == 0 else rng.uniform(*think))
        if args.no_reuse and turn:  # a request of its own: a start nothing else shares, no history
            messages = [{"role": "system", "content": f"Request {index}.{turn}. {system}"}]
        messages.append({"role": "user", "content": f"conversation {index} turn {turn}: {words(rng, args.user_words)}"})
        sent = time.monotonic()
        try:
            ttft, text, timings, answered = await chat(port, messages, args.max_tokens, args.timeout_s)
        except (TimeoutError, OSError, RuntimeError, ValueError, asyncio.IncompleteReadError) as exc:
            out.failed += args.turns - turn  # this turn and the ones it would have led to
            out.errors.append(f"conversation {index} turn {turn}: {type(exc).__name__}: {exc}"[:300])
            return
        messages.append({"role": "assistant", "content": text})
        cached = int(timings.get("cache_n", 0))
        out.turns.append(Turn(index, turn, ttft, int(timings.get("prompt_n", 0)) + cached, cached,
                              int(timings.get("predicted_n", 0)), answered, sent, time.monotonic()))


async def reload_during(fleet: Fleet, after: int, out: Result, timeout_s: float = 60) -> None:
    """A reload once `after` turns are answered: out.reload = (the SIGHUP, the new HAProxy
    taking over)."""
    while len(out.turns) < after:
        await asyncio.sleep(0.05)
    asked = time.monotonic()
    before = fleet.reload()
    while not fleet.reloaded(before):
        if time.monotonic() - asked > timeout_s:
            raise RuntimeError(f"the reload was not taken in {timeout_s:g} s: {fleet.logs()}")
        await asyncio.sleep(0.05)
    out.reload = (asked, time.monotonic())


async def workload(port: int, conversations: int, seed: int, args: argparse.Namespace,
                   fleet: Fleet | None = None) -> Result:
    """C conversations at once, each of args.turns turns; a system prompt of this load's own
    (the same in every mode), so that an earlier load's cached prompts do not help. With
    --own-context, each conversation's its own (a document or a code base per user): no
    instance holds a conversation's start but the one that read it."""
    def system(c: int) -> str:
        own = seed * 10_000 + c if args.own_context else seed
        return f"You are a careful assistant ({own}). {words(random.Random(own), args.system_words)}"

    out = Result()
    started = time.monotonic()
    reload = ([reload_during(fleet, round(args.reload_after * conversations * args.turns), out)]
              if fleet is not None and args.reload_after is not None else [])
    await asyncio.gather(*(conversation(port, c, seed, system(c), args, out) for c in range(conversations)), *reload)
    out.wall_s = time.monotonic() - started
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def home_share(turns: list[Turn]) -> float:
    """Of the turns after the first, the share the instance of the conversation's turn
    before answered."""
    by = {(t.conversation, t.turn): t.port for t in turns}
    later = [t for t in turns if t.turn >= 1 and (t.conversation, t.turn - 1) in by and t.port is not None]
    same = sum(1 for t in later if by[(t.conversation, t.turn - 1)] == t.port)
    return same / len(later) if later else float("nan")


def across(turns: list[Turn], reload: tuple[float, float]) -> tuple[int, float]:
    """Per conversation, its last turn that ended before the reload was asked and its first
    turn sent after the new HAProxy took over (turns between them went through the old
    worker): how many conversations have both, and the share whose two turns the same
    instance answered."""
    pairs = []
    for c in {t.conversation for t in turns}:
        mine = sorted((t for t in turns if t.conversation == c and t.port is not None), key=lambda t: t.turn)
        before = [t for t in mine if t.ended < reload[0]]
        after = [t for t in mine if t.sent > reload[1]]
        if before and after:
            pairs.append((before[-1].port, after[0].port))
    same = sum(1 for a, b in pairs if a == b)
    return len(pairs), same / len(pairs) if pairs else float("nan")


def summary(result: Result, ports: dict[int, str]) -> dict[str, Any]:
    turns = result.turns
    later = [t.ttft_s for t in turns if t.turn >= 1]
    firsts = [t.ttft_s for t in turns if t.turn == 0]
    later_prompt = sum(t.prompt_tokens for t in turns if t.turn >= 1)
    per_instance = {name: 0 for name in ports.values()}
    for t in turns:
        if t.port in ports:
            per_instance[ports[t.port]] += 1
    mean = statistics.mean(per_instance.values()) if per_instance else 0.0
    return {
        "later_p50": pct(later, 0.5), "later_p90": pct(later, 0.9), "first_p50": pct(firsts, 0.5),
        "first_p99": pct(firsts, 0.99), "p99": pct([t.ttft_s for t in turns], 0.99),
        "cached": sum(t.cached_tokens for t in turns if t.turn >= 1) / max(later_prompt, 1),
        "tokens_s": sum(t.prompt_tokens + t.generated for t in turns) / max(result.wall_s, 1e-9),
        "home": home_share(turns), "max_mean": max(per_instance.values()) / mean if mean else float("nan"),
        "failed": result.failed, "requests": len(turns), "wall_s": result.wall_s, "per_instance": per_instance,
        "errors": result.errors[:3],
    } | ({"reload_taken_s": result.reload[1] - result.reload[0],
          "across": across(turns, result.reload)} if result.reload else {})


def measure(instances: int, slots: int, mode: str, loads: list[float], args: argparse.Namespace, tmp: Path,
            assets: tuple[Path, Path]) -> dict[float, dict[str, Any]]:
    """One fresh fleet in one mode, every load in turn on it."""
    capture, per_node = SETUPS[instances]
    fsroot = unpack(capture, tmp / "captures")
    fleet = Fleet(f"{instances}x{slots}-{mode}", fsroot, per_node, slots, mode, *assets,
                  Path(args.calibration), args.jitter, args.context)
    try:
        ports = fleet.wait_ready(instances, slots)
        # The daemon's own rendering: haproxy.cfg loading its Lua (the pick, the hold, the token count).
        rendered = (fleet.state_file.parent / "haproxy.cfg").read_text()
        lua_routes = "lua-load" in rendered and (mode != "prefix" or "lua.numa_pick" in rendered)
        out: dict[float, dict[str, Any]] = {}
        for k, load in enumerate(loads):
            conversations = max(1, round(load * instances * slots))
            result = asyncio.run(workload(fleet.port, conversations, args.seed + 17 * k, args, fleet))
            out[load] = summary(result, ports) | {"conversations": conversations, "lua_routes": lua_routes}
    finally:
        fleet.stop()
    return out


HEADER = (f"{'inst':>4} {'slots':>5} {'load':>5} {'conv':>4} {'mode':<7} {'t>=2 p50':>9} {'p90':>7} "
          f"{'t=1 p50':>8} {'cached':>7} {'tok/s':>7} {'home':>5} {'max/mean':>8} {'failed':>6} {'wall':>6}")


def row(instances: int, slots: int, load: float, mode: str, r: dict[str, Any]) -> str:
    return (f"{instances:>4} {slots:>5} {load:>5.2f} {r['conversations']:>4} {mode:<7} {r['later_p50']:>8.2f}s "
            f"{r['later_p90']:>6.2f}s {r['first_p50']:>7.2f}s {r['cached']:>7.0%} {r['tokens_s']:>7.0f} "
            f"{r['home']:>5.0%} {r['max_mean']:>8.2f} {r['failed']:>6} {r['wall_s']:>5.1f}s")


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--instances", default="2,4,8,16", help=f"of {sorted(SETUPS)}")
    parser.add_argument("--slots", default="1,4", help="server.parallel values")
    parser.add_argument("--modes", default="none,prefix", help="frontend.affinity values, the first the baseline")
    parser.add_argument("--loads", default="0.33,1,2", help="conversations per slot")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--think-s", default="0.5:2", help="LOW:HIGH seconds between a conversation's turns")
    parser.add_argument("--system-words", type=int, default=180)  # ~1,000 tokens, as bench/prefix.py
    parser.add_argument("--user-words", type=int, default=30)
    parser.add_argument("--own-context", action="store_true",
                        help="each conversation's system prompt its own (default: one shared by all); with "
                             "--turns 1, a workload without reuse")
    parser.add_argument("--no-reuse", action="store_true",
                        help="every turn a request of its own (its own start, no history): a closed loop without "
                             "reuse, --turns requests a client")
    parser.add_argument("--reload-after", type=float, default=None,
                        help="a share of each load's turns: once that many are answered, a reload that changes only "
                             "haproxy.cfg (SIGHUP after a frontend.queue_timeout_s change); per conversation its "
                             "last turn before it and first after it, and the share answered by one instance")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048, help="model.context_size (a slot's)")
    parser.add_argument("--calibration", default=str(ROOT / "bench" / "standin" / "calibration.json"))
    parser.add_argument("--jitter", type=float, default=0.1, help="the stand-ins' step-time spread")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="also write every row here")
    args = parser.parse_args(argv)
    args.own_context = args.own_context or args.no_reuse  # no reuse: no start shared either
    return args


def main() -> None:
    args = options()
    # SIGTERM as ^C: the fleets' `finally` stops their daemons (and so HAProxy and the stand-ins).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    counts = [int(x) for x in args.instances.split(",")]
    slots_list = [int(x) for x in args.slots.split(",")]
    modes = args.modes.split(",")
    loads = [float(x) for x in args.loads.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-fleet-"))
    tmp.chmod(0o755)
    assets = shared_assets(Path(args.calibration))
    print(f"# stand-in fleet: {args.turns} turns a conversation, think {args.think_s} s, system prompt "
          f"{args.system_words} words{' (own per conversation)' if args.own_context else ' (shared)'}, "
          f"{args.user_words} words a turn, {args.max_tokens} tokens an answer, jitter "
          f"{args.jitter:g}; load = conversations per slot; captures: "
          + ", ".join(f"{n}: {SETUPS[n][0]}" + (f" x{SETUPS[n][1]} a node" if SETUPS[n][1] > 1 else "")
                      for n in counts)
          + f"; load average {os.getloadavg()[0]:.2f}", flush=True)
    print(HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    try:
        for instances in counts:
            for slots in slots_list:
                got = {}
                for mode in modes:
                    got[mode] = measure(instances, slots, mode, loads, args, tmp, assets)
                    for load in loads:
                        print(row(instances, slots, load, mode, got[mode][load]), flush=True)
                        if "across" in got[mode][load]:
                            count, share = got[mode][load]["across"]
                            taken = got[mode][load]["reload_taken_s"]
                            print(f"#   reload after {args.reload_after:.0%} of the turns, taken in {taken:.2f} s: "
                                  f"{count} conversations across it (a turn ended before it, a turn sent after), "
                                  f"home {share:.0%}", flush=True)
                        for error in got[mode][load]["errors"]:
                            print(f"#   {error}")
                        rows.append({"instances": instances, "slots": slots, "load": load, "mode": mode}
                                    | {k: v for k, v in got[mode][load].items() if k != "errors"})
                base = modes[0]
                for mode in modes[1:]:
                    for load in loads:
                        b, r = got[base][load], got[mode][load]
                        print(f"# ratio {mode}/{base} {instances}x{slots} load {load:g}: TTFT t>=2 p50 "
                              f"{b['later_p50'] / r['later_p50']:.2f}x better, "
                              f"p90 {b['later_p90'] / r['later_p90']:.2f}x, "
                              f"tokens/s {r['tokens_s'] / b['tokens_s']:.2f}x, "
                              f"home {r['home']:.0%} vs {b['home']:.0%}; "
                              f"first turns p99 {r['first_p99']:.2f} s vs {b['first_p99']:.2f} s "
                              f"({r['first_p99'] / b['first_p99']:.2f}x); every turn's p99 "
                              f"{r['p99'] / b['p99']:.2f}x",
                              flush=True)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
