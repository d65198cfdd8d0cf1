"""Many stand-in instances in one asyncio process, each started and stopped on its own by
the bench's backend (bench/standin/fleet_daemon.py), issue 59 part 2.

The daemon starts an instance with llama-server's command line (its launch's argv); the
backend passes that argv here, one JSON line on stdin, and this process starts a
server.py `Instance` for it on the port the argv names, with the rates of --calibration:

    {"op": "start", "name": "infer@0.0", "argv": ["/path/llama-server", "--port", "18000", ...]}
    {"op": "stop", "name": "infer@0.0"}

Each is answered with one JSON line on stdout ({"ok": true, "name": ..., "port": ...} or
{"ok": false, "error": ...}) once the port is bound or closed. No pinning: this host lacks
the planned CPUs. A stopped instance's listener closes; its open connections finish.

The one mark that is not llama-server's: a response's `system_fingerprint` names the port
that answered (`b1-standin-pPORT`), so the load generator sees which instance served each
turn (llama-server's carries its build). stdin closed (the backend gone): exit.

    .venv/bin/python -m bench.standin.fleet_host --calibration bench/standin/calibration.json [--jitter 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from typing import Any

from bench.standin.server import Instance, calibration_of, parse


class TaggedInstance(Instance):
    """server.py's Instance, its answers naming its port (system_fingerprint)."""

    def _common(self, ident: str, obj: str) -> dict[str, Any]:
        doc = super()._common(ident, obj)
        doc["system_fingerprint"] = f"b1-standin-p{self.port}"
        return doc


async def serve(calibration: str | None, jitter: float) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: dict[str, Instance] = {}

    def answer(doc: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()

    while line := await reader.readline():
        try:
            command = json.loads(line)
            name = str(command["name"])
            if command["op"] == "start":
                old = running.pop(name, None)
                if old is not None:
                    await old.stop()
                args = parse([str(a) for a in command["argv"][1:]])
                if calibration:
                    args.calibration = calibration
                args.jitter = jitter
                tagged = TaggedInstance(args.port, args, calibration_of(args))
                await tagged.start()
                running[name] = tagged
                answer({"ok": True, "name": name, "port": tagged.port})
            elif command["op"] == "stop":
                old = running.pop(name, None)
                if old is not None:
                    await old.stop()
                answer({"ok": True, "name": name})
            else:
                answer({"ok": False, "name": name, "error": f"unknown op {command['op']!r}"})
        except (KeyError, ValueError, TypeError, OSError, SystemExit) as exc:
            answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    for instance in running.values():
        await instance.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calibration", default=None)
    parser.add_argument("--jitter", type=float, default=0.0)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.calibration, args.jitter))


if __name__ == "__main__":
    main()
