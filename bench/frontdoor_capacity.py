#!/usr/bin/env python3
"""The front door's capacity (issue 60, part 1): what one HAProxy thread with tenants and
prefix routing on routes over 2, 16 and 64 stand-ins, against `affinity = "none"` without
tenants (which HAProxy runs on its default threads: one per CPU, here 2).

A fleet as bench/fleet.py starts it (the daemon's own code, bench/standin/fleet_daemon.py's
Backend, the real HAProxy with the rendered haproxy.cfg and Lua, planned from a captured
topology), with two [[tenants]] (key files written as the daemon wants them: mode 600 in a
directory of mode 700; the requests carry the last tenant's key, which has an in-flight and
a per-minute limit too high to refuse anything, so every tenant rule is run and passed)
and stand-ins given a calibration of their own: prefill at 10^7 tokens/s (a 1-token answer
is ready at once) and a slow decode for the streams (--stream-tps a stream).

1. Rate steps (open loop, keep-alive connections, as an SDK's pool): tiny non-streamed chat
   requests (max_tokens 1, a system prompt of one of 200 variants, so the prefix pick has
   homes to keep and keys to hash), R per second for --step-s through the front door and,
   at the same time, the same requests at the same rate sent directly to the stand-ins
   (round robin over every instance's port: the same spread of work the front door gives
   them, without it; at once, so that this shared host's noise falls on both alike).
   Per step: achieved req/s, latency p50/p99 each way, the added p50/p99 (front door less
   direct), HAProxy's CPU per request (its processes' user+system CPU seconds from /proc,
   the step's delta over its requests), errors. The added p99 on 2 shared cores also holds
   the load generator's and the stand-ins' CPU waits: HAProxy's CPU per request is the
   figure that does not, and 1 / (CPU per request) is one thread's ceiling.
2. Streams: N concurrent slow streams (--stream-tokens tokens at --stream-tps each) held
   open through the front door while probes (POST /tokenize, --probe-rate a second, which
   the stand-in answers without its engine: a chat would wait for the decode step in
   progress) go through the front door and direct, interleaved, while every stream is open;
   per N: the probes' added p50/p99, HAProxy's CPU per second and per streamed event (the
   token filter reads every chunk with tenants), the streams' failures. N stays under the
   slots (HAProxy's maxconn per server): past them the probes would queue.
3. The pick's cost: one rate (--pick-rate) at 2, 16 and 64 instances, each configuration:
   HAProxy's CPU µs per request against the instance count.

    .venv/bin/python bench/frontdoor_capacity.py [--instances 2,16,64] [--configs tenants-prefix,none] \\
        [--rates 100,200,400,700,1000] [--streams 64,256,512] [--pick-rate 200] [--step-s 5] [--json FILE]

The daemon's monitor passes over 64 instances take a good part of a CPU here: monitor.interval_s
is --monitor-s (10 s; bench/fleet.py runs 2 s), and a step of 10 s holds one pass.
Configurations "prefix" and "tenants-none" (each part alone) can be added to --configs.

Captures: 2: 32em64t-2n8c (2 nodes), 16: 64amd64-4s2n4ca2co (8 nodes x 2), 64: 256ia64-64n2s2c
(64 nodes). The full sweep (rates and streams) runs at the largest instance count; the
others run the pick's rate only.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fleet import Fleet, pct, shared_assets, unpack  # noqa: E402

SETUPS: dict[int, tuple[str, int]] = {
    2: ("32em64t-2n8c+dax+nvme+mic+dimms", 1),
    4: ("40intel64-4n10c+pci-conflicts", 1),
    8: ("16amd64-8n2c", 1),
    16: ("64amd64-4s2n4ca2co", 2),
    64: ("256ia64-64n2s2c", 1),
}
CONFIGS = {"tenants-prefix": ("prefix", True), "none": ("none", False),
           "prefix": ("prefix", False), "tenants-none": ("none", True)}  # the last two: each part alone
KEY_A = "team-a-" + "a" * 40
KEY_B = "team-b-" + "b" * 40
SYSTEMS = 200  # system prompt variants: the prefix pick's keys


def calibration(path: Path, stream_tps: float) -> Path:
    """The stand-ins' rates: prompts read at once, each stream decoded at stream_tps
    whatever the number of busy slots (up to 4,096)."""
    path.write_text(json.dumps({
        "prefill_tps": {"1": 1e7, "65536": 1e7},
        "decode_tps": {"1": stream_tps, "4096": stream_tps},
        "bytes_per_token": 4.0, "kv_bytes_per_token": 64 << 20, "cached_ms_per_token": 0.0, "load_s": 0.0}))
    return path


class Door(Fleet):
    """bench/fleet.py's Fleet, its configuration with or without two tenants."""

    def __init__(self, name: str, fsroot: Path, instances_per_node: int, slots: int, mode: str, tenants: bool,
                 model: Path, engine: Path, calibration: Path, context: int, monitor_s: float = 10.0) -> None:
        self.key = KEY_B if tenants else None  # the last tenant's: every tenant's rule is read before it matches
        super().__init__(name, fsroot, instances_per_node, slots, mode, model, engine, calibration, 0.0, context,
                         monitor_s=monitor_s, ports=96, prefix="fdcap", more=self._tenants if tenants else None)

    @staticmethod
    def _tenants(work: Path) -> str:
        keys = work / "keys"
        keys.mkdir(mode=0o700)
        for name, key in (("a", KEY_A), ("b", KEY_B)):
            (keys / name).write_text(key + "\n")
            (keys / name).chmod(0o600)
        return (f'[[tenants]]\nname = "team-a"\nkey_file = "{keys / "a"}"\n'
                f'[[tenants]]\nname = "team-b"\nkey_file = "{keys / "b"}"\n'
                f"max_in_flight = 100000\nrequests_per_minute = 1000000\n")

    def rendered(self) -> str:
        return (self.state_file.parent / "haproxy.cfg").read_text()

    def processes(self) -> tuple[list[psutil.Process], list[psutil.Process]]:
        """HAProxy's processes (master and workers) and the stand-in host, under the daemon."""
        haproxy, standins = [], []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if p.name() == "haproxy":
                    haproxy.append(p)
                elif "bench.standin.fleet_host" in " ".join(p.cmdline()):
                    standins.append(p)
            except psutil.Error:
                continue
        return haproxy, standins


