"""HTTP health probe of one llama-cpp-python server.

The server has no /health; `GET /v1/models` answers once the model is loaded.
"""

from __future__ import annotations

import http.client
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    latency_s: float
    error: str = ""


def probe(host: str, port: int, timeout_s: float, path: str = "/v1/models") -> ProbeResult:
    # A wildcard listen address is reachable on loopback.
    target = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    started = time.monotonic()
    conn = http.client.HTTPConnection(target, port, timeout=timeout_s)
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
