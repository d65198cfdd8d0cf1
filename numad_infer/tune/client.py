"""The HTTP client that talks to one measuring server: completions timed from the client
side, and from them the decode and prompt-processing rates."""

from __future__ import annotations

import http.client
import json
import secrets
import time

from numad_infer.tune.errors import TuneError
from numad_infer.util.addresses import connect_host


class Client:
    """Completions against one server, timed from the client: the same for both engines."""

    def __init__(self, host: str, port: int, key: str | None, no_stop: dict[str, object] | None = None) -> None:
        self.host = connect_host(host)
        self.port, self.key = port, key
        # Engine.no_stop_fields: a measurement must not end where the model draws EOS.
        self.no_stop = no_stop or {}

    def complete(self, prompt: str, max_tokens: int) -> tuple[float, int, int]:
        """(seconds, prompt tokens, completion tokens)."""
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **self.no_stop}).encode()
        headers = {"Content-Type": "application/json"}
        if self.key is not None:
            headers["Authorization"] = f"Bearer {self.key}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        started = time.monotonic()
        try:
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        elapsed = time.monotonic() - started
        if response.status != 200:
            raise TuneError(f"completion failed: HTTP {response.status}: {data[:200]!r}")
        usage = json.loads(data)["usage"]
        return elapsed, usage["prompt_tokens"], usage["completion_tokens"]

    @staticmethod
    def fresh(words: int) -> str:
        # A new first word every time: neither engine may reuse a cached prompt prefix.
        return secrets.token_hex(4) + " " + " ".join(f"word{i % 97}" for i in range(words))

    def decode_rate(self, tokens: int) -> float:
        """Generated tokens/s, from the arrival times of a streamed completion's tokens: the
        first token (which carries the prompt's time) starts the clock, the last stops it."""
        body = json.dumps({"prompt": self.fresh(8), "max_tokens": tokens, "temperature": 0, "stream": True,
                           **self.no_stop}).encode()
        headers = {"Content-Type": "application/json"}
        if self.key is not None:
            headers["Authorization"] = f"Bearer {self.key}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        arrivals: list[float] = []
        try:
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            response = conn.getresponse()
            if response.status != 200:
                raise TuneError(f"completion failed: HTTP {response.status}: {response.read()[:200]!r}")
            for raw in response:
                line = raw.strip()
                if line.startswith(b"data: {") and b'"text":""' not in line.replace(b" ", b""):
                    arrivals.append(time.monotonic())
        finally:
            conn.close()
        if len(arrivals) < 3:
            raise TuneError(f"asked for {tokens} streamed tokens, got {len(arrivals)}")
        return (len(arrivals) - 1) / max(arrivals[-1] - arrivals[0], 1e-6)

    def prompt_rate(self, words: int) -> float:
        """Prompt tokens/s: a long prompt against a short one, one token generated each."""
        short, short_tokens, _ = self.complete(self.fresh(4), 1)
        long, long_tokens, _ = self.complete(self.fresh(words), 1)
        return (long_tokens - short_tokens) / max(long - short, 1e-6)