def cpu_of(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class Meter:
    """CPU seconds of HAProxy, the stand-ins and this process over a span."""

    def __init__(self, door: Door) -> None:
        self.door = door

    def __enter__(self) -> Meter:
        self.haproxy, self.standins = self.door.processes()
        self.daemon = [psutil.Process(self.door.proc.pid)]
        self.h0, self.s0, self.d0 = cpu_of(self.haproxy), cpu_of(self.standins), cpu_of(self.daemon)
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.g0 = r.ru_utime + r.ru_stime
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        now_haproxy, _ = self.door.processes()
        self.reloaded = {p.pid for p in now_haproxy} != {p.pid for p in self.haproxy}
        self.wall = time.monotonic() - self.t0
        self.h = cpu_of(self.haproxy) - self.h0
        self.s = cpu_of(self.standins) - self.s0
        self.d = cpu_of(self.daemon) - self.d0
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.g = r.ru_utime + r.ru_stime - self.g0


# -- the load generator ------------------------------------------------------------------------

class Pool:
    """Keep-alive HTTP/1.1 connections per port, as an SDK's pool keeps them."""

    def __init__(self) -> None:
        self.idle: dict[int, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    async def request(self, port: int, payload: bytes, timeout_s: float) -> tuple[int, bytes]:
        for attempt in (0, 1):
            stale = bool(self.idle.get(port))
            if stale:
                reader, writer = self.idle[port].pop()
            else:
                reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout_s)
            try:
                writer.write(payload)
                status, body, keep = await asyncio.wait_for(read_response(reader), timeout_s)
            except (OSError, asyncio.IncompleteReadError, ValueError):
                writer.close()
                if stale and attempt == 0:
                    continue  # a kept connection the other side had closed: once more on a new one
                raise
            if keep:
                self.idle.setdefault(port, []).append((reader, writer))
            else:
                writer.close()
            return status, body
        raise RuntimeError("unreachable")

    def close(self) -> None:
        for conns in self.idle.values():
            for _, w in conns:
                w.close()
        self.idle.clear()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    lower = head.lower()
    keep = b"connection: close" not in lower
    if b"transfer-encoding: chunked" in lower:
        parts = []
        while True:
            size = int((await reader.readline()).strip().split(b";")[0] or b"0", 16)
            if size == 0:
                await reader.readline()
                break
            parts.append((await reader.readexactly(size + 2))[:-2])
        return status, b"".join(parts), keep
    at = lower.find(b"content-length:")
    if at < 0:
        return status, await reader.read(), False
    length = int(lower[at + 15:lower.index(b"\r\n", at)])
    return status, await reader.readexactly(length), keep


def post_bytes(path: str, body: bytes, key: str | None) -> bytes:
    """A whole HTTP/1.1 POST of a JSON body, with the tenant's key when there is one."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def chat_payload(i: int, key: str | None, max_tokens: int = 1, stream: bool = False) -> bytes:
    body = json.dumps({"model": "bench", "max_tokens": max_tokens, "stream": stream, "temperature": 0,
                       "messages": [{"role": "system", "content": f"You are assistant {i % SYSTEMS}, brief."},
                                    {"role": "user", "content": f"question {i}: say yes"}]}).encode()
    return post_bytes("/v1/chat/completions", body, key)


def tokenize_payload(i: int, key: str | None) -> bytes:
    """A probe the stand-in answers without its engine (whose step in progress a chat would
    wait for while streams decode): POST /tokenize, forwarded as the chats are."""
    body = json.dumps({"content": f"probe {i}: say yes"}).encode()
    return post_bytes("/tokenize", body, key)


@dataclass
class Step:
    latencies: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)  # the generator's lateness against the schedule
    errors: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    wall: float = 0.0


async def open_loop(rate: float, duration: float, target: Any, timeout_s: float) -> Step:
    """rate requests a second for duration seconds, each sent at its time whatever the
    others' (open loop); target(i) -> (pool, port, payload)."""
    loop = asyncio.get_running_loop()
    out = Step()

    async def one(i: int, at: float) -> None:
        pool, port, payload = target(i)
        sent = loop.time()
        out.lag.append(sent - at)
        try:
            status, _ = await pool.request(port, payload, timeout_s)
        except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError) as exc:
            out.errors += 1
            out.statuses[type(exc).__name__] = out.statuses.get(type(exc).__name__, 0) + 1
            return
        if status != 200:
            out.errors += 1
            out.statuses[str(status)] = out.statuses.get(str(status), 0) + 1
            return
        out.latencies.append(loop.time() - sent)

    t0 = loop.time()
    tasks = []
    for i in range(max(1, int(rate * duration))):
        at = t0 + i / rate
        delay = at - loop.time()
        if delay > 0.0005:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i, at)))
    await asyncio.gather(*tasks)
    out.wall = loop.time() - t0
    return out


