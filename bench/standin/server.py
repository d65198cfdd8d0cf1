"""The stand-in's HTTP side: one asyncio process, one listening port per instance, each
instance an `Engine` (model.py) driven by the loop's clock, answering what numa-infer and
its clients ask of llama-server (routes, field names and error bodies read from the real
server's answers: bench/README.md, "A llama-server stand-in").

    .venv/bin/python -m bench.standin --ports 28080,28081 -np 4 --cache-ram 256 \\
        --prefill-tps 250 --decode-tps "1:40,2:30,4:20"
    .venv/bin/python -m bench.standin --ports 28080 --calibration bench/standin/calibration.json

Started as llama-server would be (--port, --ctx-size, --parallel, ... : numa-infer's own
command line; options it does not model are taken and ignored), it serves that one port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import struct
import sys
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from bench.standin.model import Engine, Rates, Task, Tokenizer, chat_text

VERSION = "version: 0.5.0-dev (build 1, commit standin)\nbuilt with Python for numa-infer's bench (bench/standin)\n"
KEEPALIVE_S = 5.0
DEFAULT_MAX_TOKENS = 16  # the real server generates until end of text or context; a stand-in must stop
SLOT_MAGIC = b"NISTANDIN1"
_FILENAME = re.compile(r"^[A-Za-z0-9._-]+$")

# What calibrate.py measured last on the 2-CPU host (bench/README.md); --calibration or the
# rate options replace them.
DEFAULTS: dict[str, Any] = {
    "prefill_tps": {"1": 60.0, "128": 200.0, "512": 190.0, "1024": 170.0},
    "decode_tps": {"1": 55.0, "2": 40.0, "4": 25.0},
    "bytes_per_token": 2.2,
    "kv_bytes_per_token": 49152,
    "cached_ms_per_token": 0.0,
}


def _error(code: int, message: str, kind: str) -> tuple[int, dict[str, Any]]:
    return code, {"error": {"code": code, "message": message, "type": kind}}


class Instance:
    """One llama-server stand-in on one port."""

    def __init__(self, port: int, args: argparse.Namespace, calibration: dict[str, Any]) -> None:
        self.port = port
        self.host = args.host
        self.args = args
        rates = Rates({int(k): float(v) for k, v in calibration["prefill_tps"].items()},
                      {int(k): float(v) for k, v in calibration["decode_tps"].items()},
                      float(calibration.get("cached_ms_per_token", 0.0)) / 1000)
        self.parallel = max(args.parallel, 1)
        self.n_ctx = (args.ctx_size // self.parallel) if args.ctx_size > 0 else 2048
        self.engine = Engine(rates, self.parallel, self.n_ctx, args.cache_ram, args.slot_prompt_similarity,
                             int(calibration["kv_bytes_per_token"]), args.batch_size,
                             not args.no_cache_idle_slots, self._noise(args.jitter))
        self.tokenizer = Tokenizer(float(calibration["bytes_per_token"]))
        self.model = args.alias or args.model or "standin"
        self.key = args.api_key
        self.save_dir = Path(args.slot_save_path) if args.slot_save_path else None
        self.ready_at = 0.0
        self.server: asyncio.base_events.Server | None = None
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.deferred = 0

    @staticmethod
    def _noise(jitter: float) -> Callable[[], float]:
        """Each step's time times a lognormal factor of mean 1 and relative spread `jitter`
        (0: exact). The real server's steps vary with the host; without it the stand-in
        replays one schedule, and one placement of the turns, in every run."""
        if jitter <= 0:
            return lambda: 1.0
        rng = random.Random(os.urandom(8))
        return lambda: rng.lognormvariate(-jitter * jitter / 2, jitter)

    # -- the engine's clock ------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.ready_at = loop.time() + self.args.load_s
        self.server = await asyncio.start_server(self._connection, self.host, self.port, limit=1 << 24)
        self.port = self.server.sockets[0].getsockname()[1]  # port 0: the one the system chose
        self._loop_task = asyncio.create_task(self._drive())

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._loop_task is not None:
            self._loop_task.cancel()

    async def _drive(self) -> None:
        """The engine's steps on the loop's clock: each step ends at its planned time
        (start + duration), whatever the loop's lateness, so times do not drift; a step
        begins when the last ended, or now when the engine was idle or the loop late."""
        loop = asyncio.get_running_loop()
        end = loop.time()
        while True:
            start = max(loop.time(), end)
            duration = self.engine.begin_step(start)
            if duration is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            end = start + duration
            delay = end - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.engine.end_step(end)

    def submit(self, task: Task) -> None:
        self.engine.submit(task, asyncio.get_running_loop().time())
        self._wake.set()

    def cancel(self, task: Task) -> None:
        self.engine.cancel(task, asyncio.get_running_loop().time())
        self._wake.set()

    # -- HTTP --------------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await asyncio.wait_for(reader.readline(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    break
                if not line.strip():
                    break
                method, target, *_ = line.decode("latin-1").split() + ["", ""]
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = h.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length") or 0))
                keep = headers.get("connection", "").lower() != "close"
                await self._route(method, target, headers, body, reader, writer, keep)
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, OSError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, status: int, document: Any, keep: bool,
                    content_type: str = "application/json; charset=utf-8") -> None:
        body = document if isinstance(document, bytes) else json.dumps(document, separators=(",", ":")).encode()
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 500: "Internal Server Error",
                  501: "Not Implemented", 503: "Service Unavailable"}.get(status, "")
        writer.write(f"HTTP/1.1 {status} {reason}\r\nServer: llama.cpp\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {len(body)}\r\n"
                     f"{'Keep-Alive: timeout=5, max=100' if keep else 'Connection: close'}\r\n\r\n".encode() + body)
        await writer.drain()

    async def _route(self, method: str, target: str, headers: dict[str, str], body: bytes,
                     reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keep: bool) -> None:
        url = urlsplit(target)
        path = url.path
        loading = asyncio.get_running_loop().time() < self.ready_at
        if path in ("/health", "/v1/health"):
            if loading:
                return await self._send(writer, *_error(503, "Loading model", "unavailable_error"), keep)
            return await self._send(writer, 200, {"status": "ok"}, keep)
        if loading:
            return await self._send(writer, *_error(503, "Loading model", "unavailable_error"), keep)
        if self.key is not None:
            given = headers.get("authorization", "").removeprefix("Bearer ").strip() or headers.get("x-api-key", "")
            if not secrets.compare_digest(given.encode(), self.key.encode()):
                return await self._send(writer, *_error(401, "Invalid API Key", "authentication_error"), keep)
        try:
            document = json.loads(body) if body.strip() else {}
        except ValueError:
            return await self._send(writer, *_error(400, "invalid JSON", "invalid_request_error"), keep)
        if method == "GET" and path in ("/v1/models", "/models"):
            return await self._send(writer, 200, self._models(), keep)
        if method == "GET" and path == "/props":
            return await self._send(writer, 200, self._props(), keep)
        if method == "GET" and path == "/slots":
            return await self._send(writer, 200, self._slots(), keep)
        if method == "GET" and path == "/metrics":
            return await self._send(writer, 200, self._metrics().encode(), keep, "text/plain; version=0.0.4")
        if method == "POST" and path.startswith("/slots/"):
            action = (parse_qs(url.query).get("action") or [""])[0]
            return await self._send(writer, *await self._slot_action(path[len("/slots/"):], action, document), keep)
        if method == "POST" and path == "/tokenize":
            return await self._send(writer, 200, {"tokens": self.tokenizer.encode(str(document.get("content", "")),
                                                                                   bos=False)}, keep)
        if method == "POST" and path == "/apply-template":
            return await self._send(writer, 200, {"prompt": chat_text(document.get("messages") or [])}, keep)
        kinds = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "completion",
                 "/completions": "completion", "/completion": "native"}
        if method == "POST" and path in kinds:
            if not isinstance(document, dict):
                return await self._send(writer, *_error(400, "invalid request", "invalid_request_error"), keep)
            return await self._complete(kinds[path], document, reader, writer, keep)
        return await self._send(writer, *_error(404, "File Not Found", "not_found_error"), keep)

    # -- completions -------------------------------------------------------------------------

    def _prompt(self, kind: str, document: dict[str, Any]) -> list[int]:
        if kind == "chat":
            return self.tokenizer.encode(chat_text(document.get("messages") or []))
        prompt = document.get("prompt", "")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        return self.tokenizer.encode(str(prompt))

    async def _complete(self, kind: str, document: dict[str, Any], reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, keep: bool) -> None:
        tokens = self._prompt(kind, document)
        limit = document.get("max_tokens", document.get("n_predict", document.get("max_completion_tokens")))
        max_tokens = DEFAULT_MAX_TOKENS if not isinstance(limit, int) or limit < 0 else max(limit, 1)
        changed = asyncio.Event()
        task = Task(tokens, max_tokens, id_slot=int(document.get("id_slot", -1)), notify=lambda t: changed.set())
        stream = bool(document.get("stream"))
        ident = ("chatcmpl-" if kind != "native" else "") + secrets.token_hex(16)
        self.submit(task)
        if not stream:
            gone = asyncio.ensure_future(reader.read(1))  # the client leaving: the task is cancelled
            try:
                while not task.done:
                    waiter = asyncio.ensure_future(changed.wait())
                    await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
                    changed.clear()
                    if gone.done() and not gone.cancelled() and gone.result() == b"" and not task.done:
                        waiter.cancel()
                        self.cancel(task)
                        return
            finally:
                if not gone.done():
                    gone.cancel()
            if task.error:
                return await self._send(writer, *self._task_error(task), keep)
            return await self._send(writer, 200, self._whole(kind, task, ident), keep)
        if task.error and task.done:
            return await self._send(writer, *self._task_error(task), keep)
        writer.write(b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nX-Accel-Buffering: no\r\n"
                     b"Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     + (b"Keep-Alive: timeout=5, max=100\r\n\r\n" if keep else b"Connection: close\r\n\r\n"))
        sent = 0
        try:
            await writer.drain()
            while True:
                await changed.wait()
                changed.clear()
                new = task.generated[sent:]
                finished = task.done
                events = []
                for k, (_, piece) in enumerate(new):
                    last = finished and k == len(new) - 1
                    events.extend(self._chunks(kind, task, ident, sent + k, piece, last))
                sent += len(new)
                if finished:
                    events.append(b"data: [DONE]\n\n")
                for event in events:
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                if finished:
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
                if finished:
                    return
        except (ConnectionError, OSError):
            self.cancel(task)
            raise

    def _task_error(self, task: Task) -> tuple[int, dict[str, Any]]:
        code, doc = _error(400, task.error, "exceed_context_size_error")
        doc["error"].update({"n_prompt_tokens": len(task.tokens), "n_ctx": self.n_ctx})
        return code, doc

    def _usage(self, task: Task) -> dict[str, Any]:
        return {"completion_tokens": len(task.generated), "prompt_tokens": len(task.tokens),
                "total_tokens": len(task.tokens) + len(task.generated),
                "prompt_tokens_details": {"cached_tokens": task.cached}}

    def _common(self, ident: str, obj: str) -> dict[str, Any]:
        return {"created": int(time.time()), "model": self.model, "system_fingerprint": "b1-standin",
                "object": obj, "id": ident}

    def _whole(self, kind: str, task: Task, ident: str) -> dict[str, Any]:
        text = "".join(p for _, p in task.generated)
        reason = "length"
        if kind == "native":
            return {"index": 0, "content": text, "tokens": [], "id_slot": task.slot, "stop": True,
                    "model": self.model, "tokens_predicted": len(task.generated),
                    "tokens_evaluated": len(task.tokens), "tokens_cached": task.cached, "truncated": False,
                    "stop_type": "limit", "stopping_word": "", "timings": task.timings()}
        if kind == "chat":
            choice = {"finish_reason": reason, "index": 0, "message": {"role": "assistant", "content": text}}
            obj = "chat.completion"
        else:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        common = self._common(ident, obj)
        return {"choices": [choice], "created": common["created"], "model": self.model,
                "system_fingerprint": common["system_fingerprint"], "object": obj, "usage": self._usage(task),
                "id": ident, "timings": task.timings()}

    def _chunks(self, kind: str, task: Task, ident: str, index: int, piece: str, last: bool) -> list[bytes]:
        """The events of one token, as llama-server streams them: a chat's first token is
        preceded by the assistant's role; the last is followed by one with the finish
        reason and the timings (and, for /v1/completions, the usage)."""
        out: list[dict[str, Any]] = []
        if kind == "native":
            doc: dict[str, Any] = {"index": 0, "content": piece, "tokens": [], "stop": False, "id_slot": task.slot}
            out.append(doc)
            if last:
                out.append({"index": 0, "content": "", "tokens": [], "stop": True, "id_slot": task.slot,
                            "tokens_predicted": len(task.generated), "tokens_evaluated": len(task.tokens),
                            "tokens_cached": task.cached, "stop_type": "limit", "timings": task.timings()})
        elif kind == "chat":
            common = self._common(ident, "chat.completion.chunk")
            order = ("created", "id", "model", "system_fingerprint", "object")

            def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
                return {"choices": [{"finish_reason": reason, "index": 0, "delta": delta}],
                        **{k: common[k] for k in order}}
            if index == 0:
                out.append(chunk({"role": "assistant", "content": None}))
            out.append(chunk({"content": piece}))
            if last:
                end = chunk({}, "length")
                end["timings"] = task.timings()
                out.append(end)
        else:
            common = self._common(ident, "text_completion")

            def chunk2(text: str, reason: str | None = None) -> dict[str, Any]:
                return {"choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}],
                        "created": common["created"], "model": self.model,
                        "system_fingerprint": common["system_fingerprint"], "object": "text_completion",
                        "id": ident}
            out.append(chunk2(piece))
            if last:
                end = chunk2("", "length")
                end["usage"] = self._usage(task)
                end["timings"] = task.timings()
                out.append(end)
        return [b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n" for d in out]

    # -- the other routes --------------------------------------------------------------------

    def _models(self) -> dict[str, Any]:
        return {"models": [{"name": self.model, "model": self.model, "type": "model", "capabilities": ["completion"]}],
                "object": "list",
                "data": [{"id": self.model, "aliases": [self.model], "tags": [], "object": "model",
                          "created": int(time.time()), "owned_by": "llamacpp",
                          "meta": {"vocab_type": 1, "n_vocab": 32000, "n_ctx": self.n_ctx}}]}

    def _props(self) -> dict[str, Any]:
        return {"default_generation_settings": {"params": {"n_predict": -1}, "n_ctx": self.n_ctx},
                "total_slots": self.parallel, "model_alias": self.model, "model_path": self.args.model or "",
                "chat_template": "{%- for message in messages -%}\n  {{- '<|im_start|>' + message.role + '\n' + "
                                 "message.content + '<|im_end|>\n' -}}\n{%- endfor -%}\n{%- if add_generation_prompt "
                                 "-%}\n  {{- '<|im_start|>assistant\n' -}}\n{%- endif -%}",
                "bos_token": "<s>", "eos_token": "</s>", "build_info": "b1-standin", "endpoint_slots": True,
                "endpoint_props": False, "endpoint_metrics": True, "is_sleeping": False}

    def _slots(self) -> list[dict[str, Any]]:
        out = []
        for slot in self.engine.slots:
            doc: dict[str, Any] = {"id": slot.id, "n_ctx": self.n_ctx, "speculative": False,
                                   "is_processing": slot.busy}
            task = slot.task or slot.last_task
            if task is not None:
                doc.update({"id_task": task.id, "n_prompt_tokens": len(slot.tokens),
                            "n_prompt_tokens_processed": task.prompt_n if task.t_prompt_done else 0,
                            "n_prompt_tokens_cache": task.cached,
                            "params": {"max_tokens": task.max_tokens, "n_predict": task.max_tokens},
                            "next_token": [{"has_next_token": slot.busy, "has_new_line": False,
                                            "n_remain": task.max_tokens - len(task.generated),
                                            "n_decoded": len(task.generated)}]})
            elif slot.tokens:
                doc["n_prompt_tokens"] = len(slot.tokens)
            out.append(doc)
        return out

    def _metrics(self) -> str:
        c = self.engine.counters
        rows = [
            ("prompt_tokens_total", "counter", "Number of prompt tokens processed, excluding cached tokens",
             c.prompt_tokens),
            ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache", c.prompt_cached),
            ("prompt_seconds_total", "counter", "Total time spent processing prompts", round(c.prompt_s, 6)),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed", c.predicted),
            ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens",
             round(c.predicted_s, 6)),
            ("n_decode_total", "counter", "Total number of llama_decode() calls", c.decodes),
            ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)", c.n_tokens_max),
            ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s",
             round(c.prompt_tokens / c.prompt_s, 3) if c.prompt_s else 0),
            ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s",
             round(c.predicted / c.predicted_s, 3) if c.predicted_s else 0),
            ("requests_processing", "gauge", "Number of requests processing", self.engine.busy()),
            ("requests_deferred", "gauge", "Number of requests deferred", len(self.engine.queue)),
            ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call",
             round(c.busy_in_decodes / c.decodes, 3) if c.decodes else 0),
        ]
        return "".join(f"# HELP llamacpp:{n} {h}\n# TYPE llamacpp:{n} {t}\nllamacpp:{n} {v}\n" for n, t, h, v in rows)

    async def _slot_action(self, ident: str, action: str, document: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if self.save_dir is None:
            return _error(501, "This server does not support slots action. Start it with `--slot-save-path`",
                          "not_supported_error")
        if action not in ("save", "restore", "erase"):
            return _error(400, "Invalid action", "invalid_request_error")
        try:
            slot = self.engine.slots[int(ident)]
        except (ValueError, IndexError):
            return _error(400, "Invalid slot ID", "invalid_request_error")
        while slot.busy:  # the server defers the task until the slot is free
            await asyncio.sleep(0.01)
        started = time.monotonic()
        if action == "erase":
            n = len(slot.tokens)
            slot.tokens = []
            return 200, {"id_slot": slot.id, "n_erased": n}
        filename = str(document.get("filename", ""))
        if not _FILENAME.match(filename) or filename in (".", ".."):
            return _error(400, "Invalid filename", "invalid_request_error")
        path = self.save_dir / filename
        if action == "save":
            data = SLOT_MAGIC + struct.pack(f"<I{len(slot.tokens)}I", len(slot.tokens), *slot.tokens)
            path.write_bytes(data)
            return 200, {"id_slot": slot.id, "filename": filename, "n_saved": len(slot.tokens), "n_written": len(data),
                         "timings": {"save_ms": (time.monotonic() - started) * 1000}}
        try:
            data = path.read_bytes()
            if not data.startswith(SLOT_MAGIC):
                raise ValueError
            (count,) = struct.unpack_from("<I", data, len(SLOT_MAGIC))
            tokens = list(struct.unpack_from(f"<{count}I", data, len(SLOT_MAGIC) + 4))
        except (OSError, ValueError, struct.error):
            return _error(400, "Unable to restore slot, no available space in KV cache or invalid slot save file",
                          "invalid_request_error")
        slot.tokens = tokens
        return 200, {"id_slot": slot.id, "filename": filename, "n_restored": len(tokens), "n_read": len(data),
                     "timings": {"restore_ms": (time.monotonic() - started) * 1000}}


# -- command line ------------------------------------------------------------------------------

HELP = """----- common params -----

