"""What the stand-in models of one llama-server instance: a tokenizer, its slots and their
cached prompts, the `--cache-ram` prompt cache, the slot pick, and the time each step of
the engine takes. Pure: no I/O and no clock of its own (the server, or a test, says what
time it is), so the arithmetic is testable with a fake clock.

The rules follow llama.cpp's tools/server (the tree scripts/build-llama-server builds):
server-context.cpp `get_available_slot` (the pick), `server_slot::prompt_save/prompt_load`
and server-task.cpp `server_prompt_cache::alloc/load/update` (the cache), and
`update_slots` (one batch a step: a token for each generating slot, then prompt tokens up
to n_batch; at least one prompt token is always computed; the last sampled token is not
decoded, so it is not in the slot's cache).
"""

from __future__ import annotations

import re
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

VOCAB = 32000
BOS = 1
# Generated tokens are ids the tokenizer never produces from text: the model's own tokens,
# which the client's text sent back does not tokenize to again (as with the random-weight
# model, whose answers are read again even at home: bench/README.md, run 8).
GENERATED_BASE = 1 << 24
PIECES = ("fft", "ab", "qu", "zor", "el", "k", "mi", "tru", "ne", "x", "ov", "pa")


# -- tokens ------------------------------------------------------------------------------------

_WORDS = re.compile(rb"\s*\S+|\s+")


class Tokenizer:
    """Deterministic stand-in for the model's tokenizer: text split into words (leading
    whitespace kept with the word), each word cut into pieces of about `bytes_per_token`
    bytes, a piece's id a hash of its bytes. The same text always gives the same ids and
    a common prefix of two texts (at a word boundary) gives a common prefix of ids, which
    is all the routing and the cache depend on."""

    def __init__(self, bytes_per_token: float = 4.0) -> None:
        self.bytes_per_token = max(bytes_per_token, 0.5)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = [BOS] if bos else []
        for word in _WORDS.findall(text.encode()):
            count = max(1, round(len(word) / self.bytes_per_token))
            size, extra = divmod(len(word), count)
            at = 0
            for k in range(count):
                piece = word[at:at + size + (1 if k < extra else 0)]
                at += len(piece)
                ids.append(zlib.crc32(piece) % (VOCAB - 3) + 3)
        return ids


def chat_text(messages: list[dict[str, object]]) -> str:
    """The generated model's template (ChatML, as its /props says), with the generation
    prompt."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):  # typed parts: the text ones
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        out.append(f"<|im_start|>{message.get('role', 'user')}\n{content or ''}<|im_end|>\n")
    return "".join(out) + "<|im_start|>assistant\n"


def generated_token(task_id: int, index: int) -> tuple[int, str]:
    """The model's `index`-th token of a task: an id outside the tokenizer's and its text."""
    k = zlib.crc32(f"{task_id}:{index}".encode())
    return GENERATED_BASE + k % VOCAB, PIECES[k % len(PIECES)]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# -- rates -------------------------------------------------------------------------------------

def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through `points` (sorted by x), extended by the end segments."""
    if len(points) == 1:
        return points[0][1]
    if x <= points[0][0]:
        (x0, y0), (x1, y1) = points[0], points[1]
    elif x >= points[-1][0]:
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        k = next(i for i in range(1, len(points)) if points[i][0] >= x)
        (x0, y0), (x1, y1) = points[k - 1], points[k]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y1


