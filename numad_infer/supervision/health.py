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
"""

from __future__ import annotations

import http.client
import time
from dataclasses import dataclass
from enum import Enum

from numad_infer.engines import Engine, EngineCounters
from numad_infer.util.addresses import connect_host


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
    before it waits on the model, so a refused key answers at once even while it is busy."""
    conn = http.client.HTTPConnection(connect_host(host), port, timeout=timeout_s)
    try:
        conn.request("GET", path, headers={"Connection": "close", "Authorization": f"Bearer {key}"})
        status = conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return KeyCheck.UNKNOWN
    finally:
        conn.close()
    if status in (401, 403):
        return KeyCheck.REJECTED
    return KeyCheck.ACCEPTED if status == 200 else KeyCheck.UNKNOWN


def probe(host: str, port: int, timeout_s: float, path: str) -> ProbeResult:
    started = time.monotonic()
    conn = http.client.HTTPConnection(connect_host(host), port, timeout=timeout_s)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        response = conn.getresponse()
        response.read(65536)
        elapsed = time.monotonic() - started
        if response.status != 200:
            return ProbeResult(False, elapsed, f"HTTP {response.status}")
        return ProbeResult(True, elapsed)
    except TimeoutError:
        return ProbeResult(False, time.monotonic() - started, f"no answer within {timeout_s:g}s")
    except OSError as exc:
        return ProbeResult(False, time.monotonic() - started, exc.strerror or type(exc).__name__)
    except http.client.HTTPException as exc:
        return ProbeResult(False, time.monotonic() - started, f"bad HTTP answer: {type(exc).__name__}")
    finally:
        conn.close()


def read_engine_metrics(engine: Engine, host: str, port: int, key: str | None,
                        timeout_s: float) -> EngineCounters | None:
    """The server's own counters, or None (none at all, not answering, a refused key)."""
    if engine.metrics_path is None:
        return None
    conn = http.client.HTTPConnection(connect_host(host), port, timeout=timeout_s)
    headers = {"Connection": "close"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request("GET", engine.metrics_path, headers=headers)
        response = conn.getresponse()
        body = response.read(1 << 20)
        if response.status != 200:
            return None
        return engine.parse_metrics(body.decode("utf-8", "replace"))
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