-h,    --help, --usage                  print usage and exit
--version                               show version and build info
-t,    --threads N                      (taken, ignored: the stand-in computes nothing)

----- example-specific params -----

--host HOST                             ip address to listen (default: 127.0.0.1)
--port PORT                             port to listen (default: 8080)
--ports P1,P2,...                       stand-in only: one instance per port, all in this process
-c,    --ctx-size N                     size of the prompt context, shared by the slots (default: 2048 a slot)
-np,   --parallel N                     number of server slots (default: 4)
-b,    --batch-size N                   logical maximum batch size (default: 2048)
-cram, --cache-ram N                    prompt cache bound in MiB (default: 8192, -1 - no limit, 0 - disable)
--no-cache-idle-slots                   do not save idle slots to the prompt cache on a new task
-sps,  --slot-prompt-similarity SIMILARITY
                                        how much the prompt of a request must match the prompt of a slot in
                                        order to use that slot (default: 0.10, 0.0 = disabled)
--slot-save-path PATH                   path to save slot kv cache (default: disabled)
-m,    --model FNAME                    model path (read for its name only)
-a,    --alias STRING                   model name the API reports
--api-key KEY                           API key to use for authentication (default: none)
--api-key-file FNAME                    path to file containing API keys (default: none)
--metrics                               (always on)
--calibration FILE                      stand-in only: rates written by bench/standin/calibrate.py
--prefill-tps X | N:X,M:Y               stand-in only: prompt tokens/s (by prompt length)
--decode-tps X | 1:X,2:Y,4:Z            stand-in only: each slot's decode tokens/s by busy slots
--bytes-per-token F                     stand-in only: text bytes per token of its tokenizer
--kv-bytes-per-token N                  stand-in only: a cached token's bytes (the --cache-ram bound)
--load-s S                              stand-in only: seconds /health answers 503 "Loading model"
--jitter F                              stand-in only: each step's time varies by this relative spread (default 0)
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama-server (stand-in)", add_help=False, allow_abbrev=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--ports", default="")
    p.add_argument("-c", "--ctx-size", type=int, default=0)
    p.add_argument("-np", "--parallel", type=int, default=4)
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-cram", "--cache-ram", type=int, default=8192)
    p.add_argument("--no-cache-idle-slots", action="store_true")
    p.add_argument("-sps", "--slot-prompt-similarity", type=float, default=0.1)
    p.add_argument("--slot-save-path", default="")
    p.add_argument("-m", "--model", default="")
    p.add_argument("-a", "--alias", default="")
    p.add_argument("--api-key", default=None)
    p.add_argument("--api-key-file", default=os.environ.get("LLAMA_ARG_API_KEY_FILE"))
    p.add_argument("--calibration", default=os.environ.get("NUMA_INFER_STANDIN_CALIBRATION"))
    p.add_argument("--prefill-tps", default=None)
    p.add_argument("--decode-tps", default=None)
    p.add_argument("--bytes-per-token", type=float, default=None)
    p.add_argument("--kv-bytes-per-token", type=int, default=None)
    p.add_argument("--load-s", type=float, default=0.2)
    p.add_argument("--jitter", type=float, default=0.0)
    return p


