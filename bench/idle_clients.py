#!/usr/bin/env python3
"""Clients without a key that send nothing, against a tenant's request, side by side in one
run: the daemon's own front-door code over a real HAProxy, two tenants, echoing stand-ins
for the instances (the instances are not what is measured).

The attacker holds as many idle connections as HAProxy takes (its global `maxconn`) plus
`--extra`, sending nothing. `once`: opened once, from 127.0.0.1 (the review's repro: 534
sockets, then a keyed request waited 30.0 s). `reopen`: each reopened as soon as HAProxy
closes it, from addresses spread over 127/8 (a local user may bind any of them), for
`--seconds`. Meanwhile a tenant sends requests one after another from an address of its
own, each on a new connection; the time each takes is reported (an echo answers in about
a millisecond), and how many were answered 200 (a refused connection counts as failed).

Cases: `30 s` is the front door before tuning.header_timeout_s (HAProxy's `timeout http-request`
of 30 s for the headers), then the default (5 s), then the default with
`connections_per_source = 64`.

    .venv/bin/python bench/idle_clients.py [--extra 20] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numad_infer.config.apikey import read_tenant_keys  # noqa: E402
from tests.daemon_harness import wait_for  # noqa: E402
from tests.frontdoor.harness import Door  # noqa: E402
from tests.frontdoor.tenant_door import KEY_A, KEY_B, Echo, EchoServer, key_file, post, tenant_tables  # noqa: E402

TENANT_SOURCE = "127.0.0.254"  # the tenant's own address: a per-source cap on the attacker's is not its


def _ask(port: int) -> int:
    """One tenant request on a new connection: its status, 0 when the connection failed."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(TENANT_SOURCE, 0))
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps({"model": "m", "messages": []}),
                     headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return 0
    finally:
        conn.close()

# (name, [frontend] keys, [tuning] keys)
CASES = (("30 s (before)", "", "header_timeout_s = 30\n"), ("5 s (default)", "", ""),
         ("5 s, 64 per source", "connections_per_source = 64\n", ""))


async def _hold(port: int, source: str, stop: float, reopen: bool, opened: list[int]) -> None:
    """One idle connection: open, send nothing, wait for HAProxy to close it; again if `reopen`."""
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(0.05)
            continue
        opened[0] += 1
        with contextlib.suppress(TimeoutError, OSError):  # closed by HAProxy, or the case's end
            await asyncio.wait_for(reader.read(), max(0.01, stop - time.monotonic()))
        writer.close()
        if not reopen:
            await asyncio.sleep(max(0.0, stop - time.monotonic()))
            return


def _attack(port: int, count: int, seconds: float, reopen: bool, opened: list[int]) -> None:
    async def run() -> None:
        stop = time.monotonic() + seconds
        sources = [f"127.{1 + n // 250 % 250}.{n % 250 + 1}.7" if reopen else "127.0.0.1" for n in range(count)]
        await asyncio.gather(*(_hold(port, s, stop, reopen, opened) for s in sources))
    asyncio.run(run())


def _case(tmp: Path, frontend: str, tuning: str, mode: str, args: argparse.Namespace) -> str:
    keys = tmp / "keys"
    key_file(keys, "a", KEY_A)
    key_file(keys, "b", KEY_B)
    door = Door(tmp, extra=frontend + tenant_tables(keys) + (f"[tuning]\n{tuning}" if tuning else ""))
    stubs = [EchoServer(("127.0.0.1", i.port), Echo) for i in door.plan.instances]
    for stub in stubs:
        threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        assert door.apply(read_tenant_keys(door.config, "bench.toml"))
        wait_for(lambda: post(door.port, KEY_A).status == 200, "the front door serving")
        text = door.door.paths.config.read_text()
        maxconn = int(next(line.split()[1] for line in text.splitlines() if line.startswith("    maxconn ")))
        opened = [0]
        attacker = threading.Thread(target=_attack, args=(door.port, maxconn + args.extra, args.seconds,
                                                          mode == "reopen", opened))
        attacker.start()
        time.sleep(2)  # every connection open
        waits, codes = [], []
        until = time.monotonic() + args.seconds - 3
        while time.monotonic() < until:
            started = time.monotonic()
            codes.append(_ask(door.port))
            waits.append(time.monotonic() - started)
        attacker.join()
        ok = sum(c == 200 for c in codes)
        return (f"{mode:7} {maxconn + args.extra:5} {opened[0]:7} {len(codes):5} {ok:4} "
                f"{statistics.median(waits):8.2f} {max(waits):8.2f}")
    finally:
        door.stop()
        for stub in stubs:
            stub.shutdown()
            stub.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extra", type=int, default=20, help="connections beyond HAProxy's maxconn")
    parser.add_argument("--seconds", type=float, default=20, help="how long each case runs")
    args = parser.parse_args()
    print(f"{'case':20} {'attack':7} {'conns':>5} {'opened':>7} {'reqs':>5} {'200':>4} {'p50 s':>8} {'max s':>8}")
    for name, frontend, tuning in CASES:
        for mode in ("once", "reopen"):
            with tempfile.TemporaryDirectory() as tmp:
                print(f"{name:20} {_case(Path(tmp), frontend, tuning, mode, args)}", flush=True)


if __name__ == "__main__":
    main()