@dataclass
class Rates:
    """How long the engine takes: reading prompts and decoding, as measured on the real
    server (calibrate.py).

    `prefill`: prompt length -> tokens/s reading a prompt of that length from an empty
    slot; T(n) = n / rate(n), piecewise linear between the lengths measured (so the cost
    of attention over a longer context is in it). Reading tokens a..b (a cached) takes
    max(T(b) - T(a), T(b - a) + a x `cached_s`): a batch's fixed cost stays even when the
    slot holds most of the prompt, and a request that reads after a cached prefix pays for
    its length (measured: 50 tokens after 1,000 cached take 0.40 s, T(50) 0.10 s).
    `decode`: busy slots -> tokens/s of each one (one step of the engine decodes a token
    for every generating slot); past the last measured count the step grows in proportion.
    """

    prefill: dict[int, float] = field(default_factory=lambda: {512: 250.0})
    decode: dict[int, float] = field(default_factory=lambda: {1: 40.0})
    cached_s: float = 0.0  # seconds per cached token, once per read after a cached prefix

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode or min(self.prefill.values()) <= 0 or min(self.decode.values()) <= 0:
            raise ValueError("rates must be positive, and at least one of each")
        self._t = [(0.0, 0.0)] + [(float(n), n / r) for n, r in sorted(self.prefill.items()) if n > 0]
        self._d = sorted((float(b), float(r)) for b, r in self.decode.items())

    def prompt_s(self, n: int) -> float:
        """T(n): reading n tokens into an empty slot."""
        return max(_interpolate(self._t, n), 0.0) if n > 0 else 0.0

    def prefill_s(self, cached: int, total: int) -> float:
        """Reading tokens cached..total of a prompt."""
        if total <= cached:
            return 0.0
        return max(self.prompt_s(total) - self.prompt_s(cached),
                   self.prompt_s(total - cached) + cached * self.cached_s)

    def decode_tps(self, busy: int) -> float:
        """Tokens/s of each of `busy` generating slots."""
        busy = max(busy, 1)
        last_b, last_r = self._d[-1]
        if busy > last_b:
            return last_r * last_b / busy
        if busy <= self._d[0][0]:
            return self._d[0][1]
        return _interpolate(self._d, busy)

    def step_s(self, busy: int) -> float:
        return 1.0 / self.decode_tps(busy)

    @staticmethod
    def table(text: str) -> dict[int, float]:
        """"X" (one rate) or "N:X,M:Y" -> {N: X, M: Y}."""
        text = text.strip()
        if ":" not in text:
            return {1: float(text)}
        return {int(k): float(v) for k, v in (p.split(":") for p in text.split(",") if p.strip())}

    def to_json(self) -> dict[str, object]:
        return {"prefill_tps": {str(k): v for k, v in sorted(self.prefill.items())},
                "decode_tps": {str(k): v for k, v in sorted(self.decode.items())},
                "cached_ms_per_token": self.cached_s * 1000}


# -- the prompt cache --------------------------------------------------------------------------

@dataclass
class CacheEntry:
    tokens: list[int]
    size: int  # bytes


class PromptCache:
    """`--cache-ram`: saved slot prompts, oldest saved first out when over the bound
    (server_prompt_cache). limit_bytes None: no bound."""

    def __init__(self, limit_bytes: int | None, bytes_per_token: int) -> None:
        self.limit = limit_bytes
        self.bytes_per_token = bytes_per_token
        self.entries: list[CacheEntry] = []

    def size(self) -> int:
        return sum(e.size for e in self.entries)

    def save(self, tokens: list[int]) -> bool:
        """alloc(): a copy of a slot's prompt. Not when an entry already holds all of it or
        it alone is over the bound; entries it holds all of are dropped; the oldest go
        until it fits."""
        if not tokens:
            return False
        if any(common_prefix(e.tokens, tokens) == len(tokens) for e in self.entries):
            return False
        size = len(tokens) * self.bytes_per_token
        if self.limit is not None and size > self.limit:
            return False
        self.entries = [e for e in self.entries if common_prefix(e.tokens, tokens) != len(e.tokens)]
        while self.entries and self.limit is not None and self.size() + size > self.limit:
            self.entries.pop(0)
        self.entries.append(CacheEntry(list(tokens), size))
        return True

    def load(self, held: list[int], new: list[int]) -> list[int] | None:
        """load(): the entry that keeps more of itself and covers more of the new prompt
        than the slot's own `held` prompt does (none that would keep under a quarter of
        itself); it leaves the cache. None: keep the slot's."""
        lcp = common_prefix(held, new)
        keep_best = lcp / len(held) if held else -1.0
        sim_best = lcp / max(len(new), 1)
        best = None
        for entry in self.entries:
            n = common_prefix(entry.tokens, new)
            keep, sim = n / len(entry.tokens), n / max(len(new), 1)
            if keep < 0.25:
                continue
            if keep_best < keep and sim_best < sim:
                keep_best, sim_best, best = keep, sim, entry
        if best is None:
            return None
        self.entries.remove(best)
        return best.tokens


# -- slots, tasks and the engine ---------------------------------------------------------------

