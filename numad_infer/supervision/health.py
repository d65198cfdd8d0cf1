"""HTTP health probe of one server: busy is not hung.

The path is the engine's (`Engine.liveness_path`). llama-cpp-python has no
/health, and `GET /v1/models` waits on the model lock: while a request generates it
either cuts that request short (interrupt_requests) or waits until the generation ends
and looks dead. That server loads its model before it listens, and generation runs in a
worker thread (ctypes releases the GIL), so any route that never takes the lock answers
at once when the server is up, busy or not: FastAPI's own `/docs` page. llama-server
answers `/health` from its HTTP threads (503 while loading). A SIGSTOPped or wedged
server still fails either; a generation that stops making progress is found from CPU
time instead (see `reconcile`).

Each call's timeout is one deadline for the whole call and each answer has a cap
(util/peer.py): an instance runs as another user, and one that drips its answer a byte at
a time must not hold the daemon's pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from enum import Enum

from numad_infer.engines import Engine, EngineCounters
from numad_infer.util.addresses import connect_host
from numad_infer.util.peer import NoAnswer, PeerError, http_get

# The engine's counters: llama-server's /metrics is about 2 KiB; a scrape past this is no
# server of ours, and is refused before the rest of it is read. Its /slots is about 1.5 KiB
# a slot (each slot's sampling parameters): 64 slots, the most server.parallel allows, fit.
METRICS_CAP = 1 << 20


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    latency_s: float
    error: str = ""


class KeyCheck(Enum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"  # 401/403: the instance requires another key
    UNKNOWN = "unknown"  # busy (no answer in time) or another error: ask again later


def check_key(host: str, port: int, key: str, timeout_s: float, path: str) -> KeyCheck:
    """Does the instance take this API key? `path` (`Engine.key_check_path`) authenticates
    before it waits on the model, so a refused key answers at once even while it is busy.
    `timeout_s` bounds the whole call; only the status is read."""
    try:
        status = http_get(connect_host(host), port, path, {"Authorization": f"Bearer {key}"}, timeout_s, None).status
    except (OSError, PeerError):
        return KeyCheck.UNKNOWN
    if status in (401, 403):
        return KeyCheck.REJECTED
    return KeyCheck.ACCEPTED if status == 200 else KeyCheck.UNKNOWN


def probe(host: str, port: int, timeout_s: float, path: str) -> ProbeResult:
    """One GET of the liveness route, `timeout_s` for all of it (connect, send, status line
    and headers); the body is not read: the status says it all."""
    started = time.monotonic()
    try:
        answer = http_get(connect_host(host), port, path, {}, timeout_s, None)
    except NoAnswer:
        return ProbeResult(False, time.monotonic() - started, f"no answer within {timeout_s:g}s")
    except PeerError as exc:
        return ProbeResult(False, time.monotonic() - started, f"bad HTTP answer: {exc}")
    except OSError as exc:
        return ProbeResult(False, time.monotonic() - started, exc.strerror or type(exc).__name__)
    elapsed = time.monotonic() - started
    if answer.status != 200:
        return ProbeResult(False, elapsed, f"HTTP {answer.status}")
    return ProbeResult(True, elapsed)


def read_engine_metrics(engine: Engine, host: str, port: int, key: str | None,
                        timeout_s: float) -> EngineCounters | None:
    """The server's own counters, or None (none at all, not answering within `timeout_s`, a
    refused key, a scrape longer than METRICS_CAP); with its KV cache's use where the engine
    has a route for it, both calls within the one `timeout_s`."""
    if engine.metrics_path is None:
        return None
    deadline = time.monotonic() + timeout_s
    body = _get(host, port, engine.metrics_path, key, timeout_s)
    counters = None if body is None else engine.parse_metrics(body)
    if counters is None or engine.kv_cache_path is None:
        return counters
    left = deadline - time.monotonic()
    body = _get(host, port, engine.kv_cache_path, key, left) if left > 0 else None
    kv = None if body is None else engine.parse_kv_cache(body)
    return counters if kv is None else replace(counters, kv_cache_tokens=kv.tokens, kv_cache_size=kv.size)


def _get(host: str, port: int, path: str, key: str | None, timeout_s: float) -> str | None:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    try:
        answer = http_get(connect_host(host), port, path, headers, timeout_s, METRICS_CAP)
    except (OSError, PeerError):
        return None
    return answer.body.decode("utf-8", "replace") if answer.status == 200 else None