def calibration_of(args: argparse.Namespace) -> dict[str, Any]:
    """DEFAULTS, then the calibration file, then the options given."""
    cal = dict(DEFAULTS)
    if args.calibration:
        cal.update({k: v for k, v in json.loads(Path(args.calibration).read_text()).items() if k in DEFAULTS})
    if args.prefill_tps:
        cal["prefill_tps"] = Rates.table(args.prefill_tps)
    if args.decode_tps:
        cal["decode_tps"] = Rates.table(args.decode_tps)
    if args.bytes_per_token:
        cal["bytes_per_token"] = args.bytes_per_token
    if args.kv_bytes_per_token:
        cal["kv_bytes_per_token"] = args.kv_bytes_per_token
    return cal


def parse(argv: list[str]) -> argparse.Namespace:
    args, _unknown = parser().parse_known_args(argv)  # llama-server options it does not model
    if args.api_key is None and args.api_key_file:
        lines = [x.strip() for x in Path(args.api_key_file).read_text().splitlines() if x.strip()]
        args.api_key = lines[0] if lines else None
    return args


async def serve(args: argparse.Namespace, ready: asyncio.Event | None = None) -> list[Instance]:
    """Start every instance of `args` in the running loop."""
    cal = calibration_of(args)
    ports = [int(p) for p in args.ports.split(",") if p.strip()] or [args.port]
    instances = [Instance(port, args, cal) for port in ports]
    for instance in instances:
        await instance.start()
    if ready is not None:
        ready.set()
    return instances


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--version" in argv:
        sys.stderr.write(VERSION)
        return
    if any(a in ("-h", "--help", "--usage") for a in argv):
        sys.stdout.write(HELP)
        return
    if "--list-devices" in argv:
        sys.stdout.write("Available devices:\n")
        return
    args = parse(argv)

    async def run() -> None:
        instances = await serve(args)
        print(f"stand-in: {len(instances)} instance(s) on {args.host}: "
              f"{','.join(str(i.port) for i in instances)}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