@dataclass
class Task:
    tokens: list[int]
    max_tokens: int
    id: int = 0
    id_slot: int = -1
    notify: Callable[["Task"], None] = lambda task: None
    # filled in as it runs
    slot: int = -1
    cached: int = 0
    t_queued: float = 0.0
    t_start: float = 0.0  # its slot taken: the prompt's time starts
    t_prompt_done: float = 0.0
    t_last: float = 0.0
    generated: list[tuple[int, str]] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False
    error: str = ""

    @property
    def prompt_n(self) -> int:
        return len(self.tokens) - self.cached

    def timings(self) -> dict[str, float]:
        """As llama-server's `timings` (server-task.cpp, result_timings::to_json)."""
        prompt_ms = (self.t_prompt_done - self.t_start) * 1000
        predicted_ms = (self.t_last - self.t_prompt_done) * 1000
        n, p = len(self.generated), self.prompt_n
        return {"cache_n": self.cached, "prompt_n": p, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / p if p else 0.0,
                "prompt_per_second": 1000 * p / prompt_ms if prompt_ms > 0 else 0.0,
                "predicted_n": n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / n if n else 0.0,
                "predicted_per_second": 1000 * n / predicted_ms if predicted_ms > 0 else 0.0}


@dataclass
class Slot:
    id: int
    tokens: list[int] = field(default_factory=list)  # its cached prompt
    task: Task | None = None
    t_last_used: float = -1.0
    n_past: int = 0  # prompt tokens read so far for its task
    pending: int | None = None  # the last sampled token, not yet decoded
    last_task: Task | None = None

    @property
    def busy(self) -> bool:
        return self.task is not None


def pick_slot(slots: list[Slot], tokens: list[int], similarity: float, id_slot: int = -1) -> tuple[Slot | None, bool]:
    """get_available_slot(): the slot for a new prompt and whether the prompt cache is to
    be consulted. With `similarity` (-sps) not 0: the idle slot whose prompt shares the
    largest fraction of the new one, above the threshold (the cache only when that keeps
    under half of the slot's prompt); else the least recently used idle slot (the last of
    equals), and the cache."""
    chosen: Slot | None = None
    update = False
    if id_slot != -1:
        chosen = next((s for s in slots if s.id == id_slot), None)
    if similarity != 0.0:
        best = 0.0
        best_slot = None
        for slot in slots:
            if (id_slot != -1 and slot.id != id_slot) or slot.busy or not slot.tokens:
                continue
            sim = common_prefix(slot.tokens, tokens) / max(len(tokens), 1)
            if sim > best and sim > similarity:
                best, best_slot = sim, slot
        if best_slot is not None:
            chosen = best_slot
            if best * len(tokens) / len(best_slot.tokens) < 0.5:
                update = True
    if chosen is None:
        t_last = -1.0
        for slot in slots:
            if slot.busy:
                continue
            if chosen is None or slot.t_last_used <= t_last:
                t_last, chosen = slot.t_last_used, slot
        if chosen is not None:
            update = True
    return chosen, update


@dataclass
class Counters:
    prompt_tokens: int = 0
    prompt_cached: int = 0
    prompt_s: float = 0.0
    predicted: int = 0
    predicted_s: float = 0.0
    decodes: int = 0
    busy_in_decodes: int = 0
    n_tokens_max: int = 0