async def stream(port: int, i: int, key: str | None, tokens: int, timeout_s: float, out: dict[str, int]) -> None:
    """One streamed chat of `tokens` tokens, read to its end on its own connection."""
    payload = chat_payload(10_000_000 + i, key, tokens, True)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout_s)
        try:
            writer.write(payload)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
            if head.split(b" ", 2)[1] != b"200":
                out["failed"] += 1
                return
            while True:
                line = await asyncio.wait_for(reader.readline(), timeout_s)
                if not line:
                    break
                size = int(line.strip().split(b";")[0] or b"0", 16)
                if size == 0:
                    break
                data = await asyncio.wait_for(reader.readexactly(size + 2), timeout_s)
                out["events"] += data.count(b"data:")
            out["done"] += 1
        finally:
            writer.close()
    except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError):
        out["failed"] += 1


# -- the measures ------------------------------------------------------------------------------

def stats(step: Step) -> dict[str, Any]:
    return {"n": len(step.latencies), "rps": len(step.latencies) / max(step.wall, 1e-9),
            "p50_ms": pct(step.latencies, 0.5) * 1e3, "p90_ms": pct(step.latencies, 0.9) * 1e3,
            "p99_ms": pct(step.latencies, 0.99) * 1e3,
            "lag_p99_ms": pct(step.lag, 0.99) * 1e3, "errors": step.errors, "statuses": step.statuses}


