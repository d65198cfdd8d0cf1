#!/usr/bin/env python3
"""The token filter on several HAProxy threads (issue 60, part 1): does a worker still crash?

With `[[tenants]]` the rendered haproxy.cfg holds `nbthread 1` (frontdoor/token_count.py,
`global_rules`): HAProxy 2.6 ran the Lua filter of the shared Lua state unsafely on several
threads (Lua errors, a worker's SIGSEGV). Here each variant (an HAProxy binary and a thread
count) runs the same fleet as bench/frontdoor_capacity.py (its Door: the daemon's own code,
two tenants, prefix routing, stand-ins) --runs times, each run a fresh daemon, under the
same load, every answer through the token filter: the smoke test's closed loop (--clients,
one in three streaming, the others later turns sent whole; with few --slots they queue, and
the pick's wait and the hold run beside the filter), a rate step of whole chat requests,
then each stream step (N concurrent streams with /tokenize probes beside them). Per run:
HAProxy worker crashes (exit 139 / SIGSEGV and any other worker exit in HAProxy's output,
which the daemon writes to run/logs/frontdoor.log), Lua runtime errors there, failed
requests and streams, and HAProxy's CPU per request and per streamed event.

The thread count is a bench-side wrapper, not a numad_infer/ option: the fleet's
`frontend.haproxy` is a small script that writes a copy of the daemon's haproxy.cfg with
`nbthread N` in place of its nbthread line (or after `global` where there is none) and
executes the real binary on the copy. A reload would re-read the copy, not the daemon's new
file: a run whose HAProxy processes changed is marked RELOADED (and RESTARTED: the daemon
starts HAProxy again after a worker's crash); no reload is expected, nothing changes.
Thread count 0 runs the binary as the daemon renders it (`nbthread 1` with tenants).

    .venv/bin/python bench/frontdoor_threads.py \\
        [--variants /usr/sbin/haproxy:2,/var/tmp/haproxy30/haproxy:2] [--runs 4] [--instances 2] \\
        [--clients 6] [--slots 16] [--rate 300] [--streams 64,256] [--step-s 5] [--json FILE]

HAProxy 3.0 on this Debian 12 host: bench/README.md ("The token filter on several
threads") says how its binary was taken from a trixie root (mmdebstrap, patchelf).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import frontdoor_capacity as fc  # noqa: E402

WRAPPER = """#!/bin/sh
# bench/frontdoor_threads.py: {real} on {threads} threads
for a do
  shift
  if [ "$prev" = "-f" ]; then
    copy=$(mktemp {spool}/haproxy.XXXXXX.cfg)
    awk -v n={threads} '/^[ \\t]*nbthread[ \\t]/ {{ next }} {{ print }}
      /^global[ \\t]*$/ && !done {{ print "    nbthread " n; done = 1 }}' "$a" > "$copy"
    a=$copy
  fi
  set -- "$@" "$a"
  prev=$a
done
exec {real} "$@"
"""
EXIT = re.compile(r"exited with code (\d+)( \([^)]*\))?")  # the master's line on a worker that died
LUA_ERROR = re.compile(r"lua.*(runtime error|error)|attempt to|yield across|stack overflow", re.I)


def wrapper(real: str, threads: int, where: Path) -> str:
    """The binary the daemon runs: `real` itself (threads 0) or a script setting its threads."""
    if threads == 0:
        return real
    spool = where / "spool"
    spool.mkdir(exist_ok=True)
    spool.chmod(0o1777)  # HAProxy runs as its own user and writes its copy there
    path = where / f"haproxy-{abs(hash(real)) % 10_000}-{threads}t"
    path.write_text(WRAPPER.format(real=real, threads=threads, spool=spool))
    path.chmod(0o755)
    return str(path)


def version(real: str) -> str:
    out = subprocess.run([real, "-v"], capture_output=True, text=True, timeout=10).stdout
    found = re.search(r"version (\S+)", out)
    return found.group(1) if found else "?"


DOOR = fc.Door


def door_with(binary: str) -> type[fc.Door]:
    """fc.Door whose configuration names `binary` as frontend.haproxy (the tenants follow it)."""
    class BinaryDoor(DOOR):
        def _tenants(self, work: Path) -> str:  # type: ignore[override]
            return f'haproxy = "{binary}"\n' + DOOR._tenants(work)
    return BinaryDoor


def turn_payload(i: int, key: str | None) -> bytes:
    """A conversation's later turn, sent whole: the prefix pick looks for its home."""
    body = json.dumps({"model": "bench", "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "system", "content": f"You are assistant {i % fc.SYSTEMS}, brief."},
        {"role": "user", "content": f"conversation {i}"}, {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "and then"}]}).encode()
    return fc.post_bytes("/v1/chat/completions", body, key)