class Engine:
    """One instance: its slots, its prompt cache, its queue of tasks waiting for a slot, and
    its steps. The driver calls `begin_step(now)` for the duration of the next step (None:
    nothing to do), waits that long, then `end_step(now)`; `submit` and `cancel` any time."""

    def __init__(self, rates: Rates, parallel: int = 1, ctx_per_slot: int = 2048, cache_ram_mib: int = 8192,
                 similarity: float = 0.1, kv_bytes_per_token: int = 49152, n_batch: int = 2048,
                 cache_idle_slots: bool = True, noise: Callable[[], float] = lambda: 1.0) -> None:
        self.rates = rates
        self.noise = noise  # a factor on each step's time (server.py's --jitter): the host's own spread
        self.slots = [Slot(i) for i in range(parallel)]
        self.n_ctx = ctx_per_slot
        self.similarity = similarity
        self.n_batch = n_batch
        self.cache = None if cache_ram_mib == 0 else PromptCache(
            None if cache_ram_mib < 0 else cache_ram_mib << 20, kv_bytes_per_token)
        self.cache_idle_slots = cache_idle_slots and self.cache is not None
        self.kv_bytes_per_token = kv_bytes_per_token
        self.queue: deque[Task] = deque()
        self.counters = Counters()
        # the step under way: (slot, its task, prompt tokens taken or -1: a decode)
        self._plan: list[tuple[Slot, Task, int]] | None = None
        self._ids = 0

    # -- tasks ---------------------------------------------------------------------------------

    def submit(self, task: Task, now: float) -> None:
        self._ids += 1
        task.id = task.id or self._ids
        task.t_queued = now
        if len(task.tokens) >= self.n_ctx:
            task.error = "the request exceeds the available context size, try increasing it"
            task.done = True
            task.notify(task)
            return
        self.queue.append(task)
        self._launch(now)

    def cancel(self, task: Task, now: float) -> None:
        """The client left: the task ends where it is (its slot keeps what it read)."""
        if task.done:
            return
        task.cancelled = task.done = True
        if task in self.queue:
            self.queue.remove(task)
            return
        for slot in self.slots:
            if slot.task is task:  # it keeps what was read (and decoded) so far
                self._release(slot, now)
        self._launch(now)

    def busy(self) -> int:
        return sum(s.busy for s in self.slots)

    def _launch(self, now: float) -> None:
        """Tasks from the queue into free slots, in order (a task for a busy slot waits)."""
        while self.queue:
            task = self.queue[0]
            slot, update = pick_slot(self.slots, task.tokens, self.similarity, task.id_slot)
            if slot is None or slot.busy:
                return
            self.queue.popleft()
            if update and self.cache is not None:
                self.cache.save(slot.tokens)
                loaded = self.cache.load(slot.tokens, task.tokens)
                if loaded is not None:
                    slot.tokens = loaded
            n_past = min(common_prefix(slot.tokens, task.tokens), len(task.tokens) - 1)
            slot.tokens = slot.tokens[:n_past]
            slot.n_past = n_past
            slot.pending = None
            slot.task = task
            task.slot, task.cached, task.t_start = slot.id, n_past, now
            self.counters.prompt_cached += n_past
            if self.cache_idle_slots and self.cache is not None:
                for other in self.slots:
                    if not other.busy:
                        self.cache.save(other.tokens)

    def _release(self, slot: Slot, now: float) -> None:
        slot.last_task, slot.task = slot.task, None
        slot.pending = None
        slot.t_last_used = now

    # -- steps ---------------------------------------------------------------------------------

    def begin_step(self, now: float) -> float | None:
        """Plan the next batch; its duration, or None when no slot has work."""
        plan: list[tuple[Slot, Task, int]] = [(s, s.task, -1) for s in self.slots
                                               if s.task is not None and s.task.t_prompt_done > 0]
        generating = len(plan)
        budget = self.n_batch - generating
        duration = self.rates.step_s(generating) if generating else 0.0
        for slot in self.slots:
            task = slot.task
            if task is None or task.t_prompt_done > 0 or budget <= 0:
                continue
            take = min(len(task.tokens) - slot.n_past, budget)
            budget -= take
            plan.append((slot, task, take))
            duration += self.rates.prefill_s(slot.n_past, slot.n_past + take)
        if not plan:
            self._plan = None
            return None
        self._plan = plan
        duration *= self.noise()
        if generating:
            self.counters.decodes += 1
            self.counters.busy_in_decodes += generating
        return duration

    def end_step(self, now: float) -> list[Task]:
        """The batch is done: each generating slot has its next token, each prompt read
        to its end its first. The tasks that moved (to be told)."""
        moved: list[Task] = []
        for slot, task, take in self._plan or []:
            if slot.task is not task or task.done:  # cancelled meanwhile
                continue
            if take >= 0:
                slot.tokens.extend(task.tokens[slot.n_past:slot.n_past + take])
                slot.n_past += take
                if slot.n_past < len(task.tokens):
                    continue
                task.t_prompt_done = now
                self.counters.prompt_tokens += task.prompt_n
                self.counters.prompt_s += now - task.t_start
            elif slot.pending is not None:
                slot.tokens.append(slot.pending)  # the sampled token, decoded in this batch
            token = generated_token(task.id, len(task.generated))
            task.generated.append(token)
            slot.pending = token[0]
            task.t_last = now
            self.counters.predicted += 1
            self.counters.n_tokens_max = max(self.counters.n_tokens_max, len(slot.tokens) + 1)
            if len(task.generated) >= task.max_tokens or len(slot.tokens) + 1 >= self.n_ctx:
                task.done = True
                self.counters.predicted_s += now - task.t_prompt_done
                self._release(slot, now)
            moved.append(task)
        self._plan = None
        self._launch(now)
        for task in moved:
            task.notify(task)
        return moved


def run_until_idle(engine: Engine, now: float = 0.0) -> float:
    """Drive an engine with a fake clock until nothing is left to do; the time then."""
    while (duration := engine.begin_step(now)) is not None:
        now += duration
        engine.end_step(now)
    return now