def idle_cpu(door: Door, seconds: float = 4.0) -> float:
    """HAProxy's CPU share with no traffic (its health checks, the daemon's stats reads):
    subtracted from each step's, pro rata, for the net CPU per request."""
    with Meter(door) as m:
        time.sleep(seconds)
    return m.h / m.wall


def rate_step(door: Door, ports: list[int], rate: float, args: argparse.Namespace, idle: float) -> dict[str, Any]:
    """One rate through the front door and the same rate direct, at once (the same noise
    from this shared host on both); HAProxy's CPU is the front door's requests' alone."""
    fd_pool, direct_pool = Pool(), Pool()
    rr = itertools.cycle(ports)

    async def run() -> tuple[Step, Step]:
        try:
            fd, direct = await asyncio.gather(
                open_loop(rate, args.step_s, lambda i: (fd_pool, door.port, chat_payload(i, door.key)), args.timeout_s),
                open_loop(rate, args.step_s, lambda i: (direct_pool, next(rr), chat_payload(i, None)), args.timeout_s))
            return fd, direct
        finally:
            fd_pool.close()
            direct_pool.close()

    with Meter(door) as m:
        fd, direct = asyncio.run(run())
    f, d = stats(fd), stats(direct)
    requests = max(f["n"] + f["errors"], 1)
    return {"rate": rate, "fd": f, "direct": d, "added_p50_ms": f["p50_ms"] - d["p50_ms"],
            "added_p99_ms": f["p99_ms"] - d["p99_ms"],
            "haproxy_cpu_s": m.h, "haproxy_us_per_req": m.h / requests * 1e6,
            "haproxy_net_us_per_req": max(m.h - idle * m.wall, 0.0) / requests * 1e6,
            "haproxy_cpu_share": m.h / m.wall, "haproxy_idle_share": idle,
            "standin_cpu_share": m.s / m.wall, "gen_cpu_share": m.g / m.wall, "daemon_cpu_share": m.d / m.wall,
            "reloaded": m.reloaded,
            "load1": os.getloadavg()[0]}


def streams_step(door: Door, ports: list[int], count: int, args: argparse.Namespace, idle: float
                 ) -> dict[str, Any]:
    """count streams held open through the front door; probes each way meanwhile."""
    async def run() -> tuple[Step, Step, dict[str, int], float]:
        out = {"events": 0, "done": 0, "failed": 0}
        tasks = [asyncio.ensure_future(stream(door.port, i, door.key, args.stream_tokens, args.timeout_s * 4, out))
                 for i in range(count)]
        ramp = min(2.0, args.stream_tokens / args.stream_tps / 4)
        await asyncio.sleep(ramp)  # every stream started
        # the probes while every stream is open: not past the streams' end
        probe_s = max(1.0, min(args.step_s, args.stream_tokens / args.stream_tps - ramp - 0.5))
        fd_pool, direct_pool = Pool(), Pool()
        rr = itertools.cycle(ports)
        flip = itertools.count()

        def target(i: int) -> tuple[Pool, int, bytes]:
            if next(flip) % 2 == 0:
                return fd_pool, door.port, tokenize_payload(i, door.key)
            return direct_pool, -next(rr), tokenize_payload(i, None)

        # interleaved: the odd ones direct (negative port: told apart below)
        fd_step, direct_step = Step(), Step()
        loop = asyncio.get_running_loop()

        async def probe(i: int) -> None:
            pool, port, payload = target(i)
            step = fd_step if port > 0 else direct_step
            sent = loop.time()
            try:
                status, _ = await pool.request(abs(port), payload, args.timeout_s)
            except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError):
                step.errors += 1
                return
            if status != 200:
                step.errors += 1
                step.statuses[str(status)] = step.statuses.get(str(status), 0) + 1
                return
            step.latencies.append(loop.time() - sent)

        t0 = loop.time()
        probes = []
        for i in range(int(args.probe_rate * probe_s)):
            delay = t0 + i / args.probe_rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            probes.append(asyncio.ensure_future(probe(i)))
        await asyncio.gather(*probes)
        fd_step.wall = direct_step.wall = loop.time() - t0
        fd_pool.close()
        direct_pool.close()
        await asyncio.gather(*tasks)
        return fd_step, direct_step, out, loop.time() - t0

    with Meter(door) as m:
        fd, direct, out, _ = asyncio.run(run())
    f, d = stats(fd), stats(direct)
    return {"streams": count, "fd": f, "direct": d, "added_p50_ms": f["p50_ms"] - d["p50_ms"],
            "added_p99_ms": f["p99_ms"] - d["p99_ms"], "events": out["events"], "done": out["done"],
            "failed": out["failed"], "haproxy_cpu_share": m.h / m.wall,
            "haproxy_us_per_event": m.h / max(out["events"], 1) * 1e6,
            "haproxy_net_us_per_event": max(m.h - idle * m.wall, 0.0) / max(out["events"], 1) * 1e6,
            "probe_requests": f["n"] + f["errors"], "standin_cpu_share": m.s / m.wall,
            "gen_cpu_share": m.g / m.wall, "daemon_cpu_share": m.d / m.wall,
            "reloaded": m.reloaded, "load1": os.getloadavg()[0]}