def mixed_step(door: fc.Door, args: argparse.Namespace, idle: float) -> dict[str, Any]:
    """As tests/frontdoor/test_tenants.py's smoke test: --clients clients in a closed loop for
    --mixed-s seconds, one in three streaming (--mixed-tokens tokens), the others sending
    later turns whole; with few slots the requests queue and wait (the pick's wait, the hold)."""
    async def run() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        stop = loop.time() + args.mixed_s
        out = {"events": 0, "done": 0, "failed": 0}
        whole = fc.Step()
        counter = itertools.count()

        async def client(n: int) -> None:
            pool = fc.Pool()
            try:
                while loop.time() < stop:
                    i = next(counter)
                    if n % 3 == 0:
                        await fc.stream(door.port, i, door.key, args.mixed_tokens, args.timeout_s * 4, out)
                        continue
                    try:
                        status, _ = await pool.request(door.port, turn_payload(i, door.key), args.timeout_s * 4)
                    except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError) as exc:
                        status = type(exc).__name__  # type: ignore[assignment]
                    if status == 200:
                        whole.latencies.append(0.0)
                    else:
                        whole.errors += 1
                        whole.statuses[str(status)] = whole.statuses.get(str(status), 0) + 1
            finally:
                pool.close()

        await asyncio.gather(*(client(n) for n in range(args.clients)))
        return {"whole_ok": len(whole.latencies), "whole_errors": whole.errors, "statuses": whole.statuses, **out}

    with fc.Meter(door) as m:
        got = asyncio.run(run())
    return {"kind": "mixed", **got, "fd": {"errors": got["whole_errors"]}, "haproxy_cpu_share": m.h / m.wall,
            "haproxy_net_us_per_req": max(m.h - idle * m.wall, 0.0) / max(got["whole_ok"] + got["done"], 1) * 1e6,
            "reloaded": m.reloaded}


def one_run(variant: str, binary: str, args: argparse.Namespace, tmp: Path, assets: Any, calib: Path
            ) -> dict[str, Any]:
    fc.Door = door_with(binary)  # type: ignore[misc]  # fc.start builds fc.Door
    try:
        door, ports, info = fc.start(args.instances, "tenants-prefix", args, tmp, assets, calib)
    finally:
        fc.Door = DOOR  # type: ignore[misc]
    steps: list[dict[str, Any]] = []
    try:
        spool = tmp / "spool"
        cfgs = sorted(spool.glob("*.cfg"), key=lambda p: p.stat().st_mtime) if spool.exists() else []
        running = cfgs[-1].read_text() if cfgs else door.rendered()
        threads = [ln.split()[1] for ln in running.splitlines() if ln.strip().startswith("nbthread")]
        idle = fc.idle_cpu(door, 2.0)
        if args.clients:
            steps.append(mixed_step(door, args, idle))
        if args.rate:
            steps.append({"kind": "rate", **fc.rate_step(door, ports, args.rate, args, idle)})
        for count in fc.floats(args.streams):
            steps.append({"kind": "streams", **fc.streams_step(door, ports, int(count), args, idle)})
        log_path = door.state_file.parent / "logs" / "frontdoor.log"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        alive = [p.pid for p in door.processes()[0]]
    finally:
        door.stop()
    exits = [m.group(1) + (m.group(2) or "") for m in EXIT.finditer(log)]
    lua = [ln for ln in log.splitlines() if LUA_ERROR.search(ln) and not ln.startswith("<")]  # not its syslog copy
    return {"variant": variant, "nbthread": threads[0] if threads else "default", "steps": steps,
            "worker_exits": exits, "segv": sum(e.startswith("139") for e in exits),
            "lua_errors": len(lua), "lua_samples": lua[:5], "pids_before": info["haproxy_pids"], "pids_after": alive,
            "failed": sum(s["fd"]["errors"] + s.get("failed", 0) for s in steps),
            "reloaded": any(s["reloaded"] for s in steps), "log_tail": log[-1500:]}