def start(instances: int, config: str, args: argparse.Namespace, tmp: Path, assets: tuple[Path, Path],
          calib: Path) -> tuple[Door, list[int], dict[str, Any]]:
    capture, per_node = SETUPS[instances]
    fsroot = unpack(capture, tmp / "captures")
    mode, tenants = CONFIGS[config]
    door = Door(f"{instances}-{config}", fsroot, per_node, args.slots, mode, tenants, *assets, calib, args.context,
                args.monitor_s)
    try:
        ports = sorted(door.wait_ready(instances, args.slots, timeout_s=args.ready_s))
        cfg = door.rendered()
        threads = [line.split()[1] for line in cfg.splitlines() if line.strip().startswith("nbthread")]
        info = {"nbthread": threads[0] if threads else f"default ({os.cpu_count()} CPUs)",
                "pick_lua": "lua.numa_pick" in cfg, "token_filter": "filter lua." in cfg,
                "tenants": cfg.count("team-b") > 0, "haproxy_pids": [p.pid for p in door.processes()[0]]}
    except BaseException:
        door.stop()
        raise
    return door, ports, info


RATE_HEADER = (f"{'inst':>4} {'config':<15} {'rate':>6} {'got/s':>7} {'fd p50':>7} {'p99':>7} {'dir p50':>7} "
               f"{'p99':>7} {'+p50':>6} {'+p99':>7} {'hap µs/req':>10} {'net':>5} {'hap cpu':>7} {'stand':>6} "
               f"{'gen':>5} {'dmn':>4} {'lag99':>6} {'err':>5} {'load':>5}")


def rate_row(instances: int, config: str, r: dict[str, Any]) -> str:
    f, d = r["fd"], r["direct"]
    err = f["errors"] + d["errors"]
    return (f"{instances:>4} {config:<15} {r['rate']:>6.0f} {f['rps']:>7.0f} {f['p50_ms']:>6.2f}m {f['p99_ms']:>6.2f}m "
            f"{d['p50_ms']:>6.2f}m {d['p99_ms']:>6.2f}m {r['added_p50_ms']:>+6.2f} {r['added_p99_ms']:>+7.2f} "
            f"{r['haproxy_us_per_req']:>10.0f} {r['haproxy_net_us_per_req']:>5.0f} {r['haproxy_cpu_share']:>7.0%} "
            f"{r['standin_cpu_share']:>6.0%} {r['gen_cpu_share']:>5.0%} {r['daemon_cpu_share']:>4.0%} "
            f"{f['lag_p99_ms']:>5.1f}m {err:>5} {r['load1']:>5.2f}"
            + (" RELOADED" if r["reloaded"] else "")
            + (f" fd:{f['statuses']} dir:{d['statuses']}" if err else ""))