def row(r: dict[str, Any]) -> str:
    rate = [s for s in r["steps"] if s["kind"] == "rate"]
    streams = [s for s in r["steps"] if s["kind"] == "streams"]
    us_req = f"{rate[0]['haproxy_net_us_per_req']:.0f}" if rate else "-"
    us_ev = "/".join(f"{s['haproxy_net_us_per_event']:.1f}" for s in streams) or "-"
    done = "/".join(f"{s['done']}of{s['streams']}" for s in streams) or "-"
    mixed = [s for s in r["steps"] if s["kind"] == "mixed"]
    mix = f"{mixed[0]['whole_ok']}+{mixed[0]['done']}" if mixed else "-"
    restarted = set(r["pids_before"]) != set(r["pids_after"])
    return (f"{r['variant']:<34} {r['nbthread']:>3} {r['segv']:>4} {len(r['worker_exits']):>5} {r['lua_errors']:>4} "
            f"{r['failed']:>5} {mix:>9} {done:>16} {us_req:>7} {us_ev:>11}"
            + (" RESTARTED" if restarted else "") + (" RELOADED" if r["reloaded"] else ""))


HEADER = (f"{'variant':<34} {'thr':>3} {'segv':>4} {'exits':>5} {'lua':>4} {'fail':>5} {'mixed ok':>9} "
          f"{'streams done':>16} {'µs/req':>7} {'µs/event':>11}")


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--variants", default="/usr/sbin/haproxy:2,/var/tmp/haproxy30/haproxy:2",
                        help="BINARY:THREADS,... (threads 0: as rendered, nbthread 1 with tenants)")
    parser.add_argument("--runs", type=int, default=4, help="runs per variant, interleaved")
    parser.add_argument("--instances", type=int, default=2, help=f"of {sorted(fc.SETUPS)}")
    parser.add_argument("--rate", type=float, default=300.0, help="whole chat requests/s (0: none)")
    parser.add_argument("--streams", default="64,256", help="concurrent stream steps")
    parser.add_argument("--clients", type=int, default=6, help="the smoke test's closed loop (0: none)")
    parser.add_argument("--mixed-s", type=float, default=12.0, help="its seconds")
    parser.add_argument("--mixed-tokens", type=int, default=6, help="its streams' tokens")
    parser.add_argument("--json", help="also write every run here")
    # what bench/frontdoor_capacity.py's steps read, its defaults
    base = fc.options([])
    for name in ("step_s", "slots", "stream_tps", "stream_tokens", "probe_rate", "context", "monitor_s",
                 "timeout_s", "ready_s"):
        parser.add_argument("--" + name.replace("_", "-"), type=type(getattr(base, name)),
                            default=getattr(base, name))
    return parser.parse_args(argv)


def main() -> None:
    args = options()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="numa-infer-fdthr-"))
    tmp.chmod(0o755)
    variants = []
    for spec in args.variants.split(","):
        real, _, threads = spec.rpartition(":")
        variants.append((f"{version(real)} {real}:{threads}", wrapper(real, int(threads), tmp)))
    print(f"# token filter on threads: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"{args.instances} instances, rate {args.rate:g}/s, streams {args.streams}, {args.runs} runs", flush=True)
    print(HEADER, flush=True)
    calib = fc.calibration(tmp / "calibration.json", args.stream_tps)
    assets = fc.shared_assets(calib)
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(args.runs):
            for variant, binary in variants:
                for old in (tmp / "spool").glob("*.cfg") if (tmp / "spool").exists() else []:
                    old.unlink()
                t = time.monotonic()
                r = one_run(variant, binary, args, tmp, assets, calib)
                rows.append(r)
                print(row(r) + f"  ({time.monotonic() - t:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
                for line in r["lua_samples"][:2]:
                    print(f"#   lua: {line[:200]}", flush=True)
                for e in r["worker_exits"][:2]:
                    print(f"#   exit: {e}", flush=True)
        for variant, _ in variants:
            mine = [r for r in rows if r["variant"] == variant]
            print(f"# {variant}: {len(mine)} runs, {sum(r['segv'] > 0 for r in mine)} with a SIGSEGV, "
                  f"{sum(bool(r['worker_exits']) for r in mine)} with a worker exit, "
                  f"{sum(r['lua_errors'] > 0 for r in mine)} with Lua errors, "
                  f"{sum(r['failed'] > 0 for r in mine)} with failed requests")
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