STREAM_HEADER = (f"{'inst':>4} {'config':<15} {'streams':>7} {'done':>5} {'fail':>4} {'events/s':>8} "
                 f"{'fd p50':>7} {'p99':>7} {'dir p50':>7} {'p99':>7} {'+p50':>6} {'+p99':>7} {'hap µs/ev':>9} "
                 f"{'net':>5} {'hap cpu':>7} {'stand':>6} {'gen':>5} {'dmn':>4} {'load':>5}")


def stream_row(instances: int, config: str, r: dict[str, Any], seconds: float) -> str:
    f, d = r["fd"], r["direct"]
    return (f"{instances:>4} {config:<15} {r['streams']:>7} {r['done']:>5} {r['failed']:>4} "
            f"{r['events'] / seconds:>8.0f} {f['p50_ms']:>6.2f}m {f['p99_ms']:>6.2f}m {d['p50_ms']:>6.2f}m "
            f"{d['p99_ms']:>6.2f}m {r['added_p50_ms']:>+6.2f} {r['added_p99_ms']:>+7.2f} "
            f"{r['haproxy_us_per_event']:>9.1f} {r['haproxy_net_us_per_event']:>5.1f} {r['haproxy_cpu_share']:>7.0%} "
            f"{r['standin_cpu_share']:>6.0%} {r['gen_cpu_share']:>5.0%} {r['daemon_cpu_share']:>4.0%} "
            f"{r['load1']:>5.2f}" + (" RELOADED" if r["reloaded"] else "")
            + (f" errors fd {f['errors']} dir {d['errors']}" if f["errors"] + d["errors"] else ""))


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--instances", default="2,16,64", help=f"of {sorted(SETUPS)}; the largest gets the sweeps")
    parser.add_argument("--configs", default="tenants-prefix,none", help=f"of {list(CONFIGS)}")
    parser.add_argument("--rates", default="100,200,400,700,1000", help="requests/s steps (empty: none)")
    parser.add_argument("--streams", default="64,256,512", help="concurrent stream steps (empty: none)")
    parser.add_argument("--pick-rate", type=float, default=200.0, help="the rate of the pick's cost (0: skip)")
    parser.add_argument("--pick-repeats", type=int, default=1, help="the pick's step, so many times (median)")
    parser.add_argument("--sweep-at", type=int, default=0, help="the instance count of the sweeps (0: the largest)")
    parser.add_argument("--step-s", type=float, default=5.0)
    parser.add_argument("--slots", type=int, default=16, help="server.parallel (64 x 16 = 1,024 stream slots)")
    parser.add_argument("--stream-tps", type=float, default=10.0, help="a stream's tokens/s")
    parser.add_argument("--stream-tokens", type=int, default=80)
    parser.add_argument("--probe-rate", type=float, default=40.0, help="probes/s during the streams, both ways")
    parser.add_argument("--stop-p99-ms", type=float, default=50.0, help="no higher rate once the added p99 passes")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--monitor-s", type=float, default=10.0,
                        help="monitor.interval_s: the daemon's passes over 64 instances took most of a CPU at 2 s")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--ready-s", type=float, default=240.0)
    parser.add_argument("--json", help="also write every row here")
    return parser.parse_args(argv)


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace, tmp: Path, emit: Any = print) -> list[dict[str, Any]]:
    counts = sorted(int(x) for x in args.instances.split(","))
    configs = args.configs.split(",")
    calib = calibration(tmp / "calibration.json", args.stream_tps)
    assets = shared_assets(calib)
    rows: list[dict[str, Any]] = []
    for instances in counts:
        for config in configs:
            t = time.monotonic()
            door, ports, info = start(instances, config, args, tmp, assets, calib)
            emit(f"# {instances} instances, {config}: ready in {time.monotonic() - t:.0f} s; haproxy.cfg: nbthread "
                 f"{info['nbthread']}, pick Lua {info['pick_lua']}, token filter {info['token_filter']}, tenants "
                 f"{info['tenants']}; HAProxy pids {info['haproxy_pids']}")
            try:
                # warm: connections, the Lua's homes
                rate_step(door, ports, 50, argparse.Namespace(**{**vars(args), "step_s": 1.0}), 0.0)
                idle = idle_cpu(door)
                if args.pick_rate:
                    emit(RATE_HEADER)
                    for _ in range(args.pick_repeats):
                        r = rate_step(door, ports, args.pick_rate, args, idle)
                        rows.append({"kind": "pick", "instances": instances, "config": config, **info, **r})
                        emit(rate_row(instances, config, r) + "  (pick)")
                if instances == (args.sweep_at or counts[-1]):
                    emit(RATE_HEADER)
                    for rate in floats(args.rates):
                        r = rate_step(door, ports, rate, args, idle)
                        rows.append({"kind": "rate", "instances": instances, "config": config, **info, **r})
                        emit(rate_row(instances, config, r))
                        if r["added_p99_ms"] > args.stop_p99_ms or r["fd"]["errors"] > 0.05 * r["fd"]["n"] + 5:
                            break
                    stream_list = [int(x) for x in floats(args.streams)]
                    if stream_list:
                        emit(STREAM_HEADER)
                    for count in stream_list:
                        r = streams_step(door, ports, count, args, idle)
                        rows.append({"kind": "streams", "instances": instances, "config": config, **info, **r})
                        emit(stream_row(instances, config, r, args.stream_tokens / args.stream_tps))
            finally:
                door.stop()
    return rows


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def ratios(rows: list[dict[str, Any]], emit: Any = print) -> None:
    picks: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["kind"] == "pick":
            picks.setdefault((r["instances"], r["config"]), []).append(r)
    net = {k: median([r["haproxy_net_us_per_req"] for r in v]) for k, v in picks.items()}
    for config in CONFIGS:
        got = sorted((i, us) for (i, c), us in net.items() if c == config)
        if len(got) > 1:
            emit(f"# pick's cost, {config}: HAProxy net µs/request (median) "
                 + ", ".join(f"{i} inst {us:.0f}" for i, us in got)
                 + f"; {got[-1][0]}/{got[0][0]} instances: {got[-1][1] / max(got[0][1], 1e-9):.2f}x")
    for i in sorted({i for i, _ in net}):
        base = net.get((i, "none"))
        for config in CONFIGS:
            if config != "none" and (i, config) in net and base:
                emit(f"# {i} instances, {config} / none: HAProxy net CPU per request {net[(i, config)] / base:.2f}x "
                     f"({net[(i, config)]:.0f} vs {base:.0f} µs)")
    for config in CONFIGS:
        steps = [r for r in rows if r["kind"] == "rate" and r["config"] == config]
        if steps:
            us = median([r["haproxy_net_us_per_req"] for r in steps])
            over = [r["rate"] for r in steps if r["added_p99_ms"] > 5]
            emit(f"# {config}: median HAProxy net {us:.0f} µs/request -> one core saturates near {1e6 / us:.0f} req/s; "
                 "added p99 first past 5 ms at " + (f"{over[0]:.0f} req/s offered" if over else "no rate measured"))
    for config in CONFIGS:
        streams = [r for r in rows if r["kind"] == "streams" and r["config"] == config]
        if streams:
            us = median([r["haproxy_net_us_per_event"] for r in streams])
            emit(f"# {config}: streams, median HAProxy net {us:.1f} µs/event -> one core near {1e6 / us:.0f} events/s")


def main() -> None:
    args = options()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-fdcap-"))
    tmp.chmod(0o755)
    print(f"# front door capacity: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; step "
          f"{args.step_s:g} s, slots {args.slots}; streams {args.stream_tokens} tokens at {args.stream_tps:g}/s; "
          f"probes {args.probe_rate:g}/s", flush=True)
    rows: list[dict[str, Any]] = []
    try:
        rows = run(args, tmp, lambda line: print(line, flush=True))
        ratios(rows)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
